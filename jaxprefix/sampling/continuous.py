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

import dataclasses
import functools

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from jaxprefix.models.paged_attention import PageLayout
from jaxprefix.models.sharding import constrain
from jaxprefix.sampling import page_pool
from jaxprefix.sampling import routes as recorded_routes
from jaxprefix.sampling.prefill import TRACE_COUNTS, context_kv
from jaxprefix.sampling.token_choice import SamplingSettings, choose_tokens, row_step_keys

IDLE, QUEUED, ACTIVE, WAITING = 0, 1, 2, 3  # WAITING: its turn ended, the host answers it
SEGMENTS = ('prompt', 'suffix')  # a context's segments, as layout.py splits it
_FOREVER = 2 ** 30  # steps, rows or tokens: no bound


@dataclasses.dataclass(frozen=True)
class Shape:
    """The decode's static sizes, per block of rows (budget.plan chooses them): group slots of
    n rows, at most `row_slots` of them active, `admit` contexts prefilled together, up to
    `new_bucket` own tokens a row, `reserve` pages promised to each active row, and the rows'
    pages as `layout` says; `append_tokens` (turns) feeds a row's known tokens (the host's
    answer, a preempted row's replay) in passes of that many instead of one a step;
    `record_routes` (a MoE) records experts for routing replay. Hashable: the one static
    argument of the programs."""
    n: int
    new_bucket: int
    row_slots: int
    context_slots: int
    admit: int
    reserve: int
    layout: PageLayout
    append_tokens: int = 0  # known tokens a row feeds in one pass (0: one a decode step)
    record_routes: bool = False


@flax.struct.dataclass
class Limits:
    """Where a row's turn and its episode end (traced: other values do not recompile). A turn
    ends after a stop id or `turn_tokens` sampled tokens; the episode after `turns` turns or
    when its tokens (context included) reach `episode_tokens`. One turn of generate():
    (max_new_tokens, 1, no bound)."""
    turn_tokens: jax.Array     # int32 []
    turns: jax.Array           # int32 []
    episode_tokens: jax.Array  # int32 []

    @classmethod
    def one_turn(cls, max_new_tokens) -> Limits:
        return cls(jnp.asarray(max_new_tokens, jnp.int32), jnp.int32(1), jnp.int32(_FOREVER))


@flax.struct.dataclass
class Groups:
    """[D, K] each (lengths, first: [D, K, segments]). A slot is free when context is -1 (then
    none of its rows is queued or active)."""
    context: jax.Array        # int32: index of the context within its block
    stamp: jax.Array          # int32: admission order; older groups' queued rows start first
    last_token: jax.Array     # int32: the held-back last context token, every sample's first input
    last_position: jax.Array  # int32
    lengths: jax.Array        # int32: real tokens of each context segment (prompt, suffix)
    first: jax.Array          # int32: the position of each segment's first token


@flax.struct.dataclass
class Rows:
    """[D, K * n] each; row r of a block is sample r % n of the group in slot r // n. A row's
    own tokens are everything after its context: sampled turns and, between them, the tokens
    the host appended (observations); own token t is drawn at the step that feeds token t - 1."""
    state: jax.Array    # int32: IDLE (free slot or done), QUEUED, ACTIVE or WAITING
    t: jax.Array        # int32: own tokens drawn so far (its next own token's index)
    token: jax.Array    # int32: the token fed at the next step
    position: jax.Array  # int32: its position
    started: jax.Array  # int32: the loop step it (last) started at: preemption takes the youngest
    known: jax.Array    # int32: own tokens below this index are known (Outputs.completions):
                        # appended by the host, or drawn before a preemption: fed, not drawn
    replay: jax.Array   # int32: own tokens below this index were computed before a preemption
    turn: jax.Array     # int32: its turn (0 first)
    turn_start: jax.Array  # int32: the own index of its turn's first sampled token


