"""One decoder layer: the new tokens' attention over the context segments, their own keys and
values and any KV pages, then the MLP (gated, or a mixture of experts), each block added to the
residual stream.

The Decoder (decoder.py) runs `layer` once per layer, scanned or in a Python loop, with that
layer's inputs `xs` (its weights, context KV, sliding window, adapters, replayed routes, index)
and what every layer of the forward reads alike (`Shared`).
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from jaxprefix.models import backend, layers, lora, moe
from jaxprefix.models.config import ModelConfig
from jaxprefix.models.paged_attention import PagedKV
from jaxprefix.models.sharding import constrain


@dataclasses.dataclass(frozen=True)
class Shared:
    """What every layer of one forward reads alike (the layer scan closes over it)."""
    config: ModelConfig
    positions: jax.Array          # int32 [B, T] of the new tokens, -1 for padding
    angles: tuple                 # rotary (cos, sin) of the new tokens in a full-attention layer
    local_angles: tuple           # and in a sliding-window layer
    context_pos: list             # each context segment's positions
    head_major: tuple             # each context segment's KV layout, then the cache's
    pages: tuple[PagedKV, ...]
    attend: Callable              # backend.attention_for's attention over the segments
    lora_config: lora.LoraConfig | None
    output_major: bool            # the weights are laid out output-major (a decode on CPU)
    whole_experts: dict           # a decode step's experts, stacked over the sparse layers
    router_load: bool             # the routing's 'load' over the real tokens too


def layer(s: Shared, x, xs, kv_self):
    """(x after one layer, kv_self's other value, the routing of a sparse layer or None);
    kv_self(k, v) -> (the (k, v, pos) segment the new tokens add, another value)."""
    c = s.config
    dtype = jnp.dtype(c.dtype)
    w = {n: a.astype(dtype) for n, a in xs['weights'].items()}

    def project(name, equation, x):
        return lora.project(name, equation, x, w[name], xs['lora'], s.lora_config,
                            output_major=s.output_major)

    a, new_kv = _attention_block(s, x, xs, w, project, kv_self)
    x = x + a
    m, routing = _mlp_block(s, x, xs, w, project)
    x = constrain(x + m, ('batch', 'length', 'act_embed'))
    return x, new_kv, routing


def _attention_block(s: Shared, x, xs, w, project, kv_self):
    """(What attention adds to x, kv_self's other value): the new tokens' queries over the
    context segments, their own keys and values, and the pages."""
    c, positions = s.config, s.positions
    cos, sin = [jnp.where(xs['sliding'], l, g) for l, g in zip(s.local_angles, s.angles)]
    h = layers.rms_norm(x, w['attn_norm'], c.rms_norm_eps, c.norm_plus_one)
    q = project('q', 'btd,dhk->bthk', h)
    k = project('k', 'btd,dhk->bthk', h)
    v = project('v', 'btd,dhk->bthk', h)
    if c.qkv_bias:
        q, k, v = q + w['q_bias'], k + w['k_bias'], v + w['v_bias']
    if c.qk_norm:
        q = layers.rms_norm(q, w['q_norm'], c.rms_norm_eps, c.norm_plus_one)
        k = layers.rms_norm(k, w['k_norm'], c.rms_norm_eps, c.norm_plus_one)
    q, k = layers.apply_rope(q, cos, sin), layers.apply_rope(k, cos, sin)
    q = constrain(q, ('batch', 'length', 'act_heads', None))
    segments = [(ck, cv, cp) for (ck, cv), cp in zip(xs['context'], s.context_pos)]
    own, new_kv = kv_self(k, v)
    segments.append(own)
    extra = {'head_major': s.head_major} if any(s.head_major) else {}
    if s.pages:
        extra['partials'] = [backend.attend_pages(
            q, positions, p, xs['index'], scale=c.attn_scale, window=xs['window'],
            logit_cap=c.attn_logit_softcapping) for p in s.pages]
    a = s.attend(q, positions, segments, scale=c.attn_scale, window=xs['window'],
                 logit_cap=c.attn_logit_softcapping, **extra)
    a = project('o', 'bthk,hkd->btd', a)
    if c.out_bias:
        a = a + w['o_bias']
    if c.sandwich_norms:
        a = layers.rms_norm(a, w['post_attn_norm'], c.rms_norm_eps, c.norm_plus_one)
    return a, new_kv


def _mlp_block(s: Shared, x, xs, w, project):
    """(What the MLP adds to x, the routing of a sparse layer or None)."""
    c = s.config
    h = layers.rms_norm(x, w['mlp_norm'], c.rms_norm_eps, c.norm_plus_one)
    routing = None
    if 'router' in w:  # a sparse layer (the weights of a run are of one kind)
        m, routing = moe.sparse_mlp(h, {**w, **s.whole_experts}, c.num_experts_per_tok,
                                    c.norm_topk_prob, c.activation, xs.get('routes'),
                                    s.positions >= 0 if s.router_load else None,
                                    layer=xs.get('expert_layer'))
    else:
        m = layers.gated_mlp(h, project, c.activation)
    if c.sandwich_norms:
        m = layers.rms_norm(m, w['post_mlp_norm'], c.rms_norm_eps, c.norm_plus_one)
    return m, routing
