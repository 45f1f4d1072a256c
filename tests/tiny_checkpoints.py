"""Tiny random transformers checkpoints (CPU torch, f32), shared by tests across the package.

`hf_model(family)` builds a random transformers causal LM; `save_checkpoint(family, path)`
writes it as an HF directory (config.json + safetensors) and returns the model too, so a test
can compare against the reference logits. All norms and biases are randomised as well, so a
wrong (1 + w) convention or a dropped bias shows up in parity tests.

Shapes are small but cover the awkward cases: GQA (4 query heads over 2 KV heads) and
head_dim (24) != hidden / heads (16).
"""
from __future__ import annotations

import pathlib

import numpy as np
import torch
import transformers

VOCAB = 128
_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=24,
               max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0)

# family -> (config class, model class, config overrides)
FAMILIES = {
    'llama': (transformers.LlamaConfig, transformers.LlamaForCausalLM,
              dict(tie_word_embeddings=True, rope_theta=10_000.0)),           # SmolLM2-like
    'llama_untied': (transformers.LlamaConfig, transformers.LlamaForCausalLM,
                     dict(tie_word_embeddings=False, rope_theta=500_000.0)),
    'llama3_rope': (transformers.LlamaConfig, transformers.LlamaForCausalLM,
                    dict(tie_word_embeddings=False, rope_scaling=dict(
                        rope_type='llama3', factor=8.0, low_freq_factor=1.0,
                        high_freq_factor=4.0, original_max_position_embeddings=32),
                        rope_theta=10_000.0)),
    'qwen2': (transformers.Qwen2Config, transformers.Qwen2ForCausalLM,
              dict(tie_word_embeddings=False, rope_theta=1_000_000.0)),
    'qwen3': (transformers.Qwen3Config, transformers.Qwen3ForCausalLM,
              dict(tie_word_embeddings=True, rope_theta=1_000_000.0)),
    # A mixture of experts: 4 experts, 2 per token, renormalised; tests vary the MoE fields.
    'qwen3_moe': (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM,
                  dict(tie_word_embeddings=False, rope_theta=1_000_000.0, num_experts=4,
                       num_experts_per_tok=2, moe_intermediate_size=40, norm_topk_prob=True)),
    'qwen2_moe': (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM,
                  dict(tie_word_embeddings=False, rope_theta=1_000_000.0, num_experts=4,
                       num_experts_per_tok=2, moe_intermediate_size=40,
                       shared_expert_intermediate_size=56, mlp_only_layers=[1])),
    'gemma3': (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM,
               dict(tie_word_embeddings=True, sliding_window=4, query_pre_attn_scalar=20,
                    layer_types=['sliding_attention', 'full_attention'],
                    rope_parameters={'sliding_attention': {'rope_type': 'default',
                                                           'rope_theta': 10_000.0},
                                     'full_attention': {'rope_type': 'linear', 'factor': 4.0,
                                                        'rope_theta': 1_000_000.0}},
                    final_logit_softcapping=3.0, hidden_activation='gelu_pytorch_tanh')),
}


def hf_config(family: str, **overrides) -> transformers.PretrainedConfig:
    config_cls, _, extra = FAMILIES[family]
    return config_cls(**{**_COMMON, **extra, **overrides})


def hf_model(family: str, seed: int = 0, **overrides) -> transformers.PreTrainedModel:
    """A random f32 transformers model of `family` in eval mode, eager attention."""
    _, model_cls, _ = FAMILIES[family]
    config = hf_config(family, **overrides)
    config._attn_implementation = 'eager'
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith('norm.weight') or name.endswith('layernorm.weight') or name.endswith('bias'):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen) + (0.0 if 'gemma' in family else 1.0))
            else:
                p.copy_(0.08 * torch.randn(p.shape, generator=gen))
    return model


def save_checkpoint(family: str, path, seed: int = 0, max_shard_size=None, **overrides):
    """Writes a tiny checkpoint directory; returns (path, the transformers model)."""
    model = hf_model(family, seed, **overrides)
    path = pathlib.Path(path)
    kwargs = {} if max_shard_size is None else dict(max_shard_size=max_shard_size)
    model.save_pretrained(path, safe_serialization=True, **kwargs)
    return path, model


def hf_logits(model, tokens: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
    """Reference logits [B, T, V] (f32 numpy); mask marks real tokens (left padding ok)."""
    ids = torch.as_tensor(np.asarray(tokens), dtype=torch.long)
    kwargs = {}
    if mask is not None:
        m = torch.as_tensor(np.asarray(mask), dtype=torch.long)
        kwargs = dict(attention_mask=m, position_ids=(m.cumsum(-1) - 1).clamp(min=0))
    with torch.no_grad():
        return model(input_ids=ids, **kwargs).logits.float().numpy()


def random_tokens(batch: int, length: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(3, VOCAB, size=(batch, length), dtype=np.int32)


def llama_over(tokenizer, **config):
    """A tiny random jaxprefix llama over `tokenizer`'s vocabulary (SmolLM2's in the tests that
    need a real chat template); `config`: ModelConfig fields besides."""
    from flax import nnx

    from jaxprefix import models

    config = models.ModelConfig(
        model_type="llama", vocab_size=tokenizer.vocab_size, hidden_size=32, intermediate_size=48,
        num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, tie_word_embeddings=True,
        eos_token_ids=(tokenizer.eos_id,), bos_token_id=tokenizer.bos_id, **config)
    return models.Decoder(config, rngs=nnx.Rngs(0))


def save_llama_over(tokenizer, path) -> str:
    """llama_over(tokenizer) saved with that tokenizer as an HF directory; returns its path."""
    from jaxprefix.checkpoints.hf import save_pretrained

    model = llama_over(tokenizer)
    save_pretrained(model, model.config, str(path), tokenizer=tokenizer)
    return str(path)
