"""The sparse MLP of a mixture-of-experts layer (Qwen3-MoE): route, dispatch, experts, combine.

A router [D, E] scores each token's experts; softmax in f32, top-k, optionally renormalised to
sum 1 (`norm_topk_prob`). Dispatch is dropless: every (token, chosen expert) pair is computed,
with no capacity factor, so the logits are transformers'. The pairs are sorted by expert and
each expert's gated MLP runs on its contiguous group through a grouped matmul
(`backend.grouped_matmul`: Megablox on TPU, jax.lax.ragged_dot elsewhere), then the
outputs are added back to their tokens with their gate weights. The experts are stacked
weights: gate and up [E, D, F], down [E, F, D]. Qwen2-MoE adds a shared expert every token
passes through, scaled by sigmoid(x @ shared_expert_gate).

Expert parallelism (`dispatch`, under a mesh): the experts split over the mesh axes
sharding.RULES gives 'expert' (every axis that divides them), E_l = E / (their product) per
device, and each device computes its own experts for every token of its expert group under
shard_map: the tokens are all-gathered over the expert axes that split them ('data', 'fsdp'),
each device runs its E_l experts on the pairs routed to them, and the partial outputs are summed
back to each token's device (psum_scatter over those axes, psum over 'tensor', along which the
tokens are the same). No expert weight moves. In the sampler's decode ('data' rows, 'tensor'
heads) a step reads each expert on one chip; in the learner's FSDP ('fsdp') the tokens move
instead of every layer's experts (gathered in the forward, again under remat and in the
backward, and their whole f32 gradient reduce-scattered); experts that do not split over
'fsdp' keep their model dimension sharded there and gathered per layer, as every weight's.
Dropless in static shapes: a device computes at most group tokens x min(k, E_l) pairs, the most
its experts can receive; the tokens are exchanged in chunks that bring at most _PAIRS_PER_CALL
such pairs (a learner's 20k-token row a chip, gathered over 64 chips, would be 1.3M tokens at
once), and the experts compute them in chunks of as many pairs. A dropless all-to-all (each pair sent to its
expert's device, counts first) needs the same worst-case receive buffer in static shapes; it
moves (G-1)/G of k pairs a token each way where the all-gather and psum_scatter move G-1
tokens' worth (G: the devices of a group), the same at G = k (the paper's decode: 8 row blocks,
top-8) and k / G as much for wider groups (the learner's 64 chips: 1/8); and XLA:CPU has no
ragged all-to-all, so no CPU test could run it.

Routing replay: given recorded experts, a layer uses them instead of its top-k, with gate weights
from the current router over them (so the router still learns), and dispatches them like its
own. `router_load` and `load_balancing_loss` are the Switch / Qwen3-MoE auxiliary loss that
keeps the experts' load even.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxprefix.models import backend, layers
from jaxprefix.models.config import expected_experts
from jaxprefix.models.sharding import MESH_AXES, logical_spec


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


# The pairs one call of the experts computes, at most: a learner's row of 20k tokens has 164k
# pairs (top-8), and each [pairs, D] buffer of its MoE layer is 0.6 GiB, several at once in the
# backward. More tokens go through in chunks (_in_chunks), each under jax.checkpoint.
_PAIRS_PER_CALL = 1 << 16


def _in_chunks(fn, pairs_per_token: int, *arrays):
    """fn(*arrays) over their leading (token) axis in the fewest equal chunks of at most
    _PAIRS_PER_CALL / pairs_per_token tokens, each chunk under jax.checkpoint (its buffers are
    recomputed in the backward, not kept); fn maps [n, ...] arrays to one [n, ...] array."""
    n = arrays[0].shape[0]
    chunks = next(c for c in range(1, n + 1)
                  if n % c == 0 and (n // c * pairs_per_token <= _PAIRS_PER_CALL or c == n))
    if chunks == 1:
        return fn(*arrays)
    split = lambda a: a.reshape(chunks, n // chunks, *a.shape[1:])
    out = jax.lax.map(jax.checkpoint(lambda c: fn(*c)), tuple(split(a) for a in arrays))
    return out.reshape(n, *out.shape[2:])


def experts_mlp(x: jax.Array, weights: jax.Array, experts: jax.Array, w_gate: jax.Array,
                w_up: jax.Array, w_down: jax.Array, activation: str, *, first_expert=0,
                num_experts: int | None = None, layer=None) -> jax.Array:
    """sum_j weights[:, j] * MLP_{experts[:, j]}(x) for tokens x [N, D], over the pairs whose
    expert is one of the E_l held here (w_* [E_l, ...]: experts first_expert .. + E_l of
    num_experts; or [L, E_l, ...] every sparse layer's, of which `layer`'s): dropless, sorted
    by expert. Tokens go in chunks of at most _PAIRS_PER_CALL pairs (each chunk reads the
    experts again: a learner's MoE layer reads them a few times, for a fraction of the memory)."""
    call = functools.partial(_experts_mlp, w_gate=w_gate, w_up=w_up, w_down=w_down,
                             activation=activation, first_expert=first_expert,
                             num_experts=num_experts or w_gate.shape[-3], layer=layer)
    return _in_chunks(call, experts.shape[1], x, weights, experts)


def _experts_mlp(x, weights, experts, *, w_gate, w_up, w_down, activation, first_expert,
                 num_experts, layer):
    """experts_mlp of one chunk. Pairs of other experts than the E_l held here sort last, and
    only the most that can be local are computed: N * min(k, E_l)."""
    n, k = experts.shape
    held = w_gate.shape[-3]
    flat = experts.reshape(-1) - first_expert
    local = (flat >= 0) & (flat < held)
    key = jnp.where(local, flat, held)
    capacity = None if held == num_experts else n * min(k, held)
    order = jnp.argsort(key, stable=True)[:capacity]   # local pairs grouped by expert, first
    group_sizes = jnp.bincount(key, length=held + 1)[:held].astype(jnp.int32)
    token = order // k
    xs = x[token]                                       # [pairs, D]: each pair's token
    # What a call computes on average (uniform routing): its share of the pairs, and the
    # experts some token routes to (each of n tokens picks k of num_experts).
    expected = dict(expected_rows=n * k * held / num_experts,
                    expected_groups=expected_experts(n, k, num_experts) * held / num_experts,
                    every_row=capacity is None)
    gate = backend.grouped_matmul(xs, w_gate, group_sizes, layer=layer, **expected)
    up = backend.grouped_matmul(xs, w_up, group_sizes, layer=layer, **expected)
    y = backend.grouped_matmul(layers.activation_fn(activation)(gate) * up, w_down,
                               group_sizes, layer=layer, **expected)
    pair_weights = jnp.where(local[order], weights.reshape(-1)[order], 0).astype(y.dtype)
    return jnp.zeros_like(x).at[token].add(y * pair_weights[:, None])


def dispatch(x: jax.Array, weights: jax.Array, experts: jax.Array, w_gate: jax.Array,
             w_up: jax.Array, w_down: jax.Array, activation: str, layer=None) -> jax.Array:
    """experts_mlp of tokens x [N, D] with their gate weights and experts [N, k], expert
    parallel under the mesh set with jax.set_mesh (see the module doc); else on one device.
    w_* are one layer's experts, or every sparse layer's and `layer` (experts_mlp)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not set(MESH_AXES) <= set(mesh.axis_names):
        return experts_mlp(x, weights, experts, w_gate, w_up, w_down, activation, layer=layer)
    shape = dict(mesh.shape)
    n, k = experts.shape
    num_experts = w_gate.shape[-3]
    held_over = _axes(logical_spec(('expert',), (num_experts,), shape)[0])
    rows_over = _axes(logical_spec(('batch',), (n,), shape)[0])
    gathered = tuple(a for a in held_over if a in rows_over)   # EP axes that split tokens
    summed = tuple(a for a in held_over if a not in rows_over)  # tokens the same along them
    held = num_experts // math.prod(shape[a] for a in held_over)
    stacked = layer is not None
    layer = jnp.asarray(0 if layer is None else layer, jnp.int32)

    def exchange(x, weights, experts, w_gate, w_up, w_down, layer):
        """The experts' sum for tokens x [n, D] of this device (one chunk of them)."""
        if gathered:  # every device of an expert group: the group's tokens
            x, weights, experts = (jax.lax.all_gather(a, gathered, tiled=True)
                                   for a in (x, weights, experts))
        first = jax.lax.axis_index(held_over) * held if held_over else 0
        out = experts_mlp(x, weights, experts, w_gate, w_up, w_down, activation,
                          first_expert=first, num_experts=num_experts,
                          layer=layer if stacked else None)
        if summed:
            out = jax.lax.psum(out, summed)
        if gathered:  # each token's sum over every device's experts, back where it came from
            out = jax.lax.psum_scatter(out, gathered, scatter_dimension=0, tiled=True)
        return out

    def local(x, weights, experts, *held_weights):
        # A chunk's tokens, gathered over the group, bring at most group x chunk x min(k, E_l)
        # pairs here: a learner's (a row of 20k a chip, FSDP over 64 chips: 1.3M tokens) go in
        # chunks of 512 a chip; the sampler's (a few rows, a context) in one.
        group = math.prod(shape[a] for a in gathered)
        call = lambda *a: exchange(*a, *held_weights)
        return _in_chunks(call, group * min(k, held), x, weights, experts)

    rows = P(rows_over or None, None)
    held_spec = P(*((None,) if stacked else ()), held_over or None, None, None)
    return jax.shard_map(local, in_specs=(rows, rows, rows) + (held_spec,) * 3 + (P(),),
                         out_specs=rows, check_vma=False)(x, weights, experts, w_gate, w_up,
                                                          w_down, layer)


def _axes(entry) -> tuple[str, ...]:
    """A PartitionSpec entry as a tuple of mesh axis names."""
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def sparse_mlp(x: jax.Array, w: dict, k: int, normalize: bool, activation: str,
               experts: jax.Array | None = None, valid: jax.Array | None = None, *,
               layer=None) -> tuple[jax.Array, dict]:
    """(the MoE MLP of hidden states x [B, T, D], its routing) with layer weights w (router,
    expert_*: one layer's, or every sparse layer's with `layer`); `experts` replays a recorded
    routing (see route). The routing holds 'experts' [B, T, k] int32, the experts used, and,
    given the valid tokens (bool [B, T]), 'load' (see router_load)."""
    b, t, d = x.shape
    flat = x.reshape(b * t, d)
    given = None if experts is None else experts.reshape(b * t, k)
    probs = router_probs(flat, w['router'])
    weights, chosen = route(probs, k, normalize, given)
    # transformers casts the gate weights to the compute dtype before the combine
    weights = weights.astype(x.dtype)
    out = dispatch(flat, weights, chosen, w['expert_gate'], w['expert_up'], w['expert_down'],
                   activation, layer)
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
