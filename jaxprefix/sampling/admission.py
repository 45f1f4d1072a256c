"""Admission and preemption in the continuous decode (continuous.py): contexts prefilled into
free group slots (`admit`), queued rows started where their block has room and pages
(`start_rows`), and the youngest rows preempted when a row outgrows its reservation and no page
is free (`preempt`: they give their pages back and start again later, replaying what they drew),
and newer weights computing the whole running decode's KV again (`recompute_in_flight`:
rollout.inflight_kv='recompute').
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxprefix.sampling import page_pool
from jaxprefix.sampling.continuous_state import (ACTIVE, QUEUED, WAITING, Groups, LoopState,
                                                 Rows, Shape, blocks)
from jaxprefix.sampling.prefill import context_kv


def admit(model, contexts: dict, state: LoopState, shape: Shape) -> LoopState:
    """Prefills each block's next `shape.admit` contexts into its first free group slots; their n rows
    are queued."""
    groups, n, admit = state.groups, shape.n, shape.admit
    d, k = groups.context.shape
    num_valid = blocks(contexts['valid'], d).sum(axis=1)
    free = groups.context < 0
    rank = jnp.cumsum(free, axis=1) - 1
    # target[f]: the block's f-th free slot (k when there are fewer).
    target = jax.vmap(lambda fr, rk: jnp.full(admit, k, jnp.int32).at[jnp.where(fr, rk, admit)]
                      .set(jnp.arange(k, dtype=jnp.int32), mode='drop'))(free, rank)
    local = state.next_context[:, None] + jnp.arange(admit, dtype=jnp.int32)
    ok = (local < num_valid[:, None]) & (target < k)
    target = jnp.where(ok, target, k)
    state, lengths, first, pick = _prefill(model, contexts, state, local, ok, target)

    def put(table, values):  # table [D, K, ...] with values [D * F, ...] at the target slots
        return jax.vmap(lambda t, at, v: t.at[at].set(v, mode='drop'))(
            table, target, values.reshape(d, admit, *table.shape[2:]))
    stamps = state.admitted[:, None] + jnp.arange(admit, dtype=jnp.int32)
    groups = Groups(context=put(groups.context, local), stamp=put(groups.stamp, stamps),
                    last_token=put(groups.last_token, pick('last_tokens')),
                    last_position=put(groups.last_position, pick('last_positions')),
                    lengths=put(groups.lengths, lengths), first=put(groups.first, first))
    taken = jnp.zeros((d, k), bool).at[jnp.arange(d)[:, None], target].set(True, mode='drop')
    queued = jnp.repeat(taken, n, axis=1)
    fresh = lambda x: jnp.where(queued, 0, x)  # a new episode: nothing drawn, known or replayed
    rows = state.rows
    rows = rows.replace(state=jnp.where(queued, QUEUED, rows.state), t=fresh(rows.t),
                        known=fresh(rows.known), replay=fresh(rows.replay), turn=fresh(rows.turn),
                        turn_start=fresh(rows.turn_start))
    count = ok.sum(axis=1, dtype=jnp.int32)
    return state.replace(groups=groups, rows=rows, next_context=state.next_context + count,
                         admitted=state.admitted + count)


def _prefill(model, contexts: dict, state: LoopState, local, ok, target):
    """The KV of each block's contexts `local` [D, F] (where `ok`) written into its group slots
    `target` [D, F] (K: none), routes recorded where the decode records them. Returns (state,
    each context's segment lengths and first positions [D * F, segments], pick: a context field
    at those contexts)."""
    d, width = local.shape

    def pick(name, empty=None):  # [D*F, ...] rows of the contexts
        table = blocks(contexts[name], d)
        picked = jax.vmap(lambda block, at: block[at])(table, jnp.minimum(local, table.shape[1] - 1))
        if empty is not None:
            picked = jnp.where(ok.reshape(ok.shape + (1,) * (picked.ndim - 2)), picked, empty)
        return picked.reshape(d * width, *picked.shape[2:])

    record = state.out.routes is not None
    prompt, prompt_routes = context_kv(model, pick('prompt_tokens'),
                                       pick('prompt_positions', -1), record_routes=record)
    segments, out = (prompt,), state.out
    if contexts['suffix_tokens'].shape[1]:
        suffix, suffix_routes = context_kv(model, pick('suffix_tokens'),
                                           pick('suffix_positions', -1), segments,
                                           record_routes=record)
        segments += (suffix,)
    if record:  # at each context's row in request order (past the end: dropped)
        num_contexts = contexts['valid'].shape[0]
        at = jnp.where(ok, jnp.arange(d)[:, None] * (num_contexts // d) + local,
                       num_contexts).reshape(-1)
        out = out.replace(prompt_routes=out.prompt_routes.at[at].set(prompt_routes, mode='drop'))
        if out.suffix_routes is not None:
            out = out.replace(suffix_routes=out.suffix_routes.at[at].set(suffix_routes,
                                                                         mode='drop'))
    store = tuple(page_pool.write_slots(pool, new.k, new.v, target)
                  for pool, new in zip(state.store, segments))
    # Each segment's real tokens (a prefix of its slots) and its first position.
    lengths = jnp.stack([(x.pos >= 0).sum(axis=1, dtype=jnp.int32) for x in segments], -1)
    first = jnp.stack([jnp.maximum(x.pos[:, 0], 0) for x in segments], -1)
    return state.replace(store=store, out=out), lengths, first, pick


def recompute_in_flight(model, contexts: dict, state: LoopState) -> tuple[LoopState, jax.Array]:
    """`model` (newer weights) computes again every admitted context's KV, in the slots it holds,
    and every active row gives its pages back and starts again from its first own token, feeding
    what it had drawn (as a preempted row does): from then on the decode attends to KV these
    weights wrote. Returns (state, the tokens computed again: contexts and rows)."""
    groups, rows = state.groups, state.rows
    k = groups.context.shape[1]
    held = groups.context >= 0
    target = jnp.where(held, jnp.arange(k, dtype=jnp.int32), k)
    state = _prefill(model, contexts, state, jnp.maximum(groups.context, 0), held, target)[0]
    active = rows.state == ACTIVE
    upto = lambda x: jnp.where(active, jnp.maximum(x, rows.t), x)
    state = state.replace(
        rows=rows.replace(state=jnp.where(active, QUEUED, rows.state), known=upto(rows.known),
                          replay=upto(rows.replay)),
        tables=page_pool.release(state.tables, active),
        # The last fed token's KV is written at the next step's top: not into pages given back.
        pending=state.pending.replace(valid=state.pending.valid & ~active.reshape(-1)))
    tokens = (jnp.where(held, groups.lengths.sum(-1), 0).sum()
              + jnp.where(active, rows.t, 0).sum())
    return state, tokens


def wants_contexts(contexts: dict, state: LoopState, *, admit: int) -> jax.Array:
    """Whether some block should admit contexts now: it has contexts left and either room for a
    full batch of them, or free room and no queued row (its rows would otherwise idle)."""
    groups = state.groups
    pending = blocks(contexts['valid'], groups.context.shape[0]).sum(1) - state.next_context
    free = (groups.context < 0).sum(axis=1)
    starving = (free > 0) & ~jnp.any(state.rows.state == QUEUED, axis=1)
    return jnp.any((pending > 0) & ((free >= jnp.minimum(admit, pending)) | starving))


def rows_in_flight(rows: Rows) -> jax.Array:
    """Rows between their start and their episode's end: decoding, or waiting for the host with
    their pages (and their promise of `reserve`) kept."""
    return (rows.state == ACTIVE) | (rows.state == WAITING)


def room_to_start(state: LoopState, shape: Shape) -> jax.Array:
    """[D] rows each block may start now: free row slots with `reserve` unpromised pages each."""
    in_flight = rows_in_flight(state.rows)
    return jnp.minimum(shape.row_slots - in_flight.sum(axis=1),
                       state.tables.unreserved(in_flight, shape.reserve) // shape.reserve)


def start_rows(state: LoopState, shape: Shape) -> LoopState:
    """Each block starts its oldest queued rows while it has fewer than `row_slots` rows in
    flight and `reserve` unreserved pages for each. A row starts from its first own token
    (again, if it was preempted: what it had drawn is known, and replayed)."""
    rows, groups, n = state.rows, state.groups, shape.n
    d, r = rows.state.shape
    queued = rows.state == QUEUED
    room = room_to_start(state, shape)
    # Priority: the group's admission stamp, then the sample index (a stable order).
    priority = jnp.repeat(groups.stamp, n, axis=1) * n + jnp.arange(r) % n
    priority = jnp.where(queued, priority, jnp.iinfo(jnp.int32).max)
    order = jnp.argsort(priority, axis=1, stable=True)
    rank = jnp.zeros((d, r), jnp.int32).at[jnp.arange(d)[:, None], order].set(
        jnp.arange(r, dtype=jnp.int32)[None, :])
    start = queued & (rank < room[:, None])
    slot = jnp.arange(r) // n
    last_token = jnp.take_along_axis(groups.last_token, jnp.broadcast_to(slot, (d, r)), axis=1)
    last_position = jnp.take_along_axis(groups.last_position, jnp.broadcast_to(slot, (d, r)),
                                        axis=1)
    new = lambda fresh, old: jnp.where(start, fresh, old)
    return state.replace(rows=rows.replace(
        state=new(ACTIVE, rows.state), t=new(0, rows.t), token=new(last_token, rows.token),
        position=new(last_position, rows.position), started=new(state.step, rows.started)))


def preempt(state: LoopState, needs: jax.Array) -> tuple[LoopState, jax.Array]:
    """Rows that give their pages back start again from their first own token later, feeding
    what they had drawn (known) instead of drawing it again: the same tokens by construction,
    with no tool run twice. Only active rows are preempted: a waiting row keeps its pages."""
    rows = state.rows
    tables, preempted = state.tables.preempt(rows.state == ACTIVE, rows.started, needs)
    upto = lambda x: jnp.where(preempted, jnp.maximum(x, rows.t), x)
    rows = rows.replace(state=jnp.where(preempted, QUEUED, rows.state), known=upto(rows.known),
                        replay=upto(rows.replay))
    return state.replace(rows=rows, tables=tables), needs & ~preempted
