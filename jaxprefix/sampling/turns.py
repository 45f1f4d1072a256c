"""Multi-turn rollouts in the continuous decode: a row leaves for the host at the end of a turn
and comes back with its KV kept.

A row whose turn ends (a stop id, or `max_new_tokens` sampled) before its episode's last turn
goes WAITING: it keeps its pages, its group slot and its promise of pages, and the decode goes
on with the other rows. The loop runs in chunks (`continuous.advance`): a chunk ends after
`chunk_steps` steps, as soon as a row has newly ended a turn, or when nothing can progress
without the host. Between chunks the host hands each ended turn to
`respond` (tools/episodes.py: it parses the calls and runs the tools in its own threads) and
gets a Future of the tokens to append (None: the episode is over). It dispatches the next chunk
at once (JAX dispatch is asynchronous, so the tools run while the device decodes the other
rows) and, at the first chunk after a Future is done, `resume` writes its tokens after the
row's last one. The next step prefills them into the row's own pages, beside its earlier
turns' KV (continuous._append: one forward of up to APPEND_TOKENS tokens a row over its pages,
APPEND_ROWS rows together, every token but the last, which the decode step then feeds to sample
the next turn). So only the new tokens are prefilled, no token of an earlier turn is computed
again, and none is ever re-tokenized.

Rows computed: the rows of a block that are not done only fall in number once every context is
admitted (a waiting row may come back, a queued one start, none is added), so after each chunk
the host sizes the next one's decode step to them (`rows_to_compute`: an eighth, a quarter or
half of the block's rows, else all): the long tail of an episode batch, a few rows on their
sixth turn, no longer pays for the rows that finished on their first.

Why a chunk ends at every turn's end and after `chunk_steps` steps: a row that ends its turn
holds its batch row idle until the chunk ends, and its tool starts only then; a finished tool
waits for the next chunk. A return to the host costs a sync, a few reads and a dispatch (a few
ms; the weights the steps read are laid out once a rollout, `continuous.hoisted_weights`, not
once a chunk), far less than the steps a waiting row would idle: SmolLM2 f32 on 2 cores, 32
episodes of 6 turns in chunks of at most 16 steps, ending a chunk at the first turn's end
instead of a quarter of the rows' took 310 decode steps where 380 had been (the fewest an
episode's own tokens need: 288), 75.5 s where 84.1 had been. While a tool runs, a chunk takes at
most TOOL_WAIT_STEPS steps, so that its answer goes in soon after it is ready: each call's wait
lies on its episode's path, and the longest episode sets how many steps the rollout takes
(the bench's mixed calls, 32 episodes of up to 6 turns: 245 steps where chunks of 16 took
269, 95 sampled tokens/s where 85 had been, the same episodes). `chunk_steps` bounds the
chunks while no tool runs.

A preempted row (admission.preempt) starts again from its episode's first own token,
prefilling everything it had (earlier turns, observations, its current turn so far) in the same
passes before it samples on:
the same episode by construction, no tool run twice, and the tokens of its earlier turns
computed again are counted (`recomputed`: rollout/reprefilled_tokens; 0 with the default
reserve of a whole row, which never preempts).

Sampling streams: every token of episode e (= i*n + j, sample j of context i) is drawn from
(seed, e, its own index), its index among the tokens after the context (sampled and appended):
a function of the episode alone, whatever ran beside it.

Weights that change while the decode runs (`LiveWeights`, the sampler running ahead of the
learner with rollout.inflight_kv): between chunks the host asks for newer weights and, given
some, the next chunk decodes with them. With 'keep' the KV already written stays as the older
weights computed it (PipelineRL's and prime-rl's choice: nothing is computed again); with
'recompute' the new weights compute it again first (the contexts in one prefill, each row in
flight by replaying what it drew, as a preempted row does; counted in
stats['swap_recomputed_tokens']), so every later token is drawn as the new weights alone would
draw it after that prefix. Either way every token keeps the log-prob of the weights that drew
it, so the learner's ratio is exact per token. `TurnRollouts.versions` counts the tokens each
version drew.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxprefix import distributed
from jaxprefix.sampling import continuous, page_pool
from jaxprefix.sampling.continuous_state import (ACTIVE, IDLE, WAITING, Limits, LoopState,
                                                 Outputs, Shape)
from jaxprefix.sampling.layout import Context, SharedContext, bucket
from jaxprefix.sampling.rollouts import Rollouts
from jaxprefix.sampling.sampler import (Program, layout_arrays, mesh_scope, prepare_request,
                                        sampler_args, abstract_request, continuous_shape,
                                        distinct_contexts, laid_out)

# A returning row's appended tokens go into its pages in passes of APPEND_TOKENS tokens a row,
# APPEND_ROWS rows a block together (one forward beside the decode step). A chat template's tool
# turn is short (a calculator's answer: 14 tokens for SmolLM2) and rows whose turns ended
# together come back together; a pass of 64 tokens costs about two decode steps of 32 rows on
# CPU, where the one-row passes of 32 tokens before cost one step each for a single
# observation. Longer observations take several passes.
APPEND_TOKENS = 16
APPEND_ROWS = 4
# While a tool runs, the chunks' steps (at most): an answer goes in when its chunk ends.
TOOL_WAIT_STEPS = 2


@dataclasses.dataclass(frozen=True)
class TurnEnd:
    """A sampled turn of episode `episode` (its `turn`-th), handed to the host: its token ids and
    log-probs, whether it ended on a stop id, and whether the episode is over whatever the host
    says (its last allowed turn, or its token budget spent)."""
    episode: int
    turn: int
    ids: np.ndarray
    logprobs: np.ndarray
    stopped: bool
    final: bool


# respond(turn_end) -> a Future of the token ids to append before the next turn (None: the
# episode ends there); its result is not read for a final turn.
Respond = Callable[[TurnEnd], 'concurrent.futures.Future | None']


# What becomes of the KV already written when newer weights take over (rollout.inflight_kv).
KV_AT_SWAP = ('keep', 'recompute')


class LiveWeights:
    """The weights a decode samples with, and newer ones as they are published: `newer(version)`
    gives (a later version, its policy) or None. `refresh` takes the newest there is. `kv`: one
    of KV_AT_SWAP (see the module docstring)."""

    def __init__(self, version: int, model, newer: Callable[[int], tuple | None],
                 kv: str = 'keep'):
        if kv not in KV_AT_SWAP:
            raise ValueError(f'kv={kv!r}: expected one of {KV_AT_SWAP}')
        self.version, self.model, self._newer, self.kv = version, model, newer, kv

    def refresh(self) -> bool:
        """True when newer weights were taken."""
        got = self._newer(self.version)
        if got is not None:
            self.version, self.model = got
        return got is not None


def tokens_by_version(first: int, swaps: Sequence[tuple[int, np.ndarray]],
                      lengths: np.ndarray) -> dict[int, int]:
    """{weights version: tokens after the contexts written while it decoded}: the decode started
    with `first`; swaps: (version, every episode's length when it took over), in order."""
    counts, version, before = {}, first, np.zeros_like(lengths)
    for new_version, at in swaps:
        counts[version] = counts.get(version, 0) + int((at - before).sum())
        version, before = new_version, at
    counts[version] = counts.get(version, 0) + int((lengths - before).sum())
    return {v: c for v, c in counts.items() if c}


@dataclasses.dataclass(frozen=True)
class TurnRollouts:
    """The episodes as Rollouts (row e = episode e; completion_mask 1 on sampled tokens only,
    so appended tokens carry none), the tokens of earlier turns each computed again
    (`recomputed` [N]) and how the time went (`stats`: chunks, narrow_chunks: those whose steps
    computed part of the rows, steps, wall_s, device_s, idle_s, tools_s: wall time with a tool
    running, idle_while_tools_s: of that, the device idle, weight_swaps,
    swap_recomputed_tokens) and, decoded with
    LiveWeights, the tokens each weights version wrote (`versions`; None otherwise)."""
    rollouts: Rollouts
    recomputed: np.ndarray
    stats: dict
    versions: dict[int, int] | None = None


@functools.partial(jax.jit, static_argnames=('shape',), donate_argnames=('state',))
def resume(state: LoopState, contexts: dict, episodes, tokens, lengths, *,
           shape: Shape) -> LoopState:
    """The host's answers: waiting episode episodes[a] (past the end: no one) goes on with
    tokens[a, :lengths[a]] after its last token, or ends (lengths[a] < 0)."""
    out, rows = state.out, state.rows
    num, width = out.completions.shape
    given = episodes < num
    goes_on = given & (lengths >= 0)
    columns = out.lengths[jnp.minimum(episodes, num - 1)][:, None] + jnp.arange(tokens.shape[1])
    columns = jnp.where(goes_on[:, None] & (jnp.arange(tokens.shape[1]) < lengths[:, None]),
                        columns, width)  # past the end: dropped
    appended = jnp.full(num, -1, jnp.int32).at[episodes].set(
        jnp.where(goes_on, lengths, -1), mode='drop')
    over = jnp.zeros(num, bool).at[episodes].set(given & (lengths < 0), mode='drop')
    _, episode = continuous.episodes_of_rows(state, contexts, shape)
    waiting = rows.state == WAITING
    more, ends = waiting & (appended[episode] >= 0), waiting & over[episode]
    after = rows.t + appended[episode]  # the next turn's first own index
    rows = rows.replace(state=jnp.where(more, ACTIVE, jnp.where(ends, IDLE, rows.state)),
                        known=jnp.where(more, after, rows.known), turn=rows.turn + more,
                        turn_start=jnp.where(more, after, rows.turn_start))
    out = out.replace(
        completions=out.completions.at[episodes[:, None], columns].set(tokens, mode='drop'),
        lengths=out.lengths.at[episodes].add(jnp.where(goes_on, lengths, 0), mode='drop'),
        waiting=out.waiting.at[episodes].set(False, mode='drop'))
    state = state.replace(rows=rows, out=out, tables=page_pool.release(state.tables,
                                                                                   ends))
    return continuous.free_groups(state, shape.n)


@functools.partial(jax.jit, static_argnames=('shape',))
def episode_progress(state: LoopState, contexts: dict, *, shape: Shape):
    """What the host reads after a chunk: per episode whether it waits and its length; whether
    any episode is unfinished, whether the device can go on without the host, and the most
    rows a block can have in flight from now on (every row while contexts wait to be
    admitted; else its rows not done: a waiting row may come back, a queued one start)."""
    blocks = contexts['valid'].reshape(shape.layout.blocks, -1).sum(axis=1)
    admitting = jnp.any(state.next_context < blocks)
    alive = jnp.any(state.rows.state != IDLE) | admitting
    busy = jnp.where(admitting, state.rows.state.shape[1],
                     jnp.max(jnp.sum(state.rows.state != IDLE, axis=1)))
    return (state.out.waiting, state.out.lengths, alive,
            continuous.can_progress(contexts, state, shape), busy)


def rows_to_compute(busy: int, rows: int) -> int:
    """Shape.rows_computed for a chunk in which at most `busy` of a block's `rows` can be in
    flight: the smallest of rows / 8, / 4, / 2 (rounded up) that holds them, else 0 (every
    row). Four sizes at most: each is a compile of the chunk's program."""
    for halvings in (3, 2, 1):
        size = -(-rows // 2 ** halvings)
        if busy <= size:
            return size
    return 0


@jax.jit
def _rows_of(out: Outputs, episodes):
    return out.completions[episodes], out.logprobs[episodes]


def _answers(answers: dict[int, list[int] | None], num: int):
    """resume's arrays for {episode: tokens or None}, padded to powers of two (few compiles)."""
    size = bucket(max(len(answers), 1))
    width = bucket(max([len(a) for a in answers.values() if a is not None] + [1]), 16)
    episodes = np.full(size, num, np.int32)
    tokens = np.zeros((size, width), np.int32)
    lengths = np.full(size, -1, np.int32)
    for a, (episode, ids) in enumerate(sorted(answers.items())):
        episodes[a] = episode
        if ids is not None:
            tokens[a, :len(ids)], lengths[a] = ids, len(ids)
    return episodes, tokens, lengths


def _length(context: Context) -> int:
    if isinstance(context, SharedContext):
        return len(context.prompt) + len(context.suffix)
    return len(context)


class _Host:
    """The host's side of the episodes: where each one's current turn starts (own index), its
    turn, the spans of own tokens it appended, the answers due and those it ended."""

    def __init__(self, num: int, respond: Respond, stops: set):
        self.respond, self.stops = respond, stops
        self.turn_start = np.zeros(num, np.int64)
        self.turn = np.zeros(num, np.int64)
        self.appended: list[list[tuple[int, int]]] = [[] for _ in range(num)]
        self.pending: dict[int, concurrent.futures.Future] = {}
        self.ended: set[int] = set()

    def hand_over(self, out: Outputs, waiting, lengths) -> None:
        """Every episode newly waiting: its turn to `respond`."""
        fresh = [e for e in np.flatnonzero(waiting[:len(self.turn)]) if e not in self.pending]
        if not fresh:
            return
        index = np.zeros(bucket(len(fresh)), np.int32)
        index[:len(fresh)] = fresh
        ids, logprobs = jax.device_get(_rows_of(out, index))
        for k, e in enumerate(fresh):
            span = slice(self.turn_start[e], lengths[e])
            self.pending[e] = self.respond(TurnEnd(
                int(e), int(self.turn[e]), ids[k, span], logprobs[k, span],
                int(ids[k, lengths[e] - 1]) in self.stops, final=False))

    def answers(self, done: set, lengths) -> dict[int, list[int] | None]:
        """{episode: the tokens to append or None} of the answers done."""
        answers = {}
        for e in done:
            ids = self.pending.pop(e).result()
            answers[e] = None if ids is None else [int(i) for i in ids]
            if ids is None:
                self.ended.add(e)
            else:
                self.appended[e].append((int(lengths[e]), int(lengths[e]) + len(ids)))
                self.turn_start[e] = lengths[e] + len(ids)
                self.turn[e] += 1
        return answers

    def final_turns(self, completions, logprobs, lengths, stopped) -> None:
        """The turns the device ended an episode on (its last allowed one, or its budget)."""
        for e in range(len(self.turn)):
            if e not in self.ended and lengths[e] > self.turn_start[e]:
                span = slice(self.turn_start[e], lengths[e])
                self.respond(TurnEnd(e, int(self.turn[e]), completions[e, span],
                                     logprobs[e, span], bool(stopped[e]), final=True))

    def unmask_appended(self, rollouts: Rollouts) -> None:
        """No loss on what the host appended: completion_mask 0 there."""
        for e, spans in enumerate(self.appended):
            offset = rollouts.context_lengths[e]
            for start, stop in spans:
                rollouts.completion_mask[e, offset + start:offset + stop] = 0


def sample_turns(model, contexts: Sequence[Context], *, n: int, max_new_tokens: int,
                 max_turns: int, episode_token_budget: int, respond: Respond,
                 stop_ids: Sequence[int] = (), seed: int = 0, chunk_steps: int = 32,
                 weights: LiveWeights | None = None, **sampler) -> TurnRollouts:
    """n episodes of each context (episode i*n + j continues contexts[i]) of up to `max_turns`
    sampled turns of up to `max_new_tokens` tokens each, `episode_token_budget` tokens in all
    (context included), the host's answers between turns (see the module docstring). `sampler`:
    generate()'s other keywords (temperature, top_p, top_k, the memory keywords, record_routes);
    every row decodes over KV pages (the continuous decode), up to max_rows_in_flight of them at
    once (None: every row), waiting rows included. With record_routes (a MoE), rollouts.routes
    holds each token's experts as the forward that wrote its KV computed them: the context's
    prefill, the appending pass of an observation, the decode step of a sampled token; no
    earlier turn is computed again, so these are the experts every later token attended
    through (routes.py). `weights` (then `model` is weights.model): between chunks the decode
    goes on with the newest weights it gives (see the module docstring)."""
    if chunk_steps < 1:
        raise ValueError(f'chunk_steps={chunk_steps}: expected >= 1')
    if weights is not None and weights.kv == 'recompute' and max_turns > 1:
        # A row waiting for its tool's answer keeps its pages; it would attend to both versions.
        raise ValueError("weights with kv='recompute' take one turn a row (max_turns=1)")
    req, shape, limits = _turn_request(model, contexts, n=n, max_new_tokens=max_new_tokens,
                                       max_turns=max_turns,
                                       episode_token_budget=episode_token_budget,
                                       stop_ids=stop_ids, seed=seed, **sampler)
    if req.reshard is not None:
        req = dataclasses.replace(req, params=req.reshard())
    num = req.layout.num_contexts * n
    host = _Host(num, respond, set(int(s) for s in stop_ids))
    arrays = layout_arrays(req.layout, True)
    settings, seed_key, stops = sampler_args(req)[:3]
    stats = dict(chunks=0, narrow_chunks=0, device_s=0.0, tools_s=0.0, idle_while_tools_s=0.0,
                 swap_recomputed_tokens=0)
    begin = time.perf_counter()
    rows, busy = shape.context_slots * n, None
    first, swaps = None if weights is None else weights.version, []
    lengths = np.zeros(num, np.int32)
    hoisted = lambda req: continuous.hoisted_weights(req.graphdef, req.params,
                                                     layout=shape.layout)
    with mesh_scope(req.mesh):
        state, answers = continuous.start(req.graphdef, req.params, arrays, shape=shape), {}
        layer_weights = hoisted(req)
        while True:
            dispatched = time.perf_counter()
            if weights is not None and weights.refresh():
                req = _with_weights(req, weights.model)
                layer_weights = hoisted(req)
                swaps.append((weights.version, np.asarray(lengths[:num]).copy()))
                if weights.kv == 'recompute':
                    state, recomputed = continuous.recompute(req.graphdef, req.params, arrays,
                                                             state)
                    stats['swap_recomputed_tokens'] += int(recomputed)
            if answers:
                state = resume(state, arrays, *_answers(answers, state.out.lengths.shape[0]),
                               shape=shape)
            computed = 0 if busy is None else rows_to_compute(int(busy), rows)
            steps = min(chunk_steps, TOOL_WAIT_STEPS) if host.pending else chunk_steps
            state = continuous.advance(req.graphdef, req.params, arrays, settings, seed_key,
                                       stops, limits, layer_weights, state, np.int32(steps),
                                       np.int32(1),
                                       shape=dataclasses.replace(shape, rows_computed=computed))
            waiting, lengths, alive, can_go, busy = jax.device_get(
                episode_progress(state, arrays, shape=shape))
            chunk = time.perf_counter() - dispatched
            stats['chunks'] += 1
            stats['narrow_chunks'] += computed > 0
            stats['device_s'] += chunk
            stats['tools_s'] += chunk if host.pending else 0.0  # tools ran through it
            host.hand_over(state.out, waiting, lengths)
            done = {e for e, future in host.pending.items() if future.done()}
            if not done and host.pending and not can_go:  # nothing to do but wait
                idle_from = time.perf_counter()
                finished, _ = concurrent.futures.wait(
                    host.pending.values(), return_when=concurrent.futures.FIRST_COMPLETED)
                done = {e for e, future in host.pending.items() if future in finished}
                waited = time.perf_counter() - idle_from
                stats['tools_s'] += waited
                stats['idle_while_tools_s'] += waited
            answers = host.answers(done, lengths)
            if not (alive or host.pending or answers):
                break
            if not (can_go or host.pending or answers):
                raise RuntimeError('sample_turns: rows wait for the host with no answer due')
        out = state.out
        recorded = (out.prompt_routes, out.suffix_routes, out.routes) if shape.record_routes \
            else None
        completions, logprobs, lengths, stopped, recomputed, recorded = distributed.to_host(
            (out.completions, out.logprobs, out.lengths, out.stopped, out.recomputed, recorded))
    stats['steps'] = int(jax.device_get(state.step))
    stats['wall_s'] = time.perf_counter() - begin
    stats['idle_s'] = stats['wall_s'] - stats['device_s']
    host.final_turns(completions, logprobs, lengths, stopped)
    rollouts = laid_out(req, completions, logprobs, lengths, stopped, recorded)
    host.unmask_appended(rollouts)
    stats['weight_swaps'] = len(swaps)
    versions = None if weights is None else tokens_by_version(first, swaps, lengths[:num])
    return TurnRollouts(rollouts, recomputed[:num], stats, versions)


def _turn_request(model, contexts: Sequence[Context], *, n: int, max_new_tokens: int,
                  max_turns: int, episode_token_budget: int, stop_ids: Sequence[int], seed: int,
                  **sampler) -> tuple:
    """(generate()'s request over KV pages, the chunk program's Shape, its Limits): what
    sample_turns decodes with, decided on the host."""
    if max_turns < 1:
        raise ValueError(f'max_turns={max_turns}: expected >= 1')
    room = episode_token_budget - min(map(_length, contexts))
    if room < 1:
        raise ValueError(f'episode_token_budget={episode_token_budget}: expected more than the '
                         f'shortest context ({episode_token_budget - room} tokens)')
    req = prepare_request(model, contexts, n=n, max_new_tokens=room, stop_ids=stop_ids, seed=seed,
                   paged=True, **sampler)
    shape = dataclasses.replace(continuous_shape(req), append_tokens=APPEND_TOKENS,
                                append_rows=APPEND_ROWS)
    limits = Limits(jnp.int32(max_new_tokens), jnp.int32(max_turns),
                    jnp.int32(episode_token_budget))
    return req, shape, limits


def abstract_turn_programs(model, *, num_contexts: int, context_length: int, n: int,
                           max_new_tokens: int, max_turns: int, episode_token_budget: int,
                           num_stop_ids: int = 1, chunk_steps: int = 32,
                           **sampler) -> dict[str, Program]:
    """The programs sample_turns runs for a request of this shape, with abstract arguments
    (sampler.abstract_programs' counterpart for episodes; `model` may be abstract): {'turns':
    a chunk at every row (continuous.advance)}, after {'reshard': ...} when the decode lays
    the weights out first. Under the mesh, `lower().compile()` compiles exactly what
    sample_turns would run (memory_analysis() then reads its footprint)."""
    contexts = distinct_contexts(num_contexts, context_length, model.config.vocab_size)
    req, shape, limits = _turn_request(model, contexts, n=n, max_new_tokens=max_new_tokens,
                                       max_turns=max_turns,
                                       episode_token_budget=episode_token_budget,
                                       stop_ids=range(num_stop_ids), seed=0, **sampler)
    programs, req = abstract_request(req)
    arrays = layout_arrays(req.layout, True)
    with mesh_scope(req.mesh):
        start = continuous.start.lower(req.graphdef, req.params, arrays, shape=shape)
        state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                             start.out_info, start.compile().output_shardings)
        layer_weights = continuous.hoisted_weights.eval_shape(req.graphdef, req.params,
                                                              layout=shape.layout)
    settings, seed_key, stops = sampler_args(req)[:3]
    return programs | {'turns': Program(
        continuous.advance, (req.graphdef, req.params, arrays, settings, seed_key, stops, limits,
                             layer_weights, state, np.int32(chunk_steps), np.int32(1)),
        dict(shape=shape))}


def _with_weights(req, model):
    """The request decoding with `model`'s weights, laid out as the first ones were."""
    graphdef, params = nnx.split(model)
    if req.reshard is not None:
        params = req.reshard.fn(params)
    return dataclasses.replace(req, graphdef=graphdef, params=params)


def _no_answer(turn_end: TurnEnd):
    """One turn an episode: nothing is ever appended."""
    return None


def sample_live(weights: LiveWeights, contexts: Sequence[Context], *, n: int,
                max_new_tokens: int, stop_ids: Sequence[int] = (), seed: int = 0,
                chunk_steps: int = 32, **sampler) -> TurnRollouts:
    """generate() with weights that may change between chunks (one turn a row): the same
    rollouts as generate's for the same seed while no newer weights come (the same streams),
    and `versions` says which weights wrote how many tokens."""
    longest = max(map(_length, contexts))
    return sample_turns(weights.model, contexts, n=n, max_new_tokens=max_new_tokens, max_turns=1,
                        episode_token_budget=longest + max_new_tokens + 1, respond=_no_answer,
                        stop_ids=stop_ids, seed=seed, chunk_steps=chunk_steps, weights=weights,
                        **sampler)
