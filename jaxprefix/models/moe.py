"""The sparse MLP of a mixture-of-experts layer (Qwen3-MoE): route, dispatch, experts, combine.

A router [D, E] scores each token's experts; softmax in f32, top-k, optionally renormalised to
sum 1 (`norm_topk_prob`). Dispatch is dropless: every (token, chosen expert) pair is computed,
with no capacity factor, so the logits are transformers'. The pairs are sorted by expert and
each expert's gated MLP runs on its contiguous group through a grouped matmul
(`backend.grouped_matmul`: jax.lax.ragged_dot over the group sizes), then the outputs
are unsorted and summed with their gate weights. The experts are stacked weights: gate and up
[E, D, F], down [E, F, D]. Qwen2-MoE adds a shared expert every token passes through, scaled by
sigmoid(x @ shared_expert_gate).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxprefix.models import backend, layers


def route(x: jax.Array, router: jax.Array, k: int, normalize: bool,
          experts: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """(gate weights [N, k] f32, expert ids [N, k] int32) of tokens x [N, D]; router [D, E].

    Given `experts` [N, k] (routing replay: the experts the sampler chose), those are used, with
    gate weights from this router's probabilities over them, so the router still learns."""
    logits = jnp.einsum('nd,de->ne', x, router.astype(x.dtype), preferred_element_type=jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)
    if experts is None:
        weights, experts = jax.lax.top_k(probs, k)
    else:
        weights = jnp.take_along_axis(probs, experts, axis=-1)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32)


def experts_mlp(x: jax.Array, weights: jax.Array, experts: jax.Array, w_gate: jax.Array,
                w_up: jax.Array, w_down: jax.Array, activation: str) -> jax.Array:
    """sum_j weights[:, j] * MLP_{experts[:, j]}(x) for tokens x [N, D]: dropless, sorted by expert."""
    n, k = experts.shape
    num_experts = w_gate.shape[0]
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)              # pairs grouped by expert
    group_sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    xs = x[order // k]                                  # [N * k, D]: each pair's token
    gate = backend.grouped_matmul(xs, w_gate, group_sizes)
    up = backend.grouped_matmul(xs, w_up, group_sizes)
    y = backend.grouped_matmul(layers.activation_fn(activation)(gate) * up, w_down,
                               group_sizes)
    y = jnp.zeros_like(y).at[order].set(y).reshape(n, k, -1)  # back in (token, choice) order
    return jnp.einsum('nkd,nk->nd', y, weights.astype(y.dtype))


def sparse_mlp(x: jax.Array, w: dict, k: int, normalize: bool, activation: str,
               experts: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """(the MoE MLP of hidden states x [B, T, D], the experts [B, T, k] int32 it used) with
    layer weights w (router, expert_*); `experts` replays a recorded routing (see route)."""
    b, t, d = x.shape
    flat = x.reshape(b * t, d)
    given = None if experts is None else experts.reshape(b * t, k).astype(jnp.int32)
    weights, chosen = route(flat, w['router'], k, normalize, given)
    # transformers casts the gate weights to the compute dtype before the combine
    weights = weights.astype(x.dtype)
    out = experts_mlp(flat, weights, chosen, w['expert_gate'], w['expert_up'], w['expert_down'],
                      activation)
    out = out.reshape(b, t, d)
    if 'shared_gate' in w:
        act = layers.activation_fn(activation)
        shared = jnp.einsum('btf,fd->btd', act(jnp.einsum('btd,df->btf', x, w['shared_gate']))
                            * jnp.einsum('btd,df->btf', x, w['shared_up']), w['shared_down'])
        out = out + jax.nn.sigmoid(jnp.einsum('btd,do->bto', x, w['shared_expert_gate'])) * shared
    return out, chosen.reshape(b, t, k)