@flax.struct.dataclass
class Outputs:
    """[D * R, T] and [D * R], R = contexts per block x n: row (d * C/D + m) * n + j is sample j
    of block d's context m, i.e. rows in request order."""
    completions: jax.Array  # int32: own tokens (sampled, and what the host appended)
    logprobs: jax.Array     # f32: of sampled tokens (0 elsewhere)
    lengths: jax.Array      # int32
    stopped: jax.Array      # bool: its last sampled token is a stop id
    waiting: jax.Array      # bool: its turn ended and the host has yet to answer
    recomputed: jax.Array   # int32: tokens before its current turn computed again (preempted)
    # record_routes: [D * R, T, sparse layers, k] as static.DecodeState.routes; the contexts'
    # (row: the context in request order) prompts' [C, Sp, ...] and suffixes' [C, Ss, ...]
    routes: jax.Array | None = None
    prompt_routes: jax.Array | None = None
    suffix_routes: jax.Array | None = None


@flax.struct.dataclass
class PendingTokens:
    """The last step's new keys and values, written into the rows' pages at the top of the next
    step: then the pool's in-place write comes before that step's reads of it (written after
    the reads, nothing but the model's output orders them, and the K and V projections come
    before attention: XLA copied every layer's pool each step to keep the reads safe). A row
    still going then has the same page table and one token more (its own index t - 1)."""
    k: jax.Array        # [L, D * R, 1, Hkv, Dh]
    v: jax.Array
    valid: jax.Array    # bool [D * R]: rows still going (a stopped row's last token is not read)


@flax.struct.dataclass
class LoopState:
    step: jax.Array             # int32 []
    groups: Groups
    rows: Rows
    next_context: jax.Array     # int32 [D]: the block's next context to admit
    admitted: jax.Array         # int32 [D]: contexts admitted so far (the next stamp)
    store: tuple                # page_pool.Pools, one per context segment: the groups' contexts
    tables: page_pool.PageTables
    pool: page_pool.Pool        # the rows' own tokens
    pending: PendingTokens      # the last step's, not yet in the pool
    out: Outputs


