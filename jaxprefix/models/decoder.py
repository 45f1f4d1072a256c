"""Decoder (flax.nnx): embed -> layers (scanned, weights stacked over layers) -> norm -> unembed.

One code path serves training and sampling: `_run` embeds the new tokens, then each layer
(decoder_layer.py) attends over the read-only context segments plus either the new tokens
themselves (no cache) or a KVCache the new tokens are first written into. The layer weights are stacked along a
leading 'layers' axis and the layers run under lax.scan, so a 30-layer model compiles as one.

A mixture of experts (config.num_experts) may mix dense and sparse layers: the attention weights
are stacked over every layer, the dense MLP's over the dense layers only and the experts' over the
sparse ones (`stacked_layers`), and each run of consecutive same-kind layers is one scan.
"""
from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxprefix.models import attention, backend, decoder_layer, layers, lora
from jaxprefix.models.attention import KVCache, KVSegment
from jaxprefix.models.paged_attention import PagedKV
from jaxprefix.models.config import ModelConfig
from jaxprefix.models.sharding import constrain

_NO_WINDOW = np.iinfo(np.int32).max


def _layer_shapes(c: ModelConfig) -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]:
    """Name -> (shape without the layer axis, logical axes) of each stacked layer weight."""
    d, f, h, kv, dh = c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim
    shapes = {
        'attn_norm': ((d,), ('norm',)),
        'q': ((d, h, dh), ('embed', 'heads', 'head_dim')),
        'k': ((d, kv, dh), ('embed', 'kv_heads', 'head_dim')),
        'v': ((d, kv, dh), ('embed', 'kv_heads', 'head_dim')),
        'o': ((h, dh, d), ('heads', 'head_dim', 'embed')),
        'mlp_norm': ((d,), ('norm',)),
    }
    sparse = c.sparse_layers
    if not all(sparse):
        shapes.update(gate=((d, f), ('embed', 'mlp')), up=((d, f), ('embed', 'mlp')),
                      down=((f, d), ('mlp', 'embed')))
    if any(sparse):
        e, fm = c.num_experts, c.moe_intermediate_size
        # The router is small and every device routes its own tokens: not split by expert.
        shapes.update(router=((d, e), ('embed', None)),
                      expert_gate=((e, d, fm), ('expert', 'embed', 'mlp')),
                      expert_up=((e, d, fm), ('expert', 'embed', 'mlp')),
                      expert_down=((e, fm, d), ('expert', 'mlp', 'embed')))
        fs = c.shared_expert_intermediate_size
        if fs:  # Qwen2-MoE's shared expert, scaled by sigmoid(x @ shared_expert_gate)
            shapes.update(shared_gate=((d, fs), ('embed', 'mlp')),
                          shared_up=((d, fs), ('embed', 'mlp')),
                          shared_down=((fs, d), ('mlp', 'embed')),
                          shared_expert_gate=((d, 1), ('embed', None)))
    if c.qkv_bias:
        shapes.update(q_bias=((h, dh), ('heads', 'head_dim')),
                      k_bias=((kv, dh), ('kv_heads', 'head_dim')),
                      v_bias=((kv, dh), ('kv_heads', 'head_dim')))
    if c.out_bias:
        shapes['o_bias'] = ((d,), ('norm',))
    if c.qk_norm:
        shapes.update(q_norm=((dh,), ('head_dim',)), k_norm=((dh,), ('head_dim',)))
    if c.sandwich_norms:
        shapes.update(post_attn_norm=((d,), ('norm',)), post_mlp_norm=((d,), ('norm',)))
    return shapes


_DENSE_MLP = frozenset({'gate', 'up', 'down'})
# The projections `layer_weights` lays out output-major, and how many input axes each has.
_PROJECTION_INPUTS = {'q': 1, 'k': 1, 'v': 1, 'o': 2, 'gate': 1, 'up': 1, 'down': 1}
_STACKED_EXPERTS = ('expert_gate', 'expert_up', 'expert_down')
_SPARSE_MLP = frozenset({'router', 'expert_gate', 'expert_up', 'expert_down', 'shared_gate',
                         'shared_up', 'shared_down', 'shared_expert_gate'})


def stacked_layers(c: ModelConfig, name: str) -> tuple[int, ...]:
    """The layers a stacked weight holds, in order: the dense MLP's the dense layers, the
    experts' the sparse ones, every other weight all layers."""
    sparse = c.sparse_layers
    if name in _DENSE_MLP or name in _SPARSE_MLP:
        return tuple(i for i, s in enumerate(sparse) if s == (name in _SPARSE_MLP))
    return tuple(range(c.num_layers))


