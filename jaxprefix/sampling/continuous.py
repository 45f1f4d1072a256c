"""Continuous batching over KV pages: contexts admitted into group slots, rows grown page by page.

The static decode (static.py) holds every row of a request until the longest has stopped, each
with a cache of the full new-token bucket T. Here one jitted lax.while_loop holds, per device
block (see below), K group slots of n rows each:
  - a group slot holds one context's KV (its prompt and suffix segments, read only) and the n
    rows that sample it. The rows of a group are consecutive, so the n samples read ONE copy of
    their context's KV (attention.attend's group-major segments: no per-row copy). When group
    slots are free and contexts wait, F contexts are prefilled into them inside the loop
    (lax.cond): contexts are admitted in waves without a return to Python;
  - a row's own tokens live in KV pages (page_pool.py): a page of `page_size` tokens is taken
    when the row writes its first token there and every page goes back when the row stops, so
    memory follows the rows' real lengths, not T. A queued row starts when fewer than s rows
    are active in its block and the pages reserved for it (`reserve` a row) are unreserved;
    with a reserve below a full row, a row that outgrows its reservation when no page is free
    makes the youngest rows give theirs back (preempted: they start again from their first
    token later, feeding what they had drawn instead of drawing it again);
  - attention reads the context segments and the row's filled pages only (the Pallas paged
    kernel on TPU, backend.attend_pages), merged by their log-sum-exp. A step's new
    token attends to itself as a segment of its own; its keys and values go into the pages at
    the top of the next step (PendingTokens).
So the KV memory is K x (context length) + pages x page_size per block, whatever the number of
contexts and samples (budget.py chooses s, K, F and the pages); only the outputs ([C * n, T]
tokens and log-probs, 8 bytes a token) grow with the request.

Results do not depend on the schedule: sample j of context i draws from (seed, i*n + j, t), t its
own token index, and its keys and values are the same whatever page holds them, so it attends
to the same keys in the same order as in the static decode.

Turns (turns.py): a row's episode may have several turns. One whose turn ends before its last
goes WAITING, keeping its pages, group slot and reservation, and the loop, run in chunks
(`advance`), returns to the host, which appends the tokens of the tools' answer after the row's
last one (`turns.resume`); the next step prefills them into the row's pages (`_append`) and the
row samples its next turn after them. `Limits` say where turns and episodes end: one turn for
generate().

Sharding: contexts and rows are split over the D devices of ('data', 'fsdp') in D contiguous
blocks (block d holds contexts d*C/D .. (d+1)*C/D - 1 and their rows), and every scheduling array
carries a leading [D] axis: each block admits its own contexts into its own group slots and its
rows take pages of its own part of the pool, so a row reads its context and its pages on its
own device. KV heads (and the weights) split over 'tensor'. A block whose contexts run long
keeps the loop going while the others idle: the price of not moving KV between devices.

Routing replay (a MoE, `record_routes`): the outputs also hold the experts of the admitted
contexts' tokens (written at admission) and of every token a row feeds, by a decode step or an
appending pass (`_append`: a turn's observation), at the column of the token it feeds it for
(static.py says which): each token's experts are those of the forward that wrote its KV, the
one every later token of the episode attends to. A preempted row writes them again as it
replays its tokens (its KV is written again too).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jaxprefix.models.sharding import constrain
from jaxprefix.sampling import admission, page_pool
from jaxprefix.sampling.continuous_state import (ACTIVE, IDLE, QUEUED, SEGMENTS, WAITING, UNBOUNDED,
                                                 Groups, Limits, LoopState, Outputs,
                                                 PendingTokens, Rows, Shape, constrain_blocks)
from jaxprefix.sampling import routes as recorded_routes
from jaxprefix.sampling.prefill import TRACE_COUNTS
from jaxprefix.sampling.token_choice import SamplingSettings, choose_tokens, row_step_keys

def _segment_lengths(contexts: dict) -> list[int]:
    """Token slots of each context segment (prompt; suffix when any context has one)."""
    return [contexts[f'{name}_tokens'].shape[1] for name in SEGMENTS
            if contexts[f'{name}_tokens'].shape[1]]


def _pool_constrained(pool: page_pool.Pool) -> page_pool.Pool:
    """Pages split over the row devices by block and over 'tensor' by KV head."""
    return jax.tree.map(lambda x: constrain(x, ('kv_heads', 'batch') + (None,) * (x.ndim - 2)),
                        pool)


def _initial_state(model, contexts: dict, shape: Shape) -> LoopState:
    layout, n, new_bucket = shape.layout, shape.n, shape.new_bucket
    d, k = layout.blocks, shape.context_slots
    per_block = contexts['valid'].shape[0] // d
    config = model.config
    store = tuple(_pool_constrained(page_pool.Pool.empty(page_pool.context_layout(layout, k,
                                                                                  length)))
                  for length in _segment_lengths(contexts))
    segments = len(store)
    ints = lambda shape, fill=0: jnp.full(shape, fill, jnp.int32)
    zeros = ints((d, k * n))
    rows = Rows(state=ints((d, k * n), IDLE), t=zeros, token=zeros, position=zeros,
                started=zeros, known=zeros, replay=zeros, turn=zeros, turn_start=zeros)
    groups = Groups(context=ints((d, k), -1), stamp=ints((d, k)), last_token=ints((d, k)),
                    last_position=ints((d, k)), lengths=ints((d, k, segments)),
                    first=ints((d, k, segments)))
    rows_total = d * per_block * n
    out = Outputs(completions=ints((rows_total, new_bucket)),
                  logprobs=jnp.zeros((rows_total, new_bucket), jnp.float32),
                  lengths=ints((rows_total,)), stopped=jnp.zeros(rows_total, bool),
                  waiting=jnp.zeros(rows_total, bool), recomputed=ints((rows_total,)))
    if shape.record_routes:
        num_contexts = contexts['valid'].shape[0]
        suffix = contexts['suffix_tokens'].shape[1]
        out = out.replace(
            routes=recorded_routes.empty(config, rows_total, new_bucket),
            prompt_routes=recorded_routes.empty(config, num_contexts,
                                                contexts['prompt_tokens'].shape[1]),
            suffix_routes=recorded_routes.empty(config, num_contexts, suffix) if suffix else None)
    tables = page_pool.PageTables.empty(d, layout.pages, k * n, new_bucket // layout.page_size)
    pool = _pool_constrained(page_pool.Pool.empty(layout))
    kv = jnp.zeros((config.num_layers, d * k * n, 1, config.num_kv_heads, config.head_dim),
                   config.dtype)
    pending = PendingTokens(k=kv, v=kv, valid=jnp.zeros(d * k * n, bool))
    return LoopState(step=jnp.zeros((), jnp.int32), groups=constrain_blocks(groups),
                     rows=constrain_blocks(rows), next_context=ints((d,)), admitted=ints((d,)),
                     store=store, tables=constrain_blocks(tables), pool=pool, pending=pending,
                     out=constrain_blocks(out))


def _views(state: LoopState, tables: page_pool.PageTables, active: jax.Array, pick, *,
           n: int) -> tuple:
    """What a decode step attends to besides the new token: each group's context segments (read
    once for its n rows; nothing for a group with no active row) and each row's own pages.
    pick [D, b] (None: every row): the rows the step computes, the rows in flight among them."""
    d, k = state.groups.context.shape
    r = tables.table.shape[1]
    slots = None if pick is None else (jnp.arange(d)[:, None] * r + pick).reshape(-1)
    reading = active.reshape(d, k, n).any(axis=2).reshape(-1)
    views = []
    for i, pool in enumerate(state.store):
        views.append(pool.view(page_pool.slot_tables(pool.layout, k),
                               jnp.where(reading, state.groups.lengths[..., i].reshape(-1), 0),
                               state.groups.first[..., i].reshape(-1), SEGMENTS[i]).replace(
                                   query_slots=slots, rows_per_group=n))
    first_own = jnp.repeat(state.groups.last_position, n, axis=1)  # own token 0's position
    # Only active rows read pages: a stopped or preempted row's table still names pages that
    # other rows hold now.
    own_lengths = jnp.where(active, state.rows.t, 0)
    table = tables.table
    if pick is not None:
        own_lengths, first_own = _picked(own_lengths, pick), _picked(first_own, pick)
        table = jnp.take_along_axis(table, pick[..., None], axis=1)
    views.append(state.pool.view(table.reshape(-1, table.shape[-1]), own_lengths.reshape(-1),
                                 first_own.reshape(-1), 'own'))
    return tuple(views)


def _picked(x: jax.Array, pick: jax.Array) -> jax.Array:
    """[D, R, ...] -> [D, b, ...]: the rows pick [D, b] names."""
    return jnp.take_along_axis(x, pick.reshape(pick.shape + (1,) * (x.ndim - 2)), axis=1)


def _placed(x: jax.Array, pick: jax.Array, rows: int, axis: int = 0) -> jax.Array:
    """x whose `axis` holds, block by block, the D * b rows pick [D, b] names -> D * rows there,
    each picked row's value in its place, zeros elsewhere."""
    d, b = pick.shape
    x = x.reshape(x.shape[:axis] + (d, b) + x.shape[axis + 1:])
    full = jnp.zeros(x.shape[:axis] + (d, rows) + x.shape[axis + 2:], x.dtype)
    at = (slice(None),) * axis + (jnp.arange(d)[:, None], pick)
    return full.at[at].set(x).reshape(x.shape[:axis] + (d * rows,) + x.shape[axis + 2:])


