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
    token later, drawing the same tokens);
  - attention reads the context segments and the row's filled pages only (the Pallas paged
    kernel on TPU, tpu_attention.attend_pages), merged by their log-sum-exp. A step's new
    token attends to itself as a segment of its own; its keys and values go into the pages at
    the top of the next step (PendingTokens).
So the KV memory is K x (context length) + pages x page_size per block, whatever the number of
contexts and samples (budget.py chooses s, K, F and the pages); only the outputs ([C * n, T]
tokens and log-probs, 8 bytes a token) grow with the request.

Results do not depend on the schedule: sample j of context i draws from (seed, i*n + j, t), t its
own token index, and its keys and values are the same whatever page holds them, so it attends
to the same keys in the same order as in the static decode (a preempted row, restarted, draws
the same tokens again).

Sharding: contexts and rows are split over the D devices of ('data', 'fsdp') in D contiguous
blocks (block d holds contexts d*C/D .. (d+1)*C/D - 1 and their rows), and every scheduling array
carries a leading [D] axis: each block admits its own contexts into its own group slots and its
rows take pages of its own part of the pool, so a row reads its context and its pages on its
own device. KV heads (and the weights) split over 'tensor'. A block whose contexts run long
keeps the loop going while the others idle: the price of not moving KV between devices.

Routing replay (a MoE, `record_routes`): the outputs also hold the experts of the admitted
contexts' tokens (written at admission) and of the token each row feeds at each of its steps
(static.py says which); a preempted row writes them again as it redraws its tokens.
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

IDLE, QUEUED, ACTIVE = 0, 1, 2
SEGMENTS = ('prompt', 'suffix')  # a context's segments, as layout.py splits it


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
    """[D, K * n] each; row r of a block is sample r % n of the group in slot r // n."""
    state: jax.Array    # int32: IDLE (free slot or stopped), QUEUED or ACTIVE
    t: jax.Array        # int32: tokens drawn so far (its next own token's index)
    token: jax.Array    # int32: the token fed at the next step
    position: jax.Array  # int32: its position
    started: jax.Array  # int32: the loop step it (last) started at: preemption takes the youngest


@flax.struct.dataclass
class Outputs:
    """[D * R, T] and [D * R], R = contexts per block x n: row (d * C/D + m) * n + j is sample j
    of block d's context m, i.e. rows in request order."""
    completions: jax.Array  # int32
    logprobs: jax.Array     # f32
    lengths: jax.Array      # int32
    stopped: jax.Array      # bool
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


def _admit(model, contexts: dict, state: LoopState, *, n: int, admit: int) -> LoopState:
    """Prefills each block's next `admit` contexts into its first free group slots; their n rows
    are queued."""
    groups = state.groups
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
    rows = state.rows.replace(state=jnp.where(queued, QUEUED, state.rows.state),
                              t=jnp.where(queued, 0, state.rows.t))
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


def _unreserved(rows: Rows, tables: page_pool.PageTables, reserve: int) -> jax.Array:
    """[D] free pages not promised to an active row (each active row is promised `reserve`)."""
    promised = jnp.where(rows.state == ACTIVE, jnp.maximum(reserve - tables.held, 0), 0)
    return tables.count - promised.sum(axis=1)