def _layer_runs(c: ModelConfig) -> tuple[tuple[int, int, bool], ...]:
    """(start, stop, sparse) of each run of consecutive layers of one kind."""
    runs, sparse = [], c.sparse_layers
    for i, s in enumerate(sparse):
        if runs and runs[-1][2] == s:
            runs[-1][1] = i + 1
        else:
            runs.append([i, i + 1, s])
    return tuple(map(tuple, runs))


class Decoder(nnx.Module):
    """Decoder-only transformer; see ARCHITECTURE.md 'Model' for the call contracts."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs | None = None):
        rngs = rngs if rngs is not None else nnx.Rngs(0)
        self.config = config
        c = config
        dtype = jnp.dtype(c.param_dtype)
        normal = nnx.initializers.normal(0.02)
        # Gemma's norms scale by (1 + w): w = 0 is the identity there, w = 1 elsewhere.
        norm_init = nnx.initializers.zeros if c.norm_plus_one else nnx.initializers.ones

        def param(shape, axes, init):
            return nnx.Param(init(rngs.params(), shape, dtype), out_sharding=axes, eager_sharding=False)

        self.embed = param((c.vocab_size, c.hidden_size), ('vocab', 'embed'), normal)
        self.layer_names = tuple(_layer_shapes(c))
        for name, (shape, axes) in _layer_shapes(c).items():
            init = norm_init if name.endswith('norm') else (
                nnx.initializers.zeros if name.endswith('bias') else normal)
            setattr(self, name, param((len(stacked_layers(c, name)), *shape), ('layers', *axes),
                                      init))
        self.final_norm = param((c.hidden_size,), ('norm',), norm_init)
        if not c.tie_word_embeddings:
            self.lm_head = param((c.vocab_size, c.hidden_size), ('vocab', 'embed'), normal)

    # --- public API ---------------------------------------------------------------------------

    def __call__(self, tokens, positions=None, mask=None) -> jax.Array:
        """Logits [B, T, V] (f32) of a (padded) batch; causal by position among valid tokens."""
        return self.unembed(self.hidden(tokens, positions, mask))

    def hidden(self, tokens, positions=None, mask=None, routes=None, *, router_load=False):
        """Final-normed hidden states [B, T, D]. `routes` (a MoE; int [B, T, sparse layers, k],
        from `route` or the sampler's Rollouts.routes): each token's experts in each sparse
        layer, replayed instead of the router's top-k (gate weights still from the router, over
        those experts; a token whose experts are -1 takes the router's own). `router_load`:
        (h, each sparse layer's moe.router_load over the real tokens [sparse layers, 2, E])."""
        h, routing = self._hidden(tokens, positions, mask, routes, router_load)
        return (h, routing['load']) if router_load else h

    def route(self, tokens, positions=None, mask=None) -> jax.Array:
        """The experts int32 [B, T, sparse layers, k] each token's forward routes to (a MoE)."""
        if not any(self.config.sparse_layers):
            raise ValueError('route: the model has no sparse (mixture-of-experts) layers')
        return self._hidden(tokens, positions, mask, None, False)[1]['experts']

    def _hidden(self, tokens, positions, mask, routes, router_load):
        tokens = jnp.asarray(tokens, jnp.int32)
        mask = jnp.ones(tokens.shape, bool) if mask is None else jnp.asarray(mask, bool)
        if positions is None:
            positions = jnp.cumsum(mask, axis=1, dtype=jnp.int32) - 1
        positions = jnp.where(mask, jnp.asarray(positions, jnp.int32), -1)
        h, _, routing = self._run(tokens, positions, (), None, None, (), routes, router_load)
        return h, routing

    def unembedding(self) -> jax.Array:
        """The [V, D] unembedding matrix (the embedding table when tied)."""
        return (self.embed if self.config.tie_word_embeddings else self.lm_head)[...]

    def unembed(self, h: jax.Array) -> jax.Array:
        return unembed(h, self.unembedding(), self.config)

    def layer_weights(self) -> list[dict[str, jax.Array]]:
        """Each layer's weights as arrays of their own, for `extend(layer_weights=...)`: a
        decode on CPU, so its projections are laid out output-major (layers.output_major)."""
        out = [{} for _ in range(self.config.num_layers)]
        for name in self.layer_names:
            stacked = getattr(self, name)[...]
            for j, i in enumerate(stacked_layers(self.config, name)):
                inputs = _PROJECTION_INPUTS.get(name)
                out[i][name] = stacked[j] if inputs is None else layers.output_major(stacked[j],
                                                                                     inputs)
        return out

    def extend(self, tokens, positions, *, context: Sequence[KVSegment] = (),
               cache: KVCache | None = None, layer_weights: Sequence[dict] | None = None,
               pages: Sequence[PagedKV] = (), with_routes: bool = False) -> tuple:
        """Logits of new tokens [B, T] attending to `context` segments and to `cache` or each other.

        A negative position marks a padding token: it is stored as an empty slot. Returns the new
        tokens' KVSegment (cache=None) or the updated cache (index advanced by T). Context groups
        are read group-major.
        `layer_weights` (from `layer_weights()`, taken outside a decode loop) runs the layers one
        by one on those arrays instead of scanning the stacked weights: XLA's CPU backend copies
        each layer's slice of a stacked weight before its matmul, which triples the weight reads
        of a memory-bound decode step (TPU fuses the slice into the matmul).
        `pages` (no cache): the new tokens also attend to KV in pages (paged_attention.py; a
        context each group of rows shares, each row's own earlier tokens), read only, all of it
        before them; the returned KVSegment holds the new tokens' keys and values for the
        caller to write into its pages (a decode step: one token a row; tokens appended to a
        row: several, attending causally to each other too).
        `with_routes`: (logits, kv, the experts int32 [B, T, sparse layers, k] the new tokens
        route to, None for a dense model), what the sampler records for routing replay.
        """
        tokens = jnp.asarray(tokens, jnp.int32)
        positions = jnp.asarray(positions, jnp.int32)
        positions = jnp.where(positions >= 0, positions, -1)
        pages = tuple(pages)
        if pages and cache is not None:
            raise ValueError('pages take no cache')
        h, kv, routing = self._run(tokens, positions, tuple(context), cache, layer_weights, pages)
        logits = unembed(h, self.unembedding(), self.config, output_major=layer_weights is not None)
        if with_routes:
            return logits, kv, None if routing is None else routing['experts']
        return logits, kv

    # --- the one forward path -----------------------------------------------------------------

    def _run(self, tokens, positions, context: tuple[KVSegment, ...], cache: KVCache | None,
             layer_weights: Sequence[dict] | None, pages: tuple[PagedKV, ...], routes=None,
             router_load: bool = False):
        """(final-normed h, the new KV, the routing or None for a dense model): 'experts'
        [B, T, sparse layers, k] and, with router_load, 'load' [sparse layers, 2, E]."""
        c = self.config
        x = self._embed(tokens)
        angles, local_angles = _rope_angles(c, positions)
        per_layer = self._per_layer_inputs()
        head_major = (*(s.head_major for s in context), cache is not None and cache.head_major)
        if any(head_major) and layer_weights is None:
            raise ValueError('head-major KV (KVSegment.head_major) is read layer by layer: '
                             'expected layer_weights')
        decoding = cache is not None or bool(pages)
        whole_experts = self._whole_experts(decoding and layer_weights is None)
        # Replayed experts, one entry per sparse layer along the leading axis.
        replay = None if routes is None else jnp.moveaxis(jnp.asarray(routes, jnp.int32), 2, 0)
        shared = decoder_layer.Shared(
            config=c, positions=positions, angles=angles, local_angles=local_angles,
            context_pos=[s.pos for s in context], head_major=head_major, pages=pages,
            # Over pages (a decode step, or a few appended tokens): plain attention to the new
            # tokens themselves, plus the pages' partials.
            attend=backend.attention_for(cached=decoding, sliding_window=c.sliding_window),
            lora_config=self.adapters.config if lora.has_adapters(self) else None,
            output_major=layer_weights is not None, whole_experts=whole_experts,
            router_load=router_load)
        layer = functools.partial(decoder_layer.layer, shared)

        def over_layers(step, carry):
            return self._over_layers(step, carry, per_layer, context, layer_weights, replay,
                                     whole_experts)

        if cache is None:
            x, (ks, vs), routing = over_layers(_segment_step(layer, positions), x)
            kv = KVSegment(k=ks, v=vs, pos=positions)
        else:
            cache_pos = jax.lax.dynamic_update_slice(cache.pos, positions, (0, cache.index))
            (x, ks, vs), _, routing = over_layers(_cache_step(layer, cache, cache_pos),
                                                  (x, cache.k, cache.v))
            kv = cache.replace(k=ks, v=vs, pos=cache_pos, index=cache.index + tokens.shape[1])
        h = layers.rms_norm(x, self.final_norm[...], c.rms_norm_eps, c.norm_plus_one)
        return h, kv, routing

    def _embed(self, tokens) -> jax.Array:
        """The tokens' embeddings [B, T, D] in the compute dtype (times sqrt(D): Gemma)."""
        c = self.config
        dtype = jnp.dtype(c.dtype)
        x = self.embed[...][tokens].astype(dtype)
        if c.embed_scale:
            x = x * jnp.asarray(c.hidden_size ** 0.5, dtype)
        return constrain(x, ('batch', 'length', 'act_embed'))

    def _per_layer_inputs(self) -> dict:
        """Each layer's own inputs, stacked over the layers: whether it slides, its window
        (None where no layer slides), its adapters' factors and dropout key."""
        c = self.config
        sliding = np.asarray(c.is_sliding)
        window = None
        if sliding.any():
            window = jnp.asarray(np.where(sliding, c.sliding_window, _NO_WINDOW), jnp.int32)
        adapters = self.adapters if lora.has_adapters(self) else None
        return dict(sliding=jnp.asarray(sliding), window=window,
                    lora=adapters.scan_inputs(c.num_layers) if adapters is not None else {})

    def _whole_experts(self, scanned_decode: bool) -> dict:
        """The experts' weights stacked over the sparse layers, for a scanned decode step of a
        MoE ({} otherwise): the layers read them whole."""
        c = self.config
        if not (scanned_decode and any(c.sparse_layers)):
            return {}
        # A decode step's experts stay stacked, each layer's read in place by the expert kernel
        # (backend.grouped_matmul): the scan's slice of a layer would be copied first.
        whole = {n: getattr(self, n)[...] for n in _STACKED_EXPERTS}
        if any(w.dtype != jnp.dtype(c.dtype) for w in whole.values()):
            return {}  # the decode's own weights are cast once, outside its loop
        return whole

    def _over_layers(self, step, carry, per_layer: dict, context: tuple[KVSegment, ...],
                     layer_weights: Sequence[dict] | None, replay, whole_experts: dict):
        """(carry, outputs stacked over all layers, the sparse layers' routings stacked over
        them or None): step(carry, xs) -> (carry, (output, routing)) on each layer in turn,
        xs its slice of per_layer plus its index, weights, context KV and replayed routes;
        rematerialised in the backward pass with config.remat."""
        c = self.config
        step = jax.checkpoint(step) if c.remat else step
        per_layer = {**per_layer, 'index': jnp.arange(c.num_layers)}
        if layer_weights is None:
            carry, out, routings = self._scan_layers(step, carry, per_layer, context, replay,
                                                     whole_experts)
        else:
            carry, out, routings = self._loop_layers(step, carry, per_layer, context,
                                                     layer_weights, replay)
        if not routings:
            return carry, out, None
        routing = jax.tree.map(lambda *a: jnp.concatenate(a), *routings)
        return carry, out, {**routing, 'experts': jnp.moveaxis(routing['experts'], 0, 2)}

    def _scan_layers(self, step, carry, per_layer, context, replay, whole_experts):
        """(carry, outputs, routings of the sparse runs): lax.scan(step) over the stacked
        weights, one scan per run of same-kind layers."""
        c = self.config
        runs = _layer_runs(c)
        outs, routings = [], []
        for start, stop, sparse in runs:
            whole = len(runs) == 1
            xs = per_layer if whole else jax.tree.map(lambda a: a[start:stop], per_layer)
            xs = {**xs, 'weights': self._run_weights(start, stop, whole, whole_experts),
                  'context': [(s.k, s.v) if whole else (s.k[start:stop], s.v[start:stop])
                              for s in context]}
            first = sum(c.sparse_layers[:start])
            if sparse and replay is not None:
                xs['routes'] = replay[first:first + stop - start]
            if sparse and whole_experts:
                xs['expert_layer'] = jnp.arange(first, first + stop - start)
            unroll = stop - start if c.num_layers <= _UNROLL_UP_TO_LAYERS else 1
            carry, (out, used) = jax.lax.scan(step, carry, xs, unroll=unroll)
            outs.append(out)
            routings += [used] if sparse else []
        out = outs[0] if len(outs) == 1 else jax.tree.map(lambda *a: jnp.concatenate(a), *outs)
        return carry, out, routings

    def _run_weights(self, start: int, stop: int, whole: bool, whole_experts: dict) -> dict:
        """The stacked weights of the layers start..stop (one kind), sliced to them unless the
        run is every layer; the experts in whole_experts left out."""
        out = {}
        for name in self.layer_names:
            held = stacked_layers(self.config, name)
            if start in held and name not in whole_experts:
                w = getattr(self, name)[...]
                first = held.index(start)
                out[name] = w if whole else w[first:first + stop - start]
        return out

    def _loop_layers(self, step, carry, per_layer, context, layer_weights, replay):
        """(carry, outputs, routings of the sparse layers): step in a Python loop over the
        layers' own weights."""
        c = self.config
        outs, routings = [], []
        for i, weights in enumerate(layer_weights):
            # A Python int index: it picks each layer's own arrays (page pool, KV).
            xs = {**jax.tree.map(lambda a: a[i], per_layer), 'weights': weights,
                  'context': [s.layer(i) for s in context], 'index': i}
            if c.sparse_layers[i] and replay is not None:
                xs['routes'] = replay[sum(c.sparse_layers[:i])]
            carry, (out, used) = step(carry, xs)
            outs.append(out)
            if c.sparse_layers[i]:
                routings.append(jax.tree.map(lambda a: a[None], used))
        return carry, jax.tree.map(lambda *a: jnp.stack(a), *outs), routings


def _rope_angles(c: ModelConfig, positions: jax.Array) -> tuple[tuple, tuple]:
    """The rotary (cos, sin) of the positions in a full-attention layer and in a sliding-window
    layer (Gemma 3's local rope)."""
    positions = attention.position_in_sequence(positions)  # a packed row's sequence bits off
    angles = layers.rope_angles(positions, layers.inverse_frequencies(c.rope, c.head_dim))
    local_rope = c.local_rope or c.rope
    local_angles = layers.rope_angles(positions, layers.inverse_frequencies(local_rope, c.head_dim))
    return angles, local_angles


def _segment_step(layer, positions: jax.Array):
    """The layer step without a cache: the new tokens attend to each other and each layer's
    (k, v) is an output, stacked over the layers into the KVSegment `extend` returns."""
    def step(x, xs):
        x, kv, routing = layer(x, xs, lambda k, v: ((k, v, positions), (k, v)))
        return x, (kv, routing)
    return step


def _cache_step(layer, cache: KVCache, cache_pos: jax.Array):
    """The layer step with a cache, carried as (x, cache.k, cache.v): each layer writes its new
    tokens' k, v into the cache at column cache.index, then they attend to the cache."""
    # New k, v [B, T, Hkv, Dh] laid out as the cache is (KVSegment.head_major).
    k_axes, v_axes = (0, 1, 2, 3), (0, 1, 2, 3)
    if cache.head_major:
        k_axes, v_axes = (0, 2, 3, 1), (0, 2, 1, 3)

    def step(carry, xs):
        x, cache_k, cache_v = carry
        i = xs['index']

        def write(k, v):
            nonlocal cache_k, cache_v
            cache_k = _put_new_tokens(cache, cache_k, i, k, k_axes)
            cache_v = _put_new_tokens(cache, cache_v, i, v, v_axes)
            return (cache_k[i], cache_v[i], cache_pos), None

        x, _, routing = layer(x, xs, write)
        return (x, cache_k, cache_v), (None, routing)
    return step


def _put_new_tokens(cache: KVCache, kv, i, new: jax.Array, axes: tuple[int, ...]):
    """kv (the cache's k or v as carried) with every row's new tokens of layer i at column
    cache.index; `axes` lays new out as the cache is."""
    new = new.transpose(axes)
    start = [0, 0, 0, 0]
    start[axes.index(1)] = cache.index
    if cache.head_major:  # a tuple of layers
        update = jax.lax.dynamic_update_slice(kv[i], new.astype(kv[i].dtype), start)
        return kv[:i] + (update,) + kv[i + 1:]
    return jax.lax.dynamic_update_slice(kv, new[None].astype(kv.dtype), (i, *start))


# A scan over layers compiles once however deep the model; on a few layers its loop costs more
# than it saves (the demo's 2-layer policy trains ~1.7x faster unrolled on CPU).
_UNROLL_UP_TO_LAYERS = 4


def unembed(h: jax.Array, unembedding: jax.Array, config: ModelConfig,
            output_major: bool = False) -> jax.Array:
    """Logits (f32) from final-normed hidden states and the [V, D] unembedding matrix;
    output_major: computed as layers.einsum_output_major does (a decode on CPU)."""
    unembedding = unembedding.astype(h.dtype)
    if output_major:
        logits = layers.linear('btd,dv->btv', h, unembedding, output_major, f32_result=True)
    elif h.dtype == jnp.float32:
        logits = jnp.einsum('...d,vd->...v', h, unembedding)
    else:
        rows = h.reshape(-1, h.shape[-1])
        logits = layers.linear('nd,vd->nv', rows, unembedding, f32_result=True).reshape(
            *h.shape[:-1], -1)
    return layers.softcap(logits, config.final_logit_softcapping)