def _appendable(state: LoopState, shape: Shape) -> tuple:
    """([D, R] each) rows that may feed known tokens in a pass now (active, two or more known
    ahead, the pages for them free), how many they feed and the pages they then hold."""
    rows, tables, page_size = state.rows, state.tables, shape.layout.page_size
    ahead = rows.known - rows.t
    count = jnp.minimum(ahead, shape.append_tokens)
    pages = (rows.t + count + page_size - 1) // page_size
    free = jnp.maximum(pages - tables.held, 0) <= tables.count[:, None]
    return (rows.state == ACTIVE) & (ahead >= 2) & free, count, pages


def _append(model, contexts: dict, layer_weights, shape: Shape, state: LoopState) -> LoopState:
    """Up to `append_rows` rows a block feed up to `append_tokens` of their known tokens each in
    one pass (a prefill over their pages): a row's token and the known ones after it but the
    last, whose keys and values go into its pages; it then holds the last back, as a decode
    step would have left it. The same as that many decode steps, in one forward of a few tokens
    a row instead, and one forward for rows whose tools answered together."""
    n, width, page_size = shape.n, shape.append_tokens, shape.layout.page_size
    d, k = state.groups.context.shape
    ok, count, pages = _appendable(state, shape)
    pick = jnp.argsort(~ok, axis=1, stable=True)[:, :shape.append_rows]  # [D, A]: the first
    block = jnp.arange(d)[:, None]
    at = (block, pick)
    tables = state.tables
    # Each fits in the free pages beside the rows picked before it.
    owed = jnp.cumsum(jnp.where(ok[at], jnp.maximum(pages[at] - tables.held[at], 0), 0), axis=1)
    some = ok[at] & (owed <= tables.count[:, None])
    count = jnp.where(some, count[at], 0)
    for _ in range(-(-width // page_size) + 1):  # at most that many pages more
        grows = jnp.zeros(ok.shape, bool).at[at].set(some & (tables.held[at] < pages[at]))
        tables = page_pool.grow(tables, grows)
    rows, out = state.rows, state.out
    t, slot = rows.t[at], pick // n
    _, episode = episodes_of_rows(state, contexts, shape)
    episode = episode[at]
    i = jnp.arange(width)
    last_column = out.completions.shape[1] - 1
    known = out.completions[episode[..., None], jnp.clip(t[..., None] + i - 1, 0, last_column)]
    fed = jnp.where(i == 0, rows.token[at][..., None], known)  # [D, A, width]
    real = i < count[..., None]
    positions = jnp.where(real, rows.position[at][..., None] + i, -1)
    flat = lambda x: x.reshape(-1, *x.shape[2:])  # [D, A, ...] -> [D * A, ...], block-major
    group = flat(block * k + slot)
    views = tuple(pool.view(page_pool.slot_tables(pool.layout, k)[group],
                            flat(jnp.where(some, state.groups.lengths[..., s][block, slot], 0)),
                            flat(state.groups.first[..., s][block, slot]), SEGMENTS[s])
                  for s, pool in enumerate(state.store))
    views += (state.pool.view(flat(tables.table[at]), flat(jnp.where(some, t, 0)),
                              flat(state.groups.last_position[block, slot]), 'own'),)
    _, kv, experts = model.extend(flat(fed), flat(positions), pages=views,
                                  layer_weights=layer_weights, with_routes=True)
    by_token = lambda x: x.reshape(x.shape[0], -1, 1, *x.shape[3:])  # a row per token
    pool = page_pool.write_tokens(state.pool, by_token(kv.k), by_token(kv.v),
                                  jnp.repeat(flat(tables.table[at]), width, axis=0),
                                  (t[..., None] + i).reshape(-1), real.reshape(-1))
    after = t + count
    taken = t[..., None] + i  # own indices of the known tokens it takes
    again = real & (taken < rows.replay[at][..., None]) & (taken < rows.turn_start[at][..., None])
    last = out.completions[episode, jnp.clip(after - 1, 0, last_column)]
    put = lambda x, value: x.at[at].set(jnp.where(some, value, x[at]))
    rows = rows.replace(t=put(rows.t, after), token=put(rows.token, last),
                        position=put(rows.position, rows.position[at] + count))
    out = out.replace(recomputed=out.recomputed.at[episode].add(
        jnp.where(some, again.sum(axis=-1), 0)))
    if experts is not None:
        experts = experts.reshape(*fed.shape, *experts.shape[2:])
    out = _record_routes(out, episode[..., None], taken, experts, real)
    return state.replace(rows=rows, tables=tables, pool=pool, out=out)


def _record_routes(out: Outputs, episodes, columns, experts, fed) -> Outputs:
    """With record_routes, the experts [..., sparse layers, k] of the tokens `fed` [...] go to
    out.routes[episodes, columns]: a column is the own index of the token drawn after the one
    fed (Rollouts.from_parts lays them out so)."""
    if out.routes is None:
        return out
    past = out.routes.shape[0]  # an index past the end: dropped
    return out.replace(routes=out.routes.at[jnp.where(fed, episodes, past), columns].set(
        experts.astype(out.routes.dtype), mode='drop'))


def episodes_of_rows(state: LoopState, contexts: dict, shape: Shape) -> tuple:
    """([D, R] each) the request context of each row's group slot and the row's episode (its
    output row: context * n + sample)."""
    d, r = state.rows.state.shape
    per_block = contexts['valid'].shape[0] // d
    slot_context = jnp.repeat(jnp.maximum(state.groups.context, 0), shape.n, axis=1)
    context = jnp.arange(d, dtype=jnp.int32)[:, None] * per_block + slot_context
    return context, context * shape.n + jnp.arange(r) % shape.n


def free_groups(state: LoopState, n: int) -> LoopState:
    """Group slots none of whose rows is in flight or queued are free again."""
    d = state.groups.context.shape[0]
    busy = (state.rows.state != IDLE).reshape(d, -1, n).any(axis=2)
    return state.replace(groups=state.groups.replace(
        context=jnp.where(busy, state.groups.context, -1)))


def can_progress(contexts: dict, state: LoopState, shape: Shape) -> jax.Array:
    """Whether a step would do anything: a row is active, a queued row can start, or a block
    should admit contexts. (Rows waiting for the host alone: nothing to do until it answers.)"""
    queued = jnp.any(state.rows.state == QUEUED, axis=1)
    return (jnp.any(state.rows.state == ACTIVE) | jnp.any(queued & (admission.room_to_start(state, shape) > 0))
            | admission.wants_contexts(contexts, state, admit=shape.admit))


def _step(model, contexts: dict, settings: SamplingSettings, seed_key, stop_ids, limits: Limits,
          layer_weights, shape: Shape, state: LoopState) -> LoopState:
    """One decode step of every row in flight: admit contexts, start rows, find their pages,
    then each active row feeds its token and draws the next (or takes it, when known)."""
    n, page_size = shape.n, shape.layout.page_size
    last, table = state.pending, state.tables.table
    state = state.replace(pool=page_pool.write_tokens(
        state.pool, last.k, last.v, table.reshape(-1, table.shape[-1]),
        state.rows.t.reshape(-1) - 1, last.valid))
    state = jax.lax.cond(admission.wants_contexts(contexts, state, admit=shape.admit),
                         functools.partial(admission.admit, model, contexts, shape=shape),
                         lambda s: s, state)
    state = admission.start_rows(state, shape)
    if shape.append_tokens:  # up to `admit` passes a step, each `append_rows` rows a block
        append = functools.partial(_append, model, contexts, layer_weights, shape)
        state = jax.lax.while_loop(
            lambda c: (c[0] < shape.admit) & jnp.any(_appendable(c[1], shape)[0]),
            lambda c: (c[0] + 1, append(c[1])), (0, state))[1]
    needs = (state.rows.state == ACTIVE) & (state.rows.t % page_size == 0)
    short = jnp.any(needs.sum(axis=1) > state.tables.count)
    state, needs = jax.lax.cond(short, admission.preempt, lambda s, w: (s, w), state, needs)
    tables = page_pool.grow(state.tables, needs)
    rows, out = state.rows, state.out
    active = rows.state == ACTIVE
    d, r = active.shape
    # The rows the forward computes: every row, or (rows_computed) the rows in flight first.
    pick = None
    if shape.rows_computed and shape.rows_computed < r:
        pick = jnp.argsort(~active, axis=1, stable=True)[:, :shape.rows_computed]
    picked = (lambda x: x) if pick is None else functools.partial(_picked, pick=pick)
    placed = ((lambda x, axis=0: x) if pick is None
              else functools.partial(_placed, pick=pick, rows=r))  # back in their rows
    logits, new_kv, experts = model.extend(
        picked(rows.token).reshape(-1, 1),
        picked(jnp.where(active, rows.position, -1)).reshape(-1, 1),
        pages=_views(state, tables, active, pick, n=n), layer_weights=layer_weights,
        with_routes=True)
    context, episode = episodes_of_rows(state, contexts, shape)
    sample = jnp.arange(r) % n
    stream = picked(contexts['stream_index'][context] * n + sample)
    keys = row_step_keys(seed_key, stream.reshape(-1),
                         picked(rows.t + contexts['stream_offset'][context]).reshape(-1))
    drawn, logprobs = choose_tokens(logits[:, -1], keys, settings)
    drawn, logprobs = placed(drawn).reshape(d, r), placed(logprobs).reshape(d, r)
    experts = None if experts is None else placed(experts)
    known = active & (rows.t < rows.known)
    given = out.completions[episode, jnp.minimum(rows.t, out.completions.shape[1] - 1)]
    tokens = jnp.where(known, given, drawn)
    sampled = active & ~known
    hit_stop = sampled & jnp.any(tokens[..., None] == stop_ids, axis=-1)
    t = rows.t + 1
    room = limits.episode_tokens - 1 - jnp.repeat(state.groups.last_position, n, axis=1)
    turn_over = sampled & (hit_stop | (t - rows.turn_start >= limits.turn_tokens) | (t >= room))
    last_turn = (rows.turn + 1 >= limits.turns) | ((t >= room) & ~hit_stop)
    finished, waiting = turn_over & last_turn, turn_over & ~last_turn
    pending = PendingTokens(k=placed(new_kv.k, axis=1), v=placed(new_kv.v, axis=1),
                            valid=(active & ~finished).reshape(-1))

    past = out.lengths.shape[0]  # an index past the end: dropped
    at = jnp.where(sampled, episode, past)
    again = active & (rows.t < rows.replay) & (rows.t < rows.turn_start)  # an earlier turn's
    out = out.replace(completions=out.completions.at[at, rows.t].set(tokens, mode='drop'),
                      logprobs=out.logprobs.at[at, rows.t].set(logprobs, mode='drop'),
                      lengths=out.lengths.at[at].set(t, mode='drop'),
                      stopped=out.stopped.at[at].set(hit_stop, mode='drop'),
                      waiting=out.waiting.at[jnp.where(waiting, episode, past)].set(True,
                                                                                    mode='drop'),
                      recomputed=out.recomputed.at[episode].add(again.astype(jnp.int32)))
    if out.routes is not None:  # the experts of the token each active row fed
        out = _record_routes(out, episode, rows.t,
                             experts.reshape(*rows.t.shape, *experts.shape[2:]), active)
    state_now = jnp.where(finished, IDLE, jnp.where(waiting, WAITING, rows.state))
    rows = rows.replace(state=state_now, t=jnp.where(active, t, rows.t),
                        token=jnp.where(active, tokens, rows.token),
                        position=jnp.where(active, rows.position + 1, rows.position))
    state = state.replace(step=state.step + 1, rows=rows, pending=pending, out=out,
                          tables=page_pool.release(tables, finished))
    return free_groups(state, n)


def _run(model, contexts: dict, settings: SamplingSettings, seed_key, stop_ids, limits: Limits,
         layer_weights, state: LoopState, steps, wait_rows, shape: Shape) -> LoopState:
    """Steps until nothing can progress, or `steps` steps, or `wait_rows` more rows wait for the
    host than at the start (a chunk of a multi-turn rollout: turns.py)."""
    until = state.step + steps
    waited = jnp.sum(state.rows.state == WAITING) + wait_rows

    def keep_going(state: LoopState):
        return ((state.step < until) & (jnp.sum(state.rows.state == WAITING) < waited)
                & can_progress(contexts, state, shape))

    step = functools.partial(_step, model, contexts, settings, seed_key, stop_ids, limits,
                             layer_weights, shape)
    return jax.lax.while_loop(keep_going, step, state)


@functools.partial(jax.jit, static_argnames=('graphdef', 'shape'))
def sample_continuous(graphdef, params, contexts: dict, settings: SamplingSettings, seed_key,
                      stop_ids, max_new_tokens, *, shape: Shape):
    """Samples n continuations of each context of `contexts` (layout arrays, one row per
    context) in the sizes `shape` says (one block per row device). Where the layout has a pool
    per layer, the decode slices each layer's weights once, before the loop, as static.decode's
    hoist_layers does.

    Returns (completions [C*n, T], logprobs [C*n, T], lengths [C*n], stopped [C*n]) in row
    order, then None, or with `shape.record_routes` (a MoE) the recorded experts (prompt [C, Sp, ...],
    suffix [C, Ss, ...] or None, rows [C*n, T, ...]; see Outputs).
    """
    TRACE_COUNTS['continuous'] += 1
    model = nnx.merge(graphdef, params)
    state = _initial_state(model, contexts, shape)
    layer_weights = _hoisted(model, shape.layout)
    out = _run(model, contexts, settings, seed_key, stop_ids, Limits.one_turn(max_new_tokens),
               layer_weights, state, UNBOUNDED, UNBOUNDED, shape).out
    routes = (out.prompt_routes, out.suffix_routes, out.routes) if shape.record_routes else None
    return out.completions, out.logprobs, out.lengths, out.stopped, routes


@functools.partial(jax.jit, static_argnames=('graphdef', 'shape'))
def start(graphdef, params, contexts: dict, *, shape: Shape) -> LoopState:
    """The loop's state before its first step (a multi-turn rollout runs it in chunks)."""
    return _initial_state(nnx.merge(graphdef, params), contexts, shape)


def _hoisted(model, layout) -> list[dict] | None:
    """Each layer's weights laid out for a decode that unrolls its layers (Decoder.
    layer_weights) where the layout has a pool per layer (CPU), else None (the scan slices
    them)."""
    return model.layer_weights() if layout.per_layer else None


@functools.partial(jax.jit, static_argnames=('graphdef', 'layout'))
def hoisted_weights(graphdef, params, *, layout) -> list[dict] | None:
    """The `layer_weights` `advance` takes (_hoisted's), made once per rollout: laid out anew
    in every chunk they cost a multi-turn rollout about a decode step a chunk (SmolLM2 f32 on
    2 cores: a chunk of no step took 185 ms, 3 ms with them made once)."""
    return _hoisted(nnx.merge(graphdef, params), layout)


@functools.partial(jax.jit, static_argnames=('graphdef', 'shape'), donate_argnames=('state',))
def advance(graphdef, params, contexts: dict, settings: SamplingSettings, seed_key, stop_ids,
            limits: Limits, layer_weights, state: LoopState, steps, wait_rows, *,
            shape: Shape) -> LoopState:
    """One chunk of a multi-turn rollout (_run's bounds), in place; `layer_weights`:
    hoisted_weights'."""
    TRACE_COUNTS['turns'] += 1
    return _run(nnx.merge(graphdef, params), contexts, settings, seed_key, stop_ids, limits,
                layer_weights, state, steps, wait_rows, shape)


@functools.partial(jax.jit, static_argnames=('graphdef',), donate_argnames=('state',))
def recompute(graphdef, params, contexts: dict, state: LoopState) -> tuple:
    """Newer weights take over a running decode with every KV computed again by them
    (rollout.inflight_kv='recompute'; admission.recompute_in_flight): (state, tokens recomputed)."""
    return admission.recompute_in_flight(nnx.merge(graphdef, params), contexts, state)