def _start_rows(state: LoopState, *, n: int, row_slots: int, reserve: int) -> LoopState:
    """Each block starts its oldest queued rows while it has fewer than `row_slots` active rows
    and `reserve` unreserved pages for each."""
    rows, groups = state.rows, state.groups
    d, r = rows.state.shape
    queued = rows.state == QUEUED
    room = jnp.minimum(row_slots - (rows.state == ACTIVE).sum(axis=1),
                       _unreserved(rows, state.tables, reserve) // reserve)
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
    return state.replace(rows=Rows(
        state=new(ACTIVE, rows.state), t=new(0, rows.t), token=new(last_token, rows.token),
        position=new(last_position, rows.position), started=new(state.step, rows.started)))


def _preempt_block(rows: Rows, held, count, needs):
    """One block short of pages: the fewest youngest active rows whose pages, given back, cover
    what the others need this step. Returns the rows to preempt [R]."""
    r = rows.state.shape[0]
    active = rows.state == ACTIVE
    age = jnp.where(active, rows.started * r + jnp.arange(r), -1)  # larger: younger
    order = jnp.argsort(-age)  # youngest first (inactive rows last)
    freed = jnp.cumsum(jnp.where(active, held, 0)[order])
    spared = jnp.cumsum(needs[order])
    total = needs.sum()
    enough = count + freed >= total - spared  # after preempting the m + 1 youngest
    m = jnp.where(count >= total, -1, jnp.argmax(enough))
    return jnp.zeros(r, bool).at[order].set(jnp.arange(r) <= m) & active


def _preempt(state: LoopState, needs: jax.Array) -> tuple[LoopState, jax.Array]:
    preempted = jax.vmap(_preempt_block)(state.rows, state.tables.held, state.tables.count, needs)
    tables = page_pool.release(state.tables, preempted)
    rows = state.rows.replace(state=jnp.where(preempted, QUEUED, state.rows.state))
    return state.replace(rows=rows, tables=tables), needs & ~preempted


def _segment_lengths(contexts: dict) -> list[int]:
    """Token slots of each context segment (prompt; suffix when any context has one)."""
    return [contexts[f'{name}_tokens'].shape[1] for name in SEGMENTS
            if contexts[f'{name}_tokens'].shape[1]]


def _pool_constrained(pool: page_pool.Pool) -> page_pool.Pool:
    """Pages split over the row devices by block and over 'tensor' by KV head."""
    return jax.tree.map(lambda x: constrain(x, ('kv_heads', 'batch') + (None,) * (x.ndim - 2)),
                        pool)


def _context_layout(layout: PageLayout, slots: int, length: int) -> PageLayout:
    """A context segment's pool: `slots` group slots a block of `length` tokens each, in pages
    of the rows' size (or one page of the segment, if shorter)."""
    page_size = min(layout.page_size, length)
    return dataclasses.replace(layout, pages=slots * length // page_size, page_size=page_size)


def _initial_state(model, contexts: dict, *, n, context_slots, new_bucket,
                   layout: PageLayout, record_routes: bool) -> LoopState:
    d, k = layout.blocks, context_slots
    per_block = contexts['valid'].shape[0] // d
    config = model.config
    store = tuple(_pool_constrained(page_pool.Pool.empty(_context_layout(layout, k, length)))
                  for length in _segment_lengths(contexts))
    segments = len(store)
    ints = lambda shape, fill=0: jnp.full(shape, fill, jnp.int32)
    rows = Rows(state=ints((d, k * n), IDLE), t=ints((d, k * n)), token=ints((d, k * n)),
                position=ints((d, k * n)), started=ints((d, k * n)))
    groups = Groups(context=ints((d, k), -1), stamp=ints((d, k)), last_token=ints((d, k)),
                    last_position=ints((d, k)), lengths=ints((d, k, segments)),
                    first=ints((d, k, segments)))
    rows_total = d * per_block * n
    out = Outputs(completions=ints((rows_total, new_bucket)),
                  logprobs=jnp.zeros((rows_total, new_bucket), jnp.float32),
                  lengths=ints((rows_total,)), stopped=jnp.zeros(rows_total, bool))
    if record_routes:
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
        per_slot = pool.layout.pages // k  # pages a slot holds of this segment
        views.append(pool.view(page_pool.slot_tables(d, k, per_slot),
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


@functools.partial(jax.jit, static_argnames=('graphdef', 'n', 'row_slots', 'context_slots',
                                             'admit', 'new_bucket', 'reserve', 'layout',
                                             'record_routes'))
def sample_continuous(graphdef, params, contexts: dict, settings: SamplingSettings, seed_key,
                      stop_ids, max_new_tokens, *, n: int, row_slots: int, context_slots: int,
                      admit: int, new_bucket: int, reserve: int, layout: PageLayout,
                      record_routes: bool = False):
    """Samples n continuations of each context of `contexts` (layout arrays, one row per context)
    with at most row_slots active rows per block, in group slots of n rows, over the rows' KV
    pages `layout` describes (one block per row device; `reserve` pages promised to each active
    row). Where the layout has a pool per layer, the decode slices each layer's weights once,
    before the loop, as static.decode's hoist_layers does.

    Returns (completions [C*n, T], logprobs [C*n, T], lengths [C*n], stopped [C*n]) in row
    order, then None, or with `record_routes` (a MoE) the recorded experts (prompt [C, Sp, ...],
    suffix [C, Ss, ...] or None, rows [C*n, T, ...]; see Outputs).
    """
    TRACE_COUNTS['continuous'] += 1
    model = nnx.merge(graphdef, params)
    layer_weights = model.layer_weights() if layout.per_layer else None
    d, page_size = layout.blocks, layout.page_size
    num_contexts = contexts['valid'].shape[0]
    block_start = jnp.arange(d, dtype=jnp.int32)[:, None] * (num_contexts // d)
    num_valid = _blocks(contexts['valid'], d).sum(axis=1)

    def keep_going(state: LoopState):
        return jnp.any(state.rows.state != IDLE) | jnp.any(state.next_context < num_valid)

    def one_step(state: LoopState) -> LoopState:
        last, table = state.pending, state.tables.table
        state = state.replace(pool=page_pool.write_tokens(
            state.pool, last.k, last.v, table.reshape(-1, table.shape[-1]),
            state.rows.t.reshape(-1) - 1, last.valid))
        state = jax.lax.cond(_wants_contexts(contexts, state, admit=admit),
                             functools.partial(_admit, model, contexts, n=n, admit=admit),
                             lambda s: s, state)
        state = _start_rows(state, n=n, row_slots=row_slots, reserve=reserve)
        needs = (state.rows.state == ACTIVE) & (state.rows.t % page_size == 0)
        short = jnp.any(needs.sum(axis=1) > state.tables.count)
        state, needs = jax.lax.cond(short, _preempt, lambda s, w: (s, w), state, needs)
        tables = page_pool.grow(state.tables, needs)
        rows = state.rows
        active = rows.state == ACTIVE
        logits, new_kv, experts = model.extend(
            rows.token.reshape(-1, 1), jnp.where(active, rows.position, -1).reshape(-1, 1),
            pages=_views(state, tables, active, n=n),
            layer_weights=layer_weights, with_routes=True)
        slot_context = jnp.repeat(jnp.maximum(state.groups.context, 0), n, axis=1)  # [D, R]
        sample = jnp.arange(rows.t.shape[1]) % n
        row_ids = (block_start + slot_context) * n + sample
        keys = row_step_keys(seed_key, row_ids.reshape(-1), rows.t.reshape(-1))
        tokens, logprobs = choose_tokens(logits[:, -1], keys, settings)
        tokens, logprobs = tokens.reshape(rows.t.shape), logprobs.reshape(rows.t.shape)
        hit_stop = active & jnp.any(tokens[..., None] == stop_ids, axis=-1)
        t = rows.t + 1
        finished = active & (hit_stop | (t >= max_new_tokens))
        pending = PendingTokens(k=new_kv.k, v=new_kv.v, valid=(active & ~finished).reshape(-1))

        out = state.out
        at = jnp.where(active, row_ids, out.lengths.shape[0])  # past the end: dropped
        out = out.replace(completions=out.completions.at[at, rows.t].set(tokens, mode='drop'),
                          logprobs=out.logprobs.at[at, rows.t].set(logprobs, mode='drop'),
                          lengths=out.lengths.at[at].set(t, mode='drop'),
                          stopped=out.stopped.at[at].set(hit_stop, mode='drop'))
        if out.routes is not None:  # the experts of the token each active row fed
            fed = experts.reshape(*at.shape, *experts.shape[2:]).astype(out.routes.dtype)
            out = out.replace(routes=out.routes.at[at, rows.t].set(fed, mode='drop'))
        rows = rows.replace(state=jnp.where(finished, IDLE, rows.state),
                            t=jnp.where(active, t, rows.t), token=jnp.where(active, tokens, rows.token),
                            position=jnp.where(active, rows.position + 1, rows.position))
        tables = page_pool.release(tables, finished)
        busy = (rows.state != IDLE).reshape(d, -1, n).any(axis=2)
        groups = state.groups.replace(context=jnp.where(busy, state.groups.context, -1))
        return state.replace(step=state.step + 1, groups=groups, rows=rows, tables=tables,
                             pending=pending, out=out)

    state = _initial_state(model, contexts, n=n, context_slots=context_slots,
                           new_bucket=new_bucket, layout=layout, record_routes=record_routes)
    out = jax.lax.while_loop(keep_going, one_step, state).out
    routes = (out.prompt_routes, out.suffix_routes, out.routes) if record_routes else None
    return out.completions, out.logprobs, out.lengths, out.stopped, routes
