"""Continuous batching: a fixed number of row slots and context slots, refilled inside the loop.

The static decode (sampler.py) holds every row of a request until the longest has stopped, with a
cache of the full new-token bucket for each. Here one jitted lax.while_loop holds, per device
block (see below), s row slots and K context slots:
  - a context slot holds one context's KV (prompt and suffix segments, read only). When slots
    are free and contexts wait, F contexts are prefilled into them inside the loop (lax.cond):
    contexts are admitted in waves without a return to Python;
  - a row slot holds one sample (context i, sample j) and a cache of its own new tokens. When its
    row stops (stop id or max_new_tokens) the next queued sample of a resident context takes the
    slot at the next step;
  - a context slot is freed when all n samples of its context have stopped.
So the KV memory is s x T + K x (context length) per block, whatever the number of contexts and
samples (budget.py chooses s, K and F); only the outputs ([C * n, T] tokens and log-probs, 8
bytes a token) grow with the request.

Results do not depend on the schedule: sample j of context i draws from (seed, i*n + j, t), t its
own token index, and its t-th token's KV goes to column t of its slot's cache, so it attends to
the same keys in the same order as in the static decode.

Sharding: contexts and rows are split over the D devices of ('data', 'fsdp') in D contiguous
blocks (block d holds contexts d*C/D .. (d+1)*C/D - 1 and their rows), and every scheduling array
carries a leading [D] axis: each block admits its own contexts into its own slots, so a row reads
its context's KV on its own device (attention.take_groups). A block whose contexts run long keeps
the loop going while the others idle: the price of not moving KV between devices.
"""
from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from jaxprefix.models.attention import KVCache, KVSegment
from jaxprefix.models.sharding import constrain
from jaxprefix.sampling.prefill import TRACE_COUNTS, context_kv
from jaxprefix.sampling.token_choice import SamplingSettings, choose_tokens, row_step_keys

@flax.struct.dataclass
class RowSlots:
    """[D, s] each. A slot is idle when context_slot is -1."""
    context_slot: jax.Array  # int32: the context slot its row continues
    sample: jax.Array        # int32: j, the row's sample index within its context
    t: jax.Array             # int32: tokens the row has drawn so far (its cache write column)
    token: jax.Array         # int32: the token fed at the next step
    position: jax.Array      # int32: its position


@flax.struct.dataclass
class ContextSlots:
    """[D, K] each. A slot is free when context is -1."""
    context: jax.Array        # int32: index of the context within its block
    admitted: jax.Array       # int32: its samples given a row slot so far (0 .. n)
    finished: jax.Array       # int32: its samples stopped
    last_token: jax.Array     # int32: the held-back last context token, every sample's first input
    last_position: jax.Array  # int32


@flax.struct.dataclass
class Outputs:
    """[D * R, T] and [D * R], R = contexts per block x n: row (d * C/D + m) * n + j is sample j
    of block d's context m, i.e. rows in request order."""
    completions: jax.Array  # int32
    logprobs: jax.Array     # f32
    lengths: jax.Array      # int32
    stopped: jax.Array      # bool


@flax.struct.dataclass
class LoopState:
    rows: RowSlots
    contexts: ContextSlots
    next_context: jax.Array     # int32 [D]: the block's next context to admit
    store: tuple                # KVSegments [layers, D*K, S, ...]: the resident contexts' KV
    cache: KVCache              # [layers, D*s, T, ...], index [D*s] = rows.t
    out: Outputs


