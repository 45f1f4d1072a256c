"""Multi-turn episodes on the host: the policy's turns, its tool calls, their observations.

An `Episode` is one token sequence, exactly the ids that were sampled and appended (token-in,
token-out: text is decoded only to parse calls, never re-encoded into the sequence):

    tokens   [prompt ....][turn 1 sampled .....][observation ...][turn 2 sampled ...]
    sampled   0 0 0 0 0 0  1 1 1 1 1 1 1 1 1 1  0 0 0 0 0 0 0 0  1 1 1 1 1 1 1 1 1
    logprobs  0 ...        the sampler's log-prob of each sampled token, 0 elsewhere

`rollout_episodes` has two rollouts that give the same episodes. The REFERENCE (kv_kept=False)
calls `sampling.generate` once per turn on each unfinished conversation so far, so every turn
RE-PREFILLS the whole conversation (prompt, earlier turns, observations); it is the arm the
in-graph rollout is tested against and the baseline of the bench. The in-graph one
(kv_kept=True, sampling.sample_turns) keeps every turn's KV in the continuous decode: a row
leaves the loop for its tools, which run in threads while the device decodes the other rows,
and comes back with only the observation's tokens prefilled. Both take turns by the same rules
(`_Rules`: where a turn is cut, when the episode ends, what is appended).

Sampling streams: every sampled token of episode e = i*n + j draws from (seed, e, k), k its
index among the episode's tokens after the prompt (sampled or appended). The in-graph decode
draws own token k of row e so; the reference's turn 0 is generate's own stream and its turn
t > 0 passes generate streams=[(e, k0)] for each running conversation (k0 its tokens so far).

Routing replay (a MoE, `record_routes` among the sampler keywords): an episode also carries
each token's experts (`routes`), for the learner to replay over its one sequence: those of the
forward that first computed the token's KV (the prompt's and an observation's prefill, a
sampled token's decode step), -1 on its last token (never fed). The KV-kept rollout computes
each token once, so that is exactly what every later token attended through. The reference
computes earlier turns again at every turn; see `_reprefilled` for why it keeps the first.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import time
from typing import Callable, Sequence

import numpy as np

from jaxprefix.sampling import Rollouts, TurnEnd, generate, sample_turns, token_ids
from jaxprefix.tools.api import DEFAULT_MAX_CHARS, Registry, ToolResult, error
from jaxprefix.tools.calls import ToolCall, format_for, parser
from jaxprefix.tools.observations import observation_tokens
from jaxprefix.tools.sandbox import KILLS, REFUSALS

# Why an episode ended.
ANSWER = "answer"        # a turn ended on a stop token without a tool call
MAX_TURNS = "max_turns"  # its last allowed turn still called a tool (that call is not run)
BUDGET = "budget"        # the episode's token budget ran out (mid-turn, or no room to go on)
TRUNCATED = "truncated"  # a turn hit the sampler's max_new_tokens without a stop or a call


@dataclasses.dataclass(frozen=True)
class Episode:
    """One conversation of the policy with its tools.

      tokens       int32 [T]  prompt, sampled turns and appended observations, in order
      sampled      int32 [T]  1 on tokens the policy sampled, 0 on prompt and observations
      logprobs     f32 [T]    the sampler's log-prob of each sampled token (0 elsewhere)
      turn_starts  where each sampled turn starts in `tokens`
      group        index of the context (problem) the episode continues
      reprefilled  tokens of earlier turns the rollout prefilled again (the reference
                   rollout's cost, `reprefilled_tokens`: 0 where turns keep their KV, but
                   a preempted row's replay)
      routes       int8 or int16 [T, sparse layers, k], or None: with record_routes (a MoE),
                   each token's experts as the sampler computed them (module docstring), -1
                   on the last token
      stopped      what a sandbox refused or a cap ended, one per such tool call
                   (tools/sandbox.py REFUSALS, KILLS: rollout/sandbox_refusals, _kills)
    """
    tokens: np.ndarray
    sampled: np.ndarray
    logprobs: np.ndarray
    prompt_length: int
    turn_starts: tuple[int, ...]
    tool_calls: int
    tool_failures: int
    ended: str
    group: int
    reprefilled: int = 0
    routes: np.ndarray | None = None
    stopped: tuple[str, ...] = ()

    @property
    def turns(self) -> int:
        return len(self.turn_starts)

    @property
    def observation_mask(self) -> np.ndarray:
        """int32 [T]: 1 on appended observation tokens (not prompt, not sampled)."""
        mask = np.ones_like(self.sampled)
        mask[:self.prompt_length] = 0
        return mask * (1 - self.sampled)

    def sampled_texts(self, tokenizer) -> list[str]:
        """Each turn's sampled text (for the verifier and for reading)."""
        bounds = list(self.turn_starts) + [len(self.tokens)]
        return [tokenizer.decode(self.tokens[s:e][self.sampled[s:e] == 1].tolist())
                for s, e in zip(bounds[:-1], bounds[1:])]


@dataclasses.dataclass
class _Running:
    """An episode being built: lists that grow a turn at a time."""
    group: int
    tokens: list[int]
    sampled: list[int]
    logprobs: list[float]
    prompt_length: int
    turn_starts: list[int] = dataclasses.field(default_factory=list)
    tool_calls: int = 0
    tool_failures: int = 0
    ended: str | None = None
    reprefilled: int = 0
    observed: int = 0  # the newest observation's tokens (the reference's bookkeeping)
    routes: list[np.ndarray] = dataclasses.field(default_factory=list)  # record_routes: spans
    stopped: list[str] = dataclasses.field(default_factory=list)

    @property
    def turns(self) -> int:
        return len(self.turn_starts)

    def append(self, ids, logprobs=None):
        self.tokens.extend(int(i) for i in ids)
        self.sampled.extend([1 if logprobs is not None else 0] * len(ids))
        self.logprobs.extend([0.0] * len(ids) if logprobs is None else map(float, logprobs))

    def route(self, recorded: np.ndarray) -> None:
        """Takes the experts of its tokens that have none yet but the last (never fed) from
        `recorded` [>= len(tokens) - 1, ...]: a rollout row whose positions are its tokens'."""
        routed = sum(len(r) for r in self.routes)
        self.routes.append(np.asarray(recorded[routed:len(self.tokens) - 1]))

    def freeze(self) -> Episode:
        routes = None
        if self.routes:
            got = np.concatenate(self.routes)
            routes = np.full((len(self.tokens), *got.shape[1:]), -1, got.dtype)
            routes[:len(got)] = got
        return Episode(np.array(self.tokens, np.int32), np.array(self.sampled, np.int32),
                       np.array(self.logprobs, np.float32), self.prompt_length,
                       tuple(self.turn_starts), self.tool_calls, self.tool_failures,
                       self.ended, self.group, self.reprefilled, routes, tuple(self.stopped))


def run_calls(calls: Sequence[ToolCall], tools: Registry, max_chars: int = DEFAULT_MAX_CHARS,
              workers: int = 1) -> list[ToolResult]:
    """The observation of each call, in order; a malformed call is answered with its parse
    error. `workers` > 1 runs that many calls at once in threads: the python tool's calls are
    subprocesses, so they overlap; in-process tools must then be thread-safe."""
    def one(c: ToolCall) -> ToolResult:
        return error(c.error, max_chars) if c.error else tools.run(c.name, c.arguments, max_chars)
    if workers <= 1 or len(calls) <= 1:
        return [one(c) for c in calls]
    with concurrent.futures.ThreadPoolExecutor(min(workers, len(calls))) as pool:
        return list(pool.map(one, calls))


@dataclasses.dataclass(frozen=True)
class _Rules:
    """How a rollout turns sampled turns into episodes: the same for both rollouts."""
    tokenizer: object
    tools: Registry
    parse: Callable[[str], list[ToolCall]]
    observation_ids: Callable[[Sequence[ToolResult], int | None], list[int]]  # `observe`
    stops: frozenset
    max_turns: int
    budget: int
    max_chars: int

    def take_turn(self, episode: _Running, ids, logprobs, stopped: bool) -> list[ToolCall]:
        """Appends a sampled turn (cut at the episode's budget) and returns its calls to run;
        none when the episode ended there (`ended` set)."""
        room = self.budget - len(episode.tokens)
        stopped = stopped and len(ids) <= room
        ids, logprobs = ids[:room], logprobs[:room]
        episode.turn_starts.append(len(episode.tokens))
        episode.append(ids, logprobs)
        if not stopped and len(episode.tokens) >= self.budget:
            episode.ended = BUDGET
            return []
        last = int(ids[-1]) if stopped and int(ids[-1]) in self.stops else None
        # Parsed without the stop token the turn ended on: a Hermes block left open runs to
        # the end of the text, and the stop token's text would spoil its JSON.
        text = self.tokenizer.decode([int(i) for i in ids[:len(ids) - (last is not None)]])
        calls = self.parse(text)
        if not calls:
            episode.ended = ANSWER if stopped else TRUNCATED
        elif episode.turns == self.max_turns:
            episode.ended = MAX_TURNS
            return []
        return calls

    def observe(self, episode: _Running, calls: Sequence[ToolCall],
                results: Sequence[ToolResult]) -> list[int] | None:
        """Appends the calls' observation tokens and returns them (None: no room left for them
        and a next token, the episode ended on its budget)."""
        episode.tool_calls += len(calls)
        episode.tool_failures += sum(not r.ok for r in results)
        episode.stopped.extend(r.stopped for r in results if r.stopped)
        last = episode.tokens[-1] if episode.tokens[-1] in self.stops else None
        observation = list(self.observation_ids(results, last))
        if len(episode.tokens) + len(observation) >= self.budget:
            episode.ended = BUDGET
            return None
        episode.append(observation)
        return observation


def rollout_episodes(model, contexts: Sequence, *, tokenizer, tools: Registry,
                     n: int, max_turns: int, episode_token_budget: int, max_new_tokens: int,
                     stop_ids: Sequence[int] = (), seed: int = 0,
                     parse: Callable[[str], list[ToolCall]] | None = None,
                     observe: Callable[[Sequence[ToolResult], int | None], list[int]] | None
                     = None, max_observation_chars: int = DEFAULT_MAX_CHARS,
                     tool_workers: int = 1, kv_kept: bool = False, chunk_steps: int = 32,
                     timings: dict | None = None, **sampler) -> list[Episode]:
    """n episodes of each context (token ids or a SharedContext; episode i*n + j continues
    contexts[i]), each until a final answer, `max_turns` sampled turns, or
    `episode_token_budget` tokens in all.

    Each turn samples up to max_new_tokens (`stop_ids`, and `sampler`'s other keywords:
    RolloutSpec.sampler_keywords()). A turn whose text holds tool calls (`parse`: the chat
    template's format by default) has its tools run and the token ids `observe(results, the
    stop token the turn ended on or None)` gives appended (default: the chat template's tool
    turn, tools/observations.py); `parse` and `observe` are an environment's
    (tools/environments.py). A turn without a call that ended on a stop token is the final
    answer. Two rollouts give the same episodes (tests/test_tool_episodes.py):
      - kv_kept=False, the REFERENCE: one `generate` call per turn on every running
        conversation, re-prefilled whole; a turn's calls run together, `tool_workers` at a
        time (run_calls), between that turn's generate call and the next;
      - kv_kept=True: sampling.sample_turns, one continuous decode in which a row leaves for
        its tools and comes back with its KV kept (no earlier turn prefilled again); each
        episode's calls run in one of `tool_workers` threads while the device decodes the
        other rows, and the loop returns to the host every `chunk_steps` steps at most
        (turns.TOOL_WAIT_STEPS while a tool runs).
    `timings` (a dict, optional) receives how the time went: wall_s, device_s (the device at
    work), tools_s (a tool running) and idle_while_tools_s (the device idle meanwhile); with
    kv_kept, sample_turns' other stats too (chunks, steps). `sampler`'s record_routes (a MoE):
    each episode's routes, its tokens' experts for routing replay (module docstring).
    """
    if max_turns < 1:
        raise ValueError(f"max_turns={max_turns}: expected >= 1")
    prompts = [token_ids(c) for c in contexts]  # a SharedContext's prompt and suffix
    longest = max(map(len, prompts))
    if longest >= episode_token_budget:
        raise ValueError(f"episode_token_budget={episode_token_budget}: expected more than the "
                         f"longest context ({longest} tokens)")
    observe = observe or (lambda results, stop: observation_tokens(
        tokenizer, [r.text for r in results], stop))
    rules = _Rules(tokenizer, tools, parse or parser(format_for(tokenizer.chat_template)),
                   observe, frozenset(int(s) for s in stop_ids), max_turns,
                   episode_token_budget, max_observation_chars)
    running = [_Running(g, list(prompts[g]), [0] * len(prompts[g]), [0.0] * len(prompts[g]),
                        len(prompts[g]))
               for g in range(len(contexts)) for _ in range(n)]
    kwargs = dict(n=n, max_new_tokens=max_new_tokens, stop_ids=stop_ids, seed=seed, **sampler)
    begin = time.perf_counter()
    if kv_kept:
        spent = _kv_kept(model, contexts, running, rules, tool_workers, chunk_steps, kwargs)
    else:
        spent = _reprefilled(model, contexts, running, rules, tool_workers, kwargs)
    if timings is not None:
        timings.update(spent, wall_s=time.perf_counter() - begin)
    for episode in running:
        episode.ended = episode.ended or MAX_TURNS
    return [e.freeze() for e in running]


def _reprefilled(model, contexts, running: list[_Running], rules: _Rules, workers: int,
                 kwargs: dict) -> dict:
    """The reference: one generate() per turn on every running conversation, whole. Turn 0 is
    generate's own streams; a later turn draws episode e's tokens from the stream (seed, e,
    own index) as sample_turns does (generate's `streams`).

    Recorded experts (record_routes): each token keeps those of the first turn that computed
    it, not the latest re-prefill's. The learner replays one routing over the whole episode,
    but here each turn's tokens were sampled over its own re-prefill of the earlier ones, so
    no single routing is every turn's. The first one is the turn's own for every sampled
    token (the decode step that drew the next one) and for the whole first turn; a re-prefill
    differs from it only where a router's near-tie breaks the other way in its numerics; and
    it is what the KV-kept rollout records, whose KV of a token is computed once: the two
    rollouts, which give the same episodes, give the same batch to train on."""
    n = kwargs.pop('n')
    spent = dict(device_s=0.0, tools_s=0.0)
    for turn in range(rules.max_turns):
        active = [e for e in running if e.ended is None]
        if not active:
            break
        # Always max_new_tokens, each row cut at its own budget (take_turn): one compiled decode
        # for every turn (sampling is autoregressive, so the cut keeps exactly what the row
        # would have sampled had it been stopped there).
        started = time.perf_counter()
        if turn == 0:
            rollouts = generate(model, contexts, n=n, **kwargs)
        else:
            streams = [(i, len(e.tokens) - e.prompt_length) for i, e in enumerate(running)
                       if e.ended is None]
            for e in active:  # all of it prefilled again, but its newest observation
                e.reprefilled += len(e.tokens) - e.observed
            rollouts = generate(model, [e.tokens for e in active], n=1, streams=streams,
                                **kwargs)
        spent['device_s'] += time.perf_counter() - started
        waiting = []  # (episode, its calls)
        for row, episode in enumerate(active):
            start, length = rollouts.context_lengths[row], rollouts.lengths[row]
            calls = rules.take_turn(episode, rollouts.tokens[row, start:start + length],
                                    rollouts.logprobs[row, start:start + length],
                                    bool(rollouts.stopped[row]))
            if rollouts.routes is not None:  # its new tokens' (the row is the conversation)
                episode.route(rollouts.routes[row])
            if calls:
                waiting.append((episode, calls))
        started = time.perf_counter()
        results = run_calls([c for _, calls in waiting for c in calls], rules.tools,
                            rules.max_chars, workers)
        spent['tools_s'] += time.perf_counter() - started
        for episode, calls in waiting:
            mine, results = results[:len(calls)], results[len(calls):]
            observation = rules.observe(episode, calls, mine)
            episode.observed = 0 if observation is None else len(observation)
    return spent | {'idle_while_tools_s': spent['tools_s']}  # the device waits for them


def _kv_kept(model, contexts, running: list[_Running], rules: _Rules, workers: int,
             chunk_steps: int, kwargs: dict) -> dict:
    """sampling.sample_turns with the rules as its host side: each ended turn is taken, and its
    calls run in a worker thread while the device decodes the other rows."""
    with concurrent.futures.ThreadPoolExecutor(max(1, workers)) as pool:
        def respond(end: TurnEnd):
            episode = running[end.episode]
            calls = rules.take_turn(episode, end.ids, end.logprobs, end.stopped)
            if end.final or not calls:
                if calls:
                    raise AssertionError(f"episode {end.episode}: a final turn with calls")
                return _answered(None)
            return pool.submit(lambda: rules.observe(episode, calls, run_calls(
                calls, rules.tools, rules.max_chars)))
        result = sample_turns(model, contexts, max_turns=rules.max_turns,
                              episode_token_budget=rules.budget, respond=respond,
                              chunk_steps=chunk_steps, **kwargs)
    for row, (episode, count) in enumerate(zip(running, result.recomputed)):
        episode.reprefilled = int(count)
        if result.rollouts.routes is not None:  # row e: episode e's tokens, in order
            episode.route(result.rollouts.routes[row])
    return {k: v for k, v in result.stats.items() if k != 'wall_s'}


def _answered(value) -> concurrent.futures.Future:
    future = concurrent.futures.Future()
    future.set_result(value)
    return future


def as_rollouts(episodes: Sequence[Episode], n: int) -> Rollouts:
    """Episodes laid out as the learner's `Rollouts` (episode i*n + j in row i*n + j), so that
    rl.dynamic_sampling.build_batch makes their batch as it does for one-turn rollouts.

    The row's "context" is the prompt and its "completion" everything after it; the loss mask
    (completion_mask) is 1 on sampled tokens only, so observation tokens carry no loss and no
    importance ratio, and `logprobs` are the sampler's own on sampled tokens (for the ratios
    and TIS). `lengths` count observation tokens too (the row's extent); `stopped` is True
    where the episode ended on a final answer; `routes` the episodes' recorded experts
    (record_routes), -1 past each one.
    """
    if len(episodes) % n:
        raise ValueError(f"as_rollouts: {len(episodes)} episodes is not a multiple of n={n}")
    width = max(len(e.tokens) for e in episodes)
    tokens = np.zeros((len(episodes), width), np.int32)
    mask = np.zeros((len(episodes), width), np.int32)
    logprobs = np.zeros((len(episodes), width), np.float32)
    for row, e in enumerate(episodes):
        tokens[row, :len(e.tokens)] = e.tokens
        mask[row, :len(e.tokens)] = e.sampled
        logprobs[row, :len(e.tokens)] = e.logprobs
    routes = None
    if episodes[0].routes is not None:
        first = episodes[0].routes
        routes = np.full((len(episodes), width, *first.shape[1:]), -1, first.dtype)
        for row, e in enumerate(episodes):
            routes[row, :len(e.tokens)] = e.routes
    total = np.array([len(e.tokens) for e in episodes], np.int32)
    context = np.array([e.prompt_length for e in episodes], np.int32)
    columns = np.arange(width, dtype=np.int32)[None, :]
    return Rollouts(tokens=tokens, positions=np.where(columns < total[:, None], columns, 0),
                    completion_mask=mask, logprobs=logprobs, context_lengths=context,
                    lengths=total - context,
                    stopped=np.array([e.ended == ANSWER for e in episodes]),
                    group_ids=np.array([e.group for e in episodes], np.int32), n=n,
                    routes=routes)


def episode_metrics(episodes: Sequence[Episode]) -> dict[str, float]:
    """The rollout/ metrics of a batch of episodes (as metrics.jsonl rows name them)."""
    return {"rollout/tool_calls": float(sum(e.tool_calls for e in episodes)),
            "rollout/tool_failures": float(sum(e.tool_failures for e in episodes)),
            "rollout/turns_mean": float(np.mean([e.turns for e in episodes])),
            "rollout/reprefilled_tokens": float(sum(e.reprefilled for e in episodes)),
            "rollout/sandbox_refusals": float(sum(s in REFUSALS for e in episodes
                                                  for s in e.stopped)),
            "rollout/sandbox_kills": float(sum(s in KILLS for e in episodes for s in e.stopped))}


def reprefilled_tokens(episode: Episode) -> int:
    """Tokens of the episode's earlier turns its rollout prefilled again, as the rollout counted
    them: the reference prefills, at each turn after the first, the whole conversation before
    the newest observation; the KV-kept rollout none (a preempted row's replayed earlier turns
    aside)."""
    return episode.reprefilled


def sampler_tokens(episode: Episode) -> tuple[int, int]:
    """(prefilled, sampled) tokens of the episode's rollout, as the compute ledger books them:
    the prompt, every observation once and what the rollout prefilled again; the policy's own."""
    sampled = int(episode.sampled.sum())
    return len(episode.tokens) - sampled + episode.reprefilled, sampled


def final_answer(episode: Episode, tokenizer) -> str:
    """What the verifier reads of an episode: its last turn's sampled text, without the stop
    token an answer ended on (as one-turn completions are scored)."""
    start = episode.turn_starts[-1]
    ids = episode.tokens[start:][episode.sampled[start:] == 1].tolist()
    return tokenizer.decode(ids[:-1] if episode.ended == ANSWER else ids)
