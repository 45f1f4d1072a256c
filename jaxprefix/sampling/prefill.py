"""Context KV: each context (or prompt) prefilled on its own, so its KV does not depend on its batch.

XLA's CPU matmuls round differently for different row counts (a [2 x 16]-token prefill and an
[8 x 16]-token one differ in the last bit of some keys), so a context prefilled among the 8 of a
static request and the same context admitted 2 at a time by the continuous decode would give
rollouts that differ by an ulp, enough to flip a sampled token now and then at scale. Prefilling
one context per iteration of a lax.map makes every context's KV the same bits in every schedule.
It costs the batching of short contexts' prefill, which is small next to decoding: a prefill of
S tokens does the work of one decode step per ~S / rows tokens, not of S steps.
"""
from __future__ import annotations

import collections
import math

import jax
import jax.numpy as jnp

from jaxprefix.models.attention import KVSegment
from jaxprefix.sampling import routes as recorded_routes

# How often each jitted sampler program was traced (compiled); tests check it stays bounded.
TRACE_COUNTS: collections.Counter = collections.Counter()


def _rows_per_step(num_rows: int) -> int:
    """Rows prefilled together: one per row device ('data' x 'fsdp' of the mesh in use), so each
    device prefills one context at a time; 1 without a mesh or when the rows do not divide."""
    mesh = jax.sharding.get_abstract_mesh()
    shards = 1 if mesh.empty else math.prod(
        mesh.shape.get(axis, 1) for axis in ('data', 'fsdp'))
    return shards if num_rows % shards == 0 else 1


def _steps(x: jax.Array, per_step: int, axis: int = 0) -> jax.Array:
    """[..., N, ...] -> [N / per_step, ..., per_step, ...] (leading axis: the lax.map steps);
    rows d * N/per_step + i go to step i, so each device keeps its own contiguous rows."""
    x = jnp.moveaxis(x, axis, 0)
    x = x.reshape(per_step, x.shape[0] // per_step, *x.shape[1:]).swapaxes(0, 1)
    return jnp.moveaxis(x, 1, axis + 1)


def _unsteps(x: jax.Array, axis: int = 0) -> jax.Array:
    """Inverse of _steps."""
    x = jnp.moveaxis(x, axis + 1, 1).swapaxes(0, 1)
    x = x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])
    return jnp.moveaxis(x, 0, axis)


def context_kv(model, tokens: jax.Array, positions: jax.Array,
               context: tuple[KVSegment, ...] = (), *,
               record_routes: bool = False) -> tuple[KVSegment, jax.Array | None]:
    """(the KV segment, the routes or None) of tokens [N, S] at positions [N, S] (-1: padding),
    one row per device at a time; row i attends to row i of each `context` segment (G = N).
    Steps without a real token are skipped (left empty). `record_routes` (a MoE): the experts
    [N, S, sparse layers, k] each token routes to (sampling/routes.py)."""
    per_step = _rows_per_step(tokens.shape[0])

    def one(step):
        step_tokens, step_positions, step_context = step

        def run():
            _, kv, experts = model.extend(step_tokens, step_positions, context=step_context,
                                          with_routes=True)
            if not record_routes:
                return kv, None
            return kv, recorded_routes.recorded(experts, step_positions, model.config.num_experts)

        shapes, routes = jax.eval_shape(run)
        empty = lambda: (KVSegment(k=jnp.zeros(shapes.k.shape, shapes.k.dtype),
                                   v=jnp.zeros(shapes.v.shape, shapes.v.dtype),
                                   pos=jnp.full(shapes.pos.shape, -1, jnp.int32)),
                         None if routes is None else jnp.full(routes.shape, -1, routes.dtype))
        return jax.lax.cond(jnp.any(step_positions >= 0), run, empty)

    by_step = lambda segment: KVSegment(k=_steps(segment.k, per_step, 1),
                                        v=_steps(segment.v, per_step, 1),
                                        pos=_steps(segment.pos, per_step))
    kv, routes = jax.lax.map(one, (_steps(tokens, per_step), _steps(positions, per_step),
                                   tuple(by_step(c) for c in context)))
    segment = KVSegment(k=_unsteps(kv.k, 1), v=_unsteps(kv.v, 1), pos=_unsteps(kv.pos))
    return segment, None if routes is None else _unsteps(routes)
