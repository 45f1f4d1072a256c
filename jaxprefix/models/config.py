"""ModelConfig: one frozen, hashable description of a decoder-only LM.

Covers Llama 3.x, Qwen2/2.5, Qwen3, Qwen3-MoE (Qwen3-30B-A3B, 235B-A22B), Qwen2-MoE (a shared
expert too), Gemma 3 (text) and SmolLM2 (a tied-embedding Llama).

It is static under jit, so every field is a Python scalar, string or tuple. `from_hf` reads a
transformers config.json dict (old `rope_theta`/`rope_scaling` or new `rope_parameters` style);
`to_hf` writes one that transformers loads back into the same architecture.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

SUPPORTED_MODEL_TYPES = ('llama', 'qwen2', 'qwen3', 'gemma3_text', 'qwen3_moe', 'qwen2_moe')
_MOE_TYPES = ('qwen3_moe', 'qwen2_moe')
_ARCHITECTURES = {'llama': 'LlamaForCausalLM', 'qwen2': 'Qwen2ForCausalLM',
                  'qwen3': 'Qwen3ForCausalLM', 'qwen3_moe': 'Qwen3MoeForCausalLM',
                  'qwen2_moe': 'Qwen2MoeForCausalLM',
                  'gemma3_text': 'Gemma3ForCausalLM'}
FULL, SLIDING = 'full_attention', 'sliding_attention'


@dataclasses.dataclass(frozen=True)
class Rope:
    """Rotary embedding frequencies: 'default', 'linear' (positions / factor) or 'llama3'."""
    theta: float = 10_000.0
    kind: str = 'default'
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192

    @classmethod
    def from_hf(cls, params: dict | None, theta: float) -> Rope:
        params = dict(params or {})
        kind = params.get('rope_type', params.get('type', 'default'))
        if kind not in ('default', 'linear', 'llama3'):
            raise ValueError(f"rope_type {kind!r} is not supported (supported: default, linear, llama3)")
        return cls(theta=float(params.get('rope_theta', theta)), kind=kind,
                   factor=float(params.get('factor', 1.0)),
                   low_freq_factor=float(params.get('low_freq_factor', 1.0)),
                   high_freq_factor=float(params.get('high_freq_factor', 4.0)),
                   original_max_position=int(params.get('original_max_position_embeddings', 8192)))

    def to_hf(self) -> dict:
        out: dict[str, Any] = {'rope_type': self.kind, 'rope_theta': self.theta}
        if self.kind in ('linear', 'llama3'):
            out['factor'] = self.factor
        if self.kind == 'llama3':
            out.update(low_freq_factor=self.low_freq_factor, high_freq_factor=self.high_freq_factor,
                       original_max_position_embeddings=self.original_max_position)
        return out


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope: Rope = Rope()
    local_rope: Rope | None = None        # rope of sliding-window layers when it differs (Gemma 3)
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = False
    qkv_bias: bool = False                # Qwen2: bias on q/k/v only
    out_bias: bool = False                # Llama attention_bias=True: o_proj too
    qk_norm: bool = False                 # Qwen3, Gemma 3: RMSNorm on each q/k head
    norm_plus_one: bool = False           # Gemma: RMSNorm scales by (1 + w), w initialised at 0
    sandwich_norms: bool = False          # Gemma 3: norms after attention and after the MLP too
    embed_scale: bool = False             # Gemma: embeddings times sqrt(hidden_size)
    activation: str = 'silu'              # gated MLP activation: 'silu' | 'gelu_tanh'
    query_pre_attn_scalar: float | None = None  # scores scale = this ** -0.5 (default head_dim)
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()     # per layer FULL | SLIDING; () means all FULL
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    param_dtype: str = 'float32'
    dtype: str = 'float32'                # compute dtype; softmax, norms and logits stay f32
    remat: bool = False                   # rematerialise each layer in the backward pass
    # Mixture of experts (Qwen3-MoE); num_experts=0 is a dense model. A layer is sparse unless
    # it is in mlp_only_layers or (layer + 1) % decoder_sparse_step != 0 (transformers' rule);
    # dense layers keep the gated MLP of width intermediate_size.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False          # renormalise the top-k router probabilities to sum 1
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: + sigmoid(gate(x)) * a gated MLP of this width

    def __post_init__(self):
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type {self.model_type!r} is not supported; "
                             f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f'num_heads ({self.num_heads}) must be a multiple of '
                             f'num_kv_heads ({self.num_kv_heads})')
        if self.activation not in ('silu', 'gelu_tanh'):
            raise ValueError(f"activation {self.activation!r}: expected 'silu' or 'gelu_tanh'")
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ValueError(f'layer_types has {len(self.layer_types)} entries, expected '
                             f'num_layers={self.num_layers}')
        if SLIDING in self.layer_types and not self.sliding_window:
            raise ValueError('layer_types has sliding_attention layers but sliding_window is not set')
        if self.num_experts:
            if not 0 < self.num_experts_per_tok <= self.num_experts:
                raise ValueError(f'num_experts_per_tok ({self.num_experts_per_tok}) must be in '
                                 f'1..num_experts ({self.num_experts})')
            if self.moe_intermediate_size <= 0 or self.decoder_sparse_step <= 0:
                raise ValueError('a MoE needs moe_intermediate_size > 0 and decoder_sparse_step > 0')
        object.__setattr__(self, 'mlp_only_layers', tuple(self.mlp_only_layers))
        # Dtypes are kept as names so the config stays hashable and JSON-friendly.
        object.__setattr__(self, 'param_dtype', jnp.dtype(self.param_dtype).name)
        object.__setattr__(self, 'dtype', jnp.dtype(self.dtype).name)
        object.__setattr__(self, 'layer_types', tuple(self.layer_types))
        object.__setattr__(self, 'eos_token_ids', tuple(self.eos_token_ids))

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    @property
    def is_sliding(self) -> tuple[bool, ...]:
        return tuple(t == SLIDING for t in self.layer_types) or (False,) * self.num_layers

    @property
    def sparse_layers(self) -> tuple[bool, ...]:
        """Per layer: does its MLP route over experts (else it is the dense gated MLP)?"""
        return tuple(bool(self.num_experts) and i not in self.mlp_only_layers
                     and (i + 1) % self.decoder_sparse_step == 0 for i in range(self.num_layers))

    @property
    def attn_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    # --- transformers config.json ------------------------------------------------------------

    @classmethod
    def from_hf(cls, hf: dict, *, param_dtype='float32', dtype=None, remat=False) -> ModelConfig:
        """Reads a transformers config dict; raises on architectures this package cannot run."""
        model_type = hf.get('model_type')
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"config.json: model_type {model_type!r} is not supported; "
                             f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
        try:
            return cls._from_hf(hf, model_type, param_dtype, dtype or param_dtype, remat)
        except KeyError as e:
            raise ValueError(f'config.json ({model_type}): missing field {e.args[0]!r}') from None

    @classmethod
    def _from_hf(cls, hf, model_type, param_dtype, dtype, remat):
        gemma = model_type == 'gemma3_text'
        hidden, heads = hf['hidden_size'], hf['num_attention_heads']
        num_layers = hf['num_hidden_layers']
        rope_params = hf.get('rope_parameters') or hf.get('rope_scaling')
        if gemma:
            rope_params = rope_params or {}
            nested = isinstance(rope_params.get(FULL), dict) or isinstance(rope_params.get(SLIDING), dict)
            full = rope_params.get(FULL) if nested else rope_params
            rope = Rope.from_hf(full, hf.get('rope_theta', 1_000_000.0))
            local_rope = Rope.from_hf(rope_params.get(SLIDING) if nested else None,
                                      hf.get('rope_local_base_freq', 10_000.0))
            pattern = hf.get('sliding_window_pattern', 6)
            layer_types = hf.get('layer_types') or [
                SLIDING if (i + 1) % pattern else FULL for i in range(num_layers)]
        else:
            rope = Rope.from_hf(rope_params, hf.get('rope_theta', 10_000.0))
            local_rope = None
            layer_types = hf.get('layer_types') or []
            if hf.get('use_sliding_window') and not layer_types:
                first = hf.get('max_window_layers', num_layers)
                layer_types = [SLIDING if i >= first else FULL for i in range(num_layers)]
        layer_types = tuple(layer_types)
        if SLIDING not in layer_types:
            layer_types = ()
        bias = bool(hf.get('attention_bias', False))
        if hf.get('mlp_bias'):
            raise ValueError(f'config.json ({model_type}): mlp_bias=True is not supported')
        act = hf.get('hidden_activation') or hf.get('hidden_act') or 'silu'
        activations = {'silu': 'silu', 'gelu_pytorch_tanh': 'gelu_tanh', 'gelu_tanh': 'gelu_tanh'}
        if act not in activations:
            raise ValueError(f'config.json ({model_type}): activation {act!r} is not supported '
                             f'(supported: {", ".join(activations)})')
        eos = hf.get('eos_token_id')
        eos = () if eos is None else (tuple(eos) if isinstance(eos, (list, tuple)) else (eos,))
        return cls(
            model_type=model_type, vocab_size=hf['vocab_size'], hidden_size=hidden,
            intermediate_size=hf['intermediate_size'], num_layers=num_layers, num_heads=heads,
            num_kv_heads=hf.get('num_key_value_heads') or heads,
            head_dim=hf.get('head_dim') or hidden // heads,
            rms_norm_eps=float(hf.get('rms_norm_eps', 1e-6 if gemma else 1e-5)),
            rope=rope, local_rope=local_rope,
            max_position_embeddings=hf.get('max_position_embeddings', 8192),
            tie_word_embeddings=bool(hf.get('tie_word_embeddings', gemma)),
            qkv_bias=bias or model_type == 'qwen2' or (model_type == 'qwen2_moe'
                                                       and hf.get('qkv_bias', True)),
            out_bias=bias,
            qk_norm=model_type in ('qwen3', 'qwen3_moe', 'gemma3_text'),
            norm_plus_one=gemma, sandwich_norms=gemma, embed_scale=gemma,
            activation=activations[act],
            query_pre_attn_scalar=hf.get('query_pre_attn_scalar', 256) if gemma else None,
            sliding_window=hf.get('sliding_window') if layer_types else None,
            layer_types=layer_types,
            attn_logit_softcapping=hf.get('attn_logit_softcapping'),
            final_logit_softcapping=hf.get('final_logit_softcapping'),
            bos_token_id=hf.get('bos_token_id'), eos_token_ids=eos,
            pad_token_id=hf.get('pad_token_id'),
            param_dtype=param_dtype, dtype=dtype, remat=remat,
            **(_moe_from_hf(hf) if model_type in _MOE_TYPES else {}))

    def to_hf(self) -> dict:
        """A config.json dict that transformers loads into the same architecture."""
        gemma = self.model_type == 'gemma3_text'
        layer_types = list(self.layer_types) or [FULL] * self.num_layers
        out: dict[str, Any] = {
            'architectures': [_ARCHITECTURES[self.model_type]], 'model_type': self.model_type,
            'vocab_size': self.vocab_size, 'hidden_size': self.hidden_size,
            'intermediate_size': self.intermediate_size, 'num_hidden_layers': self.num_layers,
            'num_attention_heads': self.num_heads, 'num_key_value_heads': self.num_kv_heads,
            'head_dim': self.head_dim, 'rms_norm_eps': self.rms_norm_eps,
            'max_position_embeddings': self.max_position_embeddings,
            'tie_word_embeddings': self.tie_word_embeddings,
            'bos_token_id': self.bos_token_id, 'pad_token_id': self.pad_token_id,
            'eos_token_id': (list(self.eos_token_ids) if len(self.eos_token_ids) > 1
                             else (self.eos_token_ids[0] if self.eos_token_ids else None)),
            'torch_dtype': self.param_dtype, 'layer_types': layer_types,
        }
        if gemma:
            local = self.local_rope or Rope(theta=10_000.0)
            out.update(rope_parameters={FULL: self.rope.to_hf(), SLIDING: local.to_hf()},
                       hidden_activation='gelu_pytorch_tanh', attention_bias=self.qkv_bias,
                       query_pre_attn_scalar=self.query_pre_attn_scalar,
                       sliding_window=self.sliding_window,
                       attn_logit_softcapping=self.attn_logit_softcapping,
                       final_logit_softcapping=self.final_logit_softcapping)
        else:
            qwen2 = self.model_type in ('qwen2', 'qwen2_moe')
            if qwen2 and self.out_bias:
                raise ValueError(f'{self.model_type} has no o_proj bias; this config cannot be '
                                 f'exported as {self.model_type}')
            if self.model_type == 'qwen2' and not self.qkv_bias:
                raise ValueError('qwen2 always has q/k/v biases; this config cannot be exported as qwen2')
            act = {'silu': 'silu', 'gelu_tanh': 'gelu_pytorch_tanh'}[self.activation]
            out.update(rope_parameters=self.rope.to_hf(), hidden_act=act,
                       attention_bias=self.out_bias, mlp_bias=False)
            if self.layer_types:
                out.update(use_sliding_window=True, sliding_window=self.sliding_window,
                           max_window_layers=layer_types.index(SLIDING))
        if self.num_experts:
            out.update(num_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok,
                       moe_intermediate_size=self.moe_intermediate_size,
                       norm_topk_prob=self.norm_topk_prob,
                       decoder_sparse_step=self.decoder_sparse_step,
                       mlp_only_layers=list(self.mlp_only_layers))
        if self.model_type == 'qwen2_moe':
            out.update(qkv_bias=self.qkv_bias,
                       shared_expert_intermediate_size=self.shared_expert_intermediate_size)
        return out

    # --- accounting ---------------------------------------------------------------------------

    def num_params(self, *, embeddings: bool = True, active: bool = False) -> int:
        """Parameter count; with embeddings=False the input embedding table is left out; with
        active=True a sparse layer counts only the experts one token passes through."""
        d, f, l = self.hidden_size, self.intermediate_size, self.num_layers
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        per_layer = d * (q + 2 * kv) + q * d + 2 * d
        per_layer += (q + 2 * kv) * self.qkv_bias + d * self.out_bias
        per_layer += 2 * self.head_dim * self.qk_norm + 2 * d * self.sandwich_norms
        sparse = sum(self.sparse_layers)
        experts = self.num_experts_per_tok if active else self.num_experts
        mlp = (l - sparse) * 3 * d * f
        mlp += sparse * (d * self.num_experts + experts * 3 * d * self.moe_intermediate_size)
        if self.shared_expert_intermediate_size:
            mlp += sparse * (3 * d * self.shared_expert_intermediate_size + d)
        total = l * per_layer + mlp + d
        total += self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
        if not embeddings:
            total -= self.vocab_size * d
        return total

    def decode_step_params(self, rows: float) -> float:
        """Weights one decode step of `rows` tokens must read (none twice): every weight but the
        input embedding table (only `rows` of its rows are read), of a MoE's experts only those
        some token routes to: expected_experts(rows, k, E) per sparse layer."""
        every = self.num_params(embeddings=False)
        if self.tie_word_embeddings:  # the table is the unembedding too, read whole
            every += self.vocab_size * self.hidden_size
        if not self.num_experts:
            return float(every)
        expert = 3 * self.hidden_size * self.moe_intermediate_size
        touched = expected_experts(rows, self.num_experts_per_tok, self.num_experts)
        return every - sum(self.sparse_layers) * (self.num_experts - touched) * expert

    def flops_per_token(self, context_length: int = 0) -> float:
        """Forward FLOPs of one token: 2N + 4 * layers * context * heads * head_dim.

        N counts every matmul weight a token passes through (of a MoE layer, the router and the
        top-k experts): all layers plus the unembedding
        (a real V x D matmul even when tied; the embedding lookup is free, so it is left out).
        The attention term is the QK^T and AV products against `context_length` earlier keys
        (Kaplan et al. 2020). A training step costs about 3x this (forward + backward).
        """
        n = self.num_params(embeddings=False, active=True)
        if self.tie_word_embeddings:
            n += self.vocab_size * self.hidden_size
        attn = 4 * self.num_layers * context_length * self.num_heads * self.head_dim
        return float(2 * n + attn)


def expected_experts(tokens: float, k: int, num_experts: int) -> float:
    """Distinct experts `tokens` tokens route to in one layer, each picking k of num_experts
    uniformly: an expert escapes one token with probability 1 - k/E, so all of them with
    (1 - k/E)^tokens (docs/SCALING.md; a skewed router touches fewer)."""
    return num_experts * (1 - (1 - k / num_experts) ** tokens)


def _moe_from_hf(hf: dict) -> dict:
    """The MoE fields of a qwen3_moe / qwen2_moe config.json (transformers 5 writes
    num_local_experts)."""
    experts = hf.get('num_experts', hf.get('num_local_experts'))
    if experts is None:
        raise KeyError('num_experts')
    return dict(num_experts=int(experts), num_experts_per_tok=int(hf['num_experts_per_tok']),
                moe_intermediate_size=int(hf['moe_intermediate_size']),
                norm_topk_prob=bool(hf.get('norm_topk_prob', False)),
                decoder_sparse_step=int(hf.get('decoder_sparse_step', 1)),
                mlp_only_layers=tuple(hf.get('mlp_only_layers') or ()),
                shared_expert_intermediate_size=int(hf.get('shared_expert_intermediate_size') or 0))