def _blocks(x: jax.Array, d: int) -> jax.Array:
    return x.reshape(d, x.shape[0] // d, *x.shape[1:])


def _per_block(fn, *args):
    """fn applied to each block's slice of args (all with a leading [D] axis)."""
    return jax.vmap(fn)(*args)


def _constrain_blocks(tree):
    """Every [D, ...] scheduling array split over the row devices."""
    return jax.tree.map(lambda x: constrain(x, ('batch',) + (None,) * (x.ndim - 1)), tree)


def _write_slots(stored: KVSegment, new: KVSegment, target: jax.Array) -> KVSegment:
    """stored [L, D*K, S, ...] with new [L, D*F, S, ...] written at slots target [D, F] of each
    block (target K drops the write)."""
    d = target.shape[0]

    def kv(old, fresh):
        old_b, fresh_b = _blocks(old.swapaxes(0, 1), d), _blocks(fresh.swapaxes(0, 1), d)
        put = _per_block(lambda o, f, at: o.at[at].set(f, mode='drop'), old_b, fresh_b, target)
        return put.reshape(old.swapaxes(0, 1).shape).swapaxes(0, 1)

    pos = _per_block(lambda o, f, at: o.at[at].set(f, mode='drop'), _blocks(stored.pos, d),
                     _blocks(new.pos, d), target).reshape(stored.pos.shape)
    return KVSegment(k=kv(stored.k, new.k), v=kv(stored.v, new.v), pos=pos)


def _admit(model, contexts: dict, state: LoopState, *, admit: int) -> LoopState:
    """Prefills each block's next `admit` contexts into its first free context slots."""
    slots = state.contexts
    d, k = slots.context.shape
    num_valid = _blocks(contexts['valid'], d).sum(axis=1)
    free = slots.context < 0
    rank = jnp.cumsum(free, axis=1) - 1
    # target[f]: the block's f-th free slot (k when there are fewer).
    target = _per_block(lambda fr, rk: jnp.full(admit, k, jnp.int32).at[jnp.where(fr, rk, admit)]
                        .set(jnp.arange(k, dtype=jnp.int32), mode='drop'), free, rank)
    local = state.next_context[:, None] + jnp.arange(admit, dtype=jnp.int32)
    ok = (local < num_valid[:, None]) & (target < k)
    target = jnp.where(ok, target, k)

    def pick(name, empty=None):  # [D*F, ...] rows of the admitted contexts
        table = _blocks(contexts[name], d)
        picked = _per_block(lambda block, at: block[at], table,
                            jnp.minimum(local, table.shape[1] - 1))
        if empty is not None:
            picked = jnp.where(ok.reshape(ok.shape + (1,) * (picked.ndim - 2)), picked, empty)
        return picked.reshape(d * admit, *picked.shape[2:])

    segments = (context_kv(model, pick('prompt_tokens'), pick('prompt_positions', -1)),)
    if contexts['suffix_tokens'].shape[1]:
        segments += (context_kv(model, pick('suffix_tokens'), pick('suffix_positions', -1),
                                segments),)
    store = tuple(_write_slots(s, new, target) for s, new in zip(state.store, segments))

    def put(table, values):
        return _per_block(lambda t, at, v: t.at[at].set(v, mode='drop'), table, target,
                          values.reshape(d, admit))
    zeros = jnp.zeros((d, admit), jnp.int32)
    slots = ContextSlots(context=put(slots.context, local), admitted=put(slots.admitted, zeros),
                         finished=put(slots.finished, zeros),
                         last_token=put(slots.last_token, pick('last_tokens')),
                         last_position=put(slots.last_position, pick('last_positions')))
    return state.replace(contexts=slots, store=store,
                         next_context=state.next_context + ok.sum(axis=1, dtype=jnp.int32))


def _waiting(slots: ContextSlots, n: int) -> jax.Array:
    """[D, K] samples of each resident context not yet given a row slot."""
    return jnp.where(slots.context >= 0, n - slots.admitted, 0)


def _wants_contexts(contexts: dict, state: LoopState, *, n: int, admit: int) -> jax.Array:
    """Whether some block should admit contexts now: it has contexts left and either room for a
    full batch of them, or free room and no queued sample (its idle row slots would wait)."""
    slots = state.contexts
    pending = _blocks(contexts['valid'], slots.context.shape[0]).sum(1) - state.next_context
    free = (slots.context < 0).sum(axis=1)
    starving = (free > 0) & (_waiting(slots, n).sum(axis=1) == 0)
    return jnp.any((pending > 0) & ((free >= jnp.minimum(admit, pending)) | starving))


def _count_per_slot(slot: jax.Array, counted: jax.Array, num_slots: int) -> jax.Array:
    """[K] how many rows with `counted` set point at each context slot (a one-hot sum: XLA's CPU
    scatters are slow when vmapped over blocks)."""
    hits = (slot[:, None] == jnp.arange(num_slots)) & counted[:, None]
    return hits.sum(axis=0, dtype=jnp.int32)


def _fill_rows(rows: RowSlots, slots: ContextSlots, n: int):
    """One block: each idle row slot takes the next queued sample (resident contexts in slot
    order, samples in order). Returns (rows, slots, which slots took a new row)."""
    idle = rows.context_slot < 0
    rank = jnp.cumsum(idle) - 1
    waiting = _waiting(slots, n)
    ends = jnp.cumsum(waiting)
    source = jnp.minimum(jnp.searchsorted(ends, rank, side='right'), waiting.shape[0] - 1)
    take = idle & (rank < ends[-1])
    sample = slots.admitted[source] + rank - (ends[source] - waiting[source])
    new = lambda fresh, old: jnp.where(take, fresh, old)
    rows = RowSlots(context_slot=new(source, rows.context_slot), sample=new(sample, rows.sample),
                    t=new(0, rows.t), token=new(slots.last_token[source], rows.token),
                    position=new(slots.last_position[source], rows.position))
    admitted = slots.admitted + _count_per_slot(source, take, waiting.shape[0])
    return rows, slots.replace(admitted=admitted), take


def _finish_rows(slots: ContextSlots, rows: RowSlots, finished: jax.Array, n: int) -> ContextSlots:
    """One block: counts stopped samples per context and frees contexts whose n samples stopped."""
    counts = slots.finished + _count_per_slot(rows.context_slot, finished,
                                              slots.finished.shape[0])
    freed = (slots.context >= 0) & (counts == n)
    return slots.replace(context=jnp.where(freed, -1, slots.context),
                         admitted=jnp.where(freed, 0, slots.admitted),
                         finished=jnp.where(freed, 0, counts))


def _initial_state(model, contexts: dict, *, n, shards, row_slots, context_slots,
                   new_bucket) -> LoopState:
    d, s, k = shards, row_slots, context_slots
    per_block = contexts['valid'].shape[0] // d
    config = model.config
    store = []
    for name in ('prompt', 'suffix'):
        length = contexts[f'{name}_tokens'].shape[1]
        if length:
            empty = KVCache.empty(config, d * k, length)
            store.append(KVSegment(k=empty.k, v=empty.v, pos=empty.pos))
    cache = KVCache.empty(config, d * s, new_bucket)
    cache = cache.replace(index=jnp.zeros(d * s, jnp.int32))
    ints = lambda shape, fill=0: jnp.full(shape, fill, jnp.int32)
    rows = RowSlots(context_slot=ints((d, s), -1), sample=ints((d, s)), t=ints((d, s)),
                    token=ints((d, s)), position=ints((d, s)))
    slots = ContextSlots(context=ints((d, k), -1), admitted=ints((d, k)), finished=ints((d, k)),
                         last_token=ints((d, k)), last_position=ints((d, k)))
    rows_total = d * per_block * n
    out = Outputs(completions=ints((rows_total, new_bucket)),
                  logprobs=jnp.zeros((rows_total, new_bucket), jnp.float32),
                  lengths=ints((rows_total,)), stopped=jnp.zeros(rows_total, bool))
    return LoopState(rows=_constrain_blocks(rows), contexts=_constrain_blocks(slots),
                     next_context=ints((d,)), store=tuple(store), cache=cache,
                     out=_constrain_blocks(out))


@functools.partial(jax.jit, static_argnames=('graphdef', 'n', 'shards', 'row_slots',
                                             'context_slots', 'admit', 'new_bucket',
                                             'hoist_layers'))
def sample_continuous(graphdef, params, contexts: dict, settings: SamplingSettings, seed_key,
                      stop_ids, max_new_tokens, *, n: int, shards: int, row_slots: int,
                      context_slots: int, admit: int, new_bucket: int, hoist_layers: bool = False):
    """Samples n continuations of each context of `contexts` (layout arrays, one row per context)
    with row_slots x shards rows in flight; hoist_layers as in static.decode.

    Returns (completions [C*n, T], logprobs [C*n, T], lengths [C*n], stopped [C*n]) in row order.
    """
    TRACE_COUNTS['continuous'] += 1
    model = nnx.merge(graphdef, params)
    layer_weights = model.layer_weights() if hoist_layers else None
    d = shards
    num_contexts = contexts['valid'].shape[0]
    block_start = jnp.arange(d, dtype=jnp.int32)[:, None] * (num_contexts // d)
    num_valid = _blocks(contexts['valid'], d).sum(axis=1)

    def keep_going(state: LoopState):
        queued = _waiting(state.contexts, n).sum() > 0
        return (jnp.any(state.rows.context_slot >= 0) | queued |
                jnp.any(state.next_context < num_valid))

    def one_step(state: LoopState) -> LoopState:
        state = jax.lax.cond(_wants_contexts(contexts, state, n=n, admit=admit),
                             functools.partial(_admit, model, contexts, admit=admit),
                             lambda s: s, state)
        rows, slots, fresh = _per_block(functools.partial(_fill_rows, n=n), state.rows,
                                        state.contexts)
        # A slot's new row must not see the keys its previous row left in the cache.
        cache = state.cache.replace(pos=jnp.where(fresh.reshape(-1, 1), -1, state.cache.pos),
                                    index=rows.t.reshape(-1))
        active = rows.context_slot >= 0
        reading = jnp.maximum(rows.context_slot, 0)
        logits, cache = model.extend(rows.token.reshape(-1, 1), rows.position.reshape(-1, 1),
                                     context=state.store, cache=cache, context_rows=reading,
                                     layer_weights=layer_weights)
        context = jnp.take_along_axis(slots.context, reading, axis=1)  # within the block
        row_ids = (block_start + context) * n + rows.sample
        keys = row_step_keys(seed_key, row_ids.reshape(-1), rows.t.reshape(-1))
        tokens, logprobs = choose_tokens(logits[:, -1], keys, settings)
        tokens, logprobs = tokens.reshape(rows.t.shape), logprobs.reshape(rows.t.shape)
        hit_stop = active & jnp.any(tokens[..., None] == stop_ids, axis=-1)
        t = rows.t + 1
        finished = active & (hit_stop | (t >= max_new_tokens))

        out = state.out
        at = jnp.where(active, row_ids, out.lengths.shape[0])  # past the end: dropped
        out = Outputs(completions=out.completions.at[at, rows.t].set(tokens, mode='drop'),
                      logprobs=out.logprobs.at[at, rows.t].set(logprobs, mode='drop'),
                      lengths=out.lengths.at[at].set(t, mode='drop'),
                      stopped=out.stopped.at[at].set(hit_stop, mode='drop'))
        slots = _per_block(functools.partial(_finish_rows, n=n), slots, rows, finished)
        rows = rows.replace(context_slot=jnp.where(finished, -1, rows.context_slot),
                            t=jnp.where(finished, 0, t), token=tokens,
                            position=rows.position + 1)
        return LoopState(rows=rows, contexts=slots, next_context=state.next_context,
                         store=state.store, cache=cache, out=out)

    state = _initial_state(model, contexts, n=n, shards=d, row_slots=row_slots,
                           context_slots=context_slots, new_bucket=new_bucket)
    out = jax.lax.while_loop(keep_going, one_step, state).out
    return out.completions, out.logprobs, out.lengths, out.stopped
