"""The sparse MLP of a mixture-of-experts layer (Qwen3-MoE): route, dispatch, experts, combine.

A router [D, E] scores each token's experts; softmax in f32, top-k, optionally renormalised to
sum 1 (`norm_topk_prob`). Dispatch is dropless: every (token, chosen expert) pair is computed,
with no capacity factor, so the logits are transformers'. The pairs are sorted by expert and
each expert's gated MLP runs on its contiguous group through a grouped matmul
(`backend.grouped_matmul`: jax.lax.ragged_dot over the group sizes), then the outputs
are unsorted and summed with their gate weights. The experts are stacked weights: gate and up
[E, D, F], down [E, F, D]. Qwen2-MoE adds a shared expert every token passes through, scaled by
sigmoid(x @ shared_expert_gate).

Routing replay: given recorded experts, a layer uses them instead of its top-k, with gate weights
from the current router over them (so the router still learns). `router_load` and
`load_balancing_loss` are the Switch / Qwen3-MoE auxiliary loss that keeps the experts' load even.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxprefix.models import backend, layers


def route_dtype(num_experts: int):
    """The integer dtype recorded expert ids are kept in: int8 up to 128 experts (Qwen3-30B-A3B
    and 235B-A22B), int16 beyond; -1 marks a token with no recorded experts."""
    return jnp.int8 if num_experts <= 128 else jnp.int16


def router_probs(x: jax.Array, router: jax.Array) -> jax.Array:
    """The router's softmax over the experts, f32 [N, E], of tokens x [N, D]; router [D, E]."""
    logits = jnp.einsum('nd,de->ne', x, router.astype(x.dtype), preferred_element_type=jnp.float32)
    return jax.nn.softmax(logits, axis=-1)


def route(probs: jax.Array, k: int, normalize: bool,
          experts: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """(gate weights [N, k] f32, expert ids [N, k] int32) from router probabilities [N, E].

    Given `experts` [N, k] (routing replay: the experts the sampler chose), those are used, with
    gate weights from this router's probabilities over them, so the router still learns; a token
    whose experts are -1 (none recorded: a row's last token, which the sampler never fed, or
    padding) takes the router's own top-k."""
    weights, top = jax.lax.top_k(probs, k)
    if experts is not None:
        experts = jnp.where(experts[:, :1] >= 0, experts.astype(jnp.int32), top)
        weights = jnp.take_along_axis(probs, experts, axis=-1)
    else:
        experts = top
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32)


def router_load(probs: jax.Array, k: int, valid: jax.Array) -> jax.Array:
    """[2, E] over the valid tokens (bool [N]) of one layer: how many pick each expert in the
    router's own top-k, and the sum of each expert's router probability."""
    top = jax.lax.top_k(probs, k)[1]
    picks = jax.nn.one_hot(top, probs.shape[-1], dtype=jnp.float32).sum(axis=1)
    weight = valid.astype(jnp.float32)[:, None]
    return jnp.stack([(picks * weight).sum(0), (probs * weight).sum(0)])


def load_balancing_loss(load: jax.Array, tokens: jax.Array) -> jax.Array:
    """The Switch Transformer's auxiliary loss as transformers computes it for Qwen3-MoE
    (load_balancing_loss_func): E * sum_e f_e * P_e over every sparse layer's valid tokens
    together, f_e the share of (layer, token) pairs whose top-k holds e (summed over the k
    choices), P_e the mean router probability of e. `load`: router_load of each sparse layer
    [L, 2, E]; `tokens`: the valid tokens of a layer. Its gradient flows through P alone."""
    pairs = jnp.maximum(load.shape[0] * tokens, 1).astype(jnp.float32)
    picks, probs = load[:, 0].sum(0), load[:, 1].sum(0)
    return load.shape[-1] * jnp.sum(jax.lax.stop_gradient(picks) * probs) / pairs ** 2


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
               experts: jax.Array | None = None,
               valid: jax.Array | None = None) -> tuple[jax.Array, dict]:
    """(the MoE MLP of hidden states x [B, T, D], its routing) with layer weights w (router,
    expert_*); `experts` replays a recorded routing (see route). The routing holds 'experts'
    [B, T, k] int32, the experts used, and, given the valid tokens (bool [B, T]), 'load' (see
    router_load)."""
    b, t, d = x.shape
    flat = x.reshape(b * t, d)
    given = None if experts is None else experts.reshape(b * t, k)
    probs = router_probs(flat, w['router'])
    weights, chosen = route(probs, k, normalize, given)
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
    routing = {'experts': chosen.reshape(b, t, k)}
    if valid is not None:
        routing['load'] = router_load(probs, k, valid.reshape(-1))
    return out, routing