def _blocks(x: jax.Array, d: int) -> jax.Array:
    return x.reshape(d, x.shape[0] // d, *x.shape[1:])


def _constrain_blocks(tree):
    """Every [D, ...] scheduling array split over the row devices."""
    return jax.tree.map(lambda x: constrain(x, ('batch',) + (None,) * (x.ndim - 1)), tree)


def _admit(model, contexts: dict, state: LoopState, shape: Shape) -> LoopState:
    """Prefills each block's next `shape.admit` contexts into its first free group slots; their n rows
    are queued."""
    groups, n, admit = state.groups, shape.n, shape.admit
    d, k = groups.context.shape
    num_valid = _blocks(contexts['valid'], d).sum(axis=1)
    free = groups.context < 0
    rank = jnp.cumsum(free, axis=1) - 1
    # target[f]: the block's f-th free slot (k when there are fewer).
    target = jax.vmap(lambda fr, rk: jnp.full(admit, k, jnp.int32).at[jnp.where(fr, rk, admit)]
                      .set(jnp.arange(k, dtype=jnp.int32), mode='drop'))(free, rank)
    local = state.next_context[:, None] + jnp.arange(admit, dtype=jnp.int32)
    ok = (local < num_valid[:, None]) & (target < k)
    target = jnp.where(ok, target, k)

    def pick(name, empty=None):  # [D*F, ...] rows of the admitted contexts
        table = _blocks(contexts[name], d)
        picked = jax.vmap(lambda block, at: block[at])(table, jnp.minimum(local, table.shape[1] - 1))
        if empty is not None:
            picked = jnp.where(ok.reshape(ok.shape + (1,) * (picked.ndim - 2)), picked, empty)
        return picked.reshape(d * admit, *picked.shape[2:])

    record = state.out.routes is not None
    prompt, prompt_routes = context_kv(model, pick('prompt_tokens'),
                                       pick('prompt_positions', -1), record_routes=record)
    segments, out = (prompt,), state.out
    if contexts['suffix_tokens'].shape[1]:
        suffix, suffix_routes = context_kv(model, pick('suffix_tokens'),
                                           pick('suffix_positions', -1), segments,
                                           record_routes=record)
        segments += (suffix,)
    if record:  # at each admitted context's row in request order (past the end: dropped)
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
    return state.replace(groups=groups, rows=rows, store=store, out=out,
                         next_context=state.next_context + count,
                         admitted=state.admitted + count)


def _wants_contexts(contexts: dict, state: LoopState, *, admit: int) -> jax.Array:
    """Whether some block should admit contexts now: it has contexts left and either room for a
    full batch of them, or free room and no queued row (its rows would otherwise idle)."""
    groups = state.groups
    pending = _blocks(contexts['valid'], groups.context.shape[0]).sum(1) - state.next_context
    free = (groups.context < 0).sum(axis=1)
    starving = (free > 0) & ~jnp.any(state.rows.state == QUEUED, axis=1)
    return jnp.any((pending > 0) & ((free >= jnp.minimum(admit, pending)) | starving))


def _in_flight(rows: Rows) -> jax.Array:
    """Rows between their start and their episode's end: decoding, or waiting for the host with
    their pages (and their promise of `reserve`) kept."""
    return (rows.state == ACTIVE) | (rows.state == WAITING)


def _room(state: LoopState, shape: Shape) -> jax.Array:
    """[D] rows each block may start now: free row slots with `reserve` unpromised pages each."""
    in_flight = _in_flight(state.rows)
    return jnp.minimum(shape.row_slots - in_flight.sum(axis=1),
                       state.tables.unreserved(in_flight, shape.reserve) // shape.reserve)


def _start_rows(state: LoopState, shape: Shape) -> LoopState:
    """Each block starts its oldest queued rows while it has fewer than `row_slots` rows in
    flight and `reserve` unreserved pages for each. A row starts from its first own token
    (again, if it was preempted: what it had drawn is known, and replayed)."""
    rows, groups, n = state.rows, state.groups, shape.n
    d, r = rows.state.shape
    queued = rows.state == QUEUED
    room = _room(state, shape)
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


def _preempt(state: LoopState, needs: jax.Array) -> tuple[LoopState, jax.Array]:
    """Rows that give their pages back start again from their first own token later, feeding
    what they had drawn (known) instead of drawing it again: the same tokens by construction,
    with no tool run twice. Only active rows are preempted: a waiting row keeps its pages."""
    rows = state.rows
    tables, preempted = state.tables.preempt(rows.state == ACTIVE, rows.started, needs)
    upto = lambda x: jnp.where(preempted, jnp.maximum(x, rows.t), x)
    rows = rows.replace(state=jnp.where(preempted, QUEUED, rows.state), known=upto(rows.known),
                        replay=upto(rows.replay))
    return state.replace(rows=rows, tables=tables), needs & ~preempted


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
    return LoopState(step=jnp.zeros((), jnp.int32), groups=_constrain_blocks(groups),
                     rows=_constrain_blocks(rows), next_context=ints((d,)), admitted=ints((d,)),
                     store=store, tables=_constrain_blocks(tables), pool=pool, pending=pending,
                     out=_constrain_blocks(out))


def _views(state: LoopState, tables: page_pool.PageTables, active: jax.Array, *,
           n: int) -> tuple:
    """What a decode step attends to besides the new token: each group's context segments (read
    once for its n rows; nothing for a group with no active row) and each row's own pages."""
    d, k = state.groups.context.shape
    reading = active.reshape(d, k, n).any(axis=2).reshape(-1)
    views = []
    for i, pool in enumerate(state.store):
        views.append(pool.view(page_pool.slot_tables(pool.layout, k),
                               jnp.where(reading, state.groups.lengths[..., i].reshape(-1), 0),
                               state.groups.first[..., i].reshape(-1), SEGMENTS[i]))
    r = tables.table.shape[1]
    first_own = jnp.repeat(state.groups.last_position, n, axis=1)  # own token 0's position
    # Only active rows read pages: a stopped or preempted row's table still names pages that
    # other rows hold now.
    own_lengths = jnp.where(active, state.rows.t, 0).reshape(-1)
    views.append(state.pool.view(tables.table.reshape(d * r, -1), own_lengths,
                                 first_own.reshape(-1), 'own'))
    return tuple(views)


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
    """One row a block feeds up to `append_tokens` of its known tokens in one pass (a prefill
    over its pages): its token and the known ones after it but the last, whose keys and values
    go into its pages; it then holds the last back, as a decode step would have left it. The
    same as that many decode steps, in one forward of a few tokens a row instead."""
    n, width = shape.n, shape.append_tokens
    d, k = state.groups.context.shape
    ok, count, pages = _appendable(state, shape)
    pick = jnp.argmax(ok, axis=1)  # [D]: the block's first such row
    at = (jnp.arange(d), pick)
    some = ok[at]
    count = jnp.where(some, count[at], 0)
    tables = state.tables
    for _ in range(-(-width // shape.layout.page_size) + 1):  # at most that many pages more
        grows = jnp.zeros(ok.shape, bool).at[at].set(some & (tables.held[at] < pages[at]))
        tables = page_pool.grow(tables, grows)
    rows, out = state.rows, state.out
    t, slot = rows.t[at], pick // n
    _, episode = episodes_of_rows(state, contexts, shape)
    episode = episode[at]
    i = jnp.arange(width)
    known = out.completions[episode[:, None], jnp.clip(t[:, None] + i - 1, 0,
                                                       out.completions.shape[1] - 1)]
    fed = jnp.where(i == 0, rows.token[at][:, None], known)  # [D, width]
    real = i < count[:, None]
    positions = jnp.where(real, rows.position[at][:, None] + i, -1)
    group = jnp.arange(d) * k + slot
    views = tuple(pool.view(page_pool.slot_tables(pool.layout, k)[group],
                            jnp.where(some, state.groups.lengths[..., s][at[0], slot], 0),
                            state.groups.first[..., s][at[0], slot], SEGMENTS[s])
                  for s, pool in enumerate(state.store))
    views += (state.pool.view(tables.table[at], jnp.where(some, t, 0),
                              state.groups.last_position[at[0], slot], 'own'),)
    _, kv, experts = model.extend(fed, positions, pages=views, layer_weights=layer_weights,
                                  with_routes=True)
    flat = lambda x: x.reshape(x.shape[0], d * width, 1, *x.shape[3:])  # a row per token
    pool = page_pool.write_tokens(state.pool, flat(kv.k), flat(kv.v),
                                  jnp.repeat(tables.table[at], width, axis=0),
                                  (t[:, None] + i).reshape(-1), real.reshape(-1))
    after = t + count
    taken = t[:, None] + i  # own indices of the known tokens it takes
    again = real & (taken < rows.replay[at][:, None]) & (taken < rows.turn_start[at][:, None])
    last = out.completions[episode, jnp.clip(after - 1, 0, out.completions.shape[1] - 1)]
    put = lambda x, value: x.at[at].set(jnp.where(some, value, x[at]))
    rows = rows.replace(t=put(rows.t, after), token=put(rows.token, last),
                        position=put(rows.position, rows.position[at] + count))
    out = out.replace(recomputed=out.recomputed.at[episode].add(
        jnp.where(some, again.sum(axis=1), 0)))
    out = _record_routes(out, episode[:, None], t[:, None] + i, experts, real)
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
    return (jnp.any(state.rows.state == ACTIVE) | jnp.any(queued & (_room(state, shape) > 0))
            | _wants_contexts(contexts, state, admit=shape.admit))


def _step(model, contexts: dict, settings: SamplingSettings, seed_key, stop_ids, limits: Limits,
          layer_weights, shape: Shape, state: LoopState) -> LoopState:
    """One decode step of every row in flight: admit contexts, start rows, find their pages,
    then each active row feeds its token and draws the next (or takes it, when known)."""
    n, page_size = shape.n, shape.layout.page_size
    last, table = state.pending, state.tables.table
    state = state.replace(pool=page_pool.write_tokens(
        state.pool, last.k, last.v, table.reshape(-1, table.shape[-1]),
        state.rows.t.reshape(-1) - 1, last.valid))
    state = jax.lax.cond(_wants_contexts(contexts, state, admit=shape.admit),
                         functools.partial(_admit, model, contexts, shape=shape),
                         lambda s: s, state)
    state = _start_rows(state, shape)
    if shape.append_tokens:  # up to `admit` passes a step, each one row a block
        append = functools.partial(_append, model, contexts, layer_weights, shape)
        state = jax.lax.while_loop(
            lambda c: (c[0] < shape.admit) & jnp.any(_appendable(c[1], shape)[0]),
            lambda c: (c[0] + 1, append(c[1])), (0, state))[1]
    needs = (state.rows.state == ACTIVE) & (state.rows.t % page_size == 0)
    short = jnp.any(needs.sum(axis=1) > state.tables.count)
    state, needs = jax.lax.cond(short, _preempt, lambda s, w: (s, w), state, needs)
    tables = page_pool.grow(state.tables, needs)
    rows, out = state.rows, state.out
    active = rows.state == ACTIVE
    logits, new_kv, experts = model.extend(
        rows.token.reshape(-1, 1), jnp.where(active, rows.position, -1).reshape(-1, 1),
        pages=_views(state, tables, active, n=n), layer_weights=layer_weights, with_routes=True)
    context, episode = episodes_of_rows(state, contexts, shape)
    sample = jnp.arange(rows.t.shape[1]) % n
    keys = row_step_keys(seed_key, (contexts['stream_index'][context] * n + sample).reshape(-1),
                         (rows.t + contexts['stream_offset'][context]).reshape(-1))
    drawn, logprobs = choose_tokens(logits[:, -1], keys, settings)
    drawn, logprobs = drawn.reshape(rows.t.shape), logprobs.reshape(rows.t.shape)
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
    pending = PendingTokens(k=new_kv.k, v=new_kv.v, valid=(active & ~finished).reshape(-1))

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
         state: LoopState, steps, wait_rows, shape: Shape) -> LoopState:
    """Steps until nothing can progress, or `steps` steps, or `wait_rows` more rows wait for the
    host than at the start (a chunk of a multi-turn rollout: turns.py)."""
    layer_weights = model.layer_weights() if shape.layout.per_layer else None
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
    out = _run(model, contexts, settings, seed_key, stop_ids, Limits.one_turn(max_new_tokens),
               state, _FOREVER, _FOREVER, shape).out
    routes = (out.prompt_routes, out.suffix_routes, out.routes) if shape.record_routes else None
    return out.completions, out.logprobs, out.lengths, out.stopped, routes


@functools.partial(jax.jit, static_argnames=('graphdef', 'shape'))
def start(graphdef, params, contexts: dict, *, shape: Shape) -> LoopState:
    """The loop's state before its first step (a multi-turn rollout runs it in chunks)."""
    return _initial_state(nnx.merge(graphdef, params), contexts, shape)


@functools.partial(jax.jit, static_argnames=('graphdef', 'shape'), donate_argnames=('state',))
def advance(graphdef, params, contexts: dict, settings: SamplingSettings, seed_key, stop_ids,
            limits: Limits, state: LoopState, steps, wait_rows, *, shape: Shape) -> LoopState:
    """One chunk of a multi-turn rollout (_run's bounds), in place."""
    TRACE_COUNTS['turns'] += 1
    return _run(nnx.merge(graphdef, params), contexts, settings, seed_key, stop_ids, limits,
                state, steps, wait_rows, shape)
