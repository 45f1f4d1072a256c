"""Multi-turn episodes on the host: the policy's turns, its tool calls, their observations.

An `Episode` is one token sequence, exactly the ids that were sampled and appended (token-in,
token-out: text is decoded only to parse calls, never re-encoded into the sequence):

    tokens   [prompt ....][turn 1 sampled .....][observation ...][turn 2 sampled ...]
    sampled   0 0 0 0 0 0  1 1 1 1 1 1 1 1 1 1  0 0 0 0 0 0 0 0  1 1 1 1 1 1 1 1 1
    logprobs  0 ...        the sampler's log-prob of each sampled token, 0 elsewhere

`rollout_episodes` is the REFERENCE multi-turn rollout: it calls `sampling.generate` once per
turn on each unfinished conversation so far, so every turn RE-PREFILLS the whole conversation
(prompt, earlier turns, observations). It is the arm the in-graph version (rows leaving the
continuous decode loop for their tool and coming back with their KV kept) is to be tested
against, and the baseline of the bench; it is not the fast path.

Sampling streams: turn 0 samples row i*n + j (episode i*n + j) from generate's stream `seed`;
turn t > 0 samples the episodes still running, in episode order, one row each, from stream
`seed + t` (row = the episode's position among them).
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
from typing import Callable, Sequence

import numpy as np

from jaxprefix.sampling import Rollouts, generate, token_ids
from jaxprefix.tools.api import DEFAULT_MAX_CHARS, Registry, ToolResult, error
from jaxprefix.tools.calls import ToolCall, format_for, parser
from jaxprefix.tools.observations import observation_tokens

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
                   rollout's cost, `reprefilled_tokens`; 0 where turns keep their KV)
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

    def append(self, ids, logprobs=None):
        self.tokens.extend(int(i) for i in ids)
        self.sampled.extend([1 if logprobs is not None else 0] * len(ids))
        self.logprobs.extend([0.0] * len(ids) if logprobs is None else map(float, logprobs))

    def freeze(self) -> Episode:
        episode = Episode(np.array(self.tokens, np.int32), np.array(self.sampled, np.int32),
                          np.array(self.logprobs, np.float32), self.prompt_length,
                          tuple(self.turn_starts), self.tool_calls, self.tool_failures,
                          self.ended, self.group)
        return dataclasses.replace(episode, reprefilled=reprefilled_tokens(episode))


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


def rollout_episodes(model, contexts: Sequence[Sequence[int]], *, tokenizer, tools: Registry,
                     n: int, max_turns: int, episode_token_budget: int, max_new_tokens: int,
                     stop_ids: Sequence[int] = (), seed: int = 0,
                     parse: Callable[[str], list[ToolCall]] | None = None,
                     observe: Callable[[Sequence[ToolResult], int | None], list[int]] | None
                     = None, max_observation_chars: int = DEFAULT_MAX_CHARS,
                     tool_workers: int = 1, **sampler) -> list[Episode]:
    """n episodes of each context (token ids or a SharedContext; episode i*n + j continues
    contexts[i]), each until a final answer, `max_turns` sampled turns, or
    `episode_token_budget` tokens in all.

    Each turn is one `generate` call (max_new_tokens per turn, `stop_ids`, and `sampler`'s
    other keywords: RolloutSpec.sampler_keywords()) on every running conversation, re-prefilled
    whole (the reference arm: see the module docstring). A turn whose text holds tool calls
    (`parse`: the chat template's format by default) has its tools run and the token ids
    `observe(results, the stop token the turn ended on)` gives appended (default: the chat
    template's tool turn, tools/observations.py); `parse` and `observe` are an environment's
    (tools/environments.py). A turn without a call that ended on a stop token is the final
    answer. The calls of a turn's episodes run together, `tool_workers` at a time
    (run_calls), between that turn's generate call and the next.
    """
    if max_turns < 1:
        raise ValueError(f"max_turns={max_turns}: expected >= 1")
    prompts = [token_ids(c) for c in contexts]  # a SharedContext's prompt and suffix
    longest = max(map(len, prompts))
    if longest >= episode_token_budget:
        raise ValueError(f"episode_token_budget={episode_token_budget}: expected more than the "
                         f"longest context ({longest} tokens)")
    parse = parse or parser(format_for(tokenizer.chat_template))
    observe = observe or (lambda results, stop: observation_tokens(
        tokenizer, [r.text for r in results], stop))
    stops = set(int(s) for s in stop_ids)
    running = [_Running(g, list(prompts[g]), [0] * len(prompts[g]), [0.0] * len(prompts[g]),
                        len(prompts[g]))
               for g in range(len(contexts)) for _ in range(n)]
    for turn in range(max_turns):
        active = [e for e in running if e.ended is None]
        if not active:
            break
        # Always max_new_tokens, each row cut at its own budget below: one compiled decode
        # for every turn (sampling is autoregressive, so the cut keeps exactly what the row
        # would have sampled had it been stopped there).
        kwargs = dict(max_new_tokens=max_new_tokens, stop_ids=stop_ids, **sampler)
        if turn == 0:
            rollouts = generate(model, contexts, n=n, seed=seed, **kwargs)
        else:
            rollouts = generate(model, [e.tokens for e in active], n=1, seed=seed + turn,
                                **kwargs)
        waiting = []  # (episode, its calls, the stop token its turn ended on)
        for row, episode in enumerate(active):
            start, length = rollouts.context_lengths[row], rollouts.lengths[row]
            ids = rollouts.tokens[row, start:start + length]
            logprobs = rollouts.logprobs[row, start:start + length]
            room = episode_token_budget - len(episode.tokens)
            stopped = bool(rollouts.stopped[row]) and length <= room
            ids, logprobs = ids[:room], logprobs[:room]
            episode.turn_starts.append(len(episode.tokens))
            episode.append(ids, logprobs)
            if not stopped and len(episode.tokens) >= episode_token_budget:
                episode.ended = BUDGET
                continue
            last = int(ids[-1]) if stopped and int(ids[-1]) in stops else None
            # Parsed without the stop token the turn ended on: a Hermes block left open runs
            # to the end of the text, and the stop token's text would spoil its JSON.
            calls = parse(tokenizer.decode(ids[:len(ids) - (last is not None)].tolist()))
            if not calls:
                episode.ended = ANSWER if stopped else TRUNCATED
            elif turn == max_turns - 1:
                episode.ended = MAX_TURNS
            else:
                waiting.append((episode, calls, last))
        results = run_calls([c for _, calls, _ in waiting for c in calls], tools,
                            max_observation_chars, tool_workers)
        for episode, calls, last in waiting:
            mine, results = results[:len(calls)], results[len(calls):]
            episode.tool_calls += len(calls)
            episode.tool_failures += sum(not r.ok for r in mine)
            observation = observe(mine, last)
            if len(episode.tokens) + len(observation) >= episode_token_budget:
                episode.ended = BUDGET  # no room for the observation and a next token
            else:
                episode.append(observation)
    for episode in running:
        episode.ended = episode.ended or MAX_TURNS
    return [e.freeze() for e in running]


def as_rollouts(episodes: Sequence[Episode], n: int) -> Rollouts:
    """Episodes laid out as the learner's `Rollouts` (episode i*n + j in row i*n + j), so that
    rl.dynamic_sampling.build_batch makes their batch as it does for one-turn rollouts.

    The row's "context" is the prompt and its "completion" everything after it; the loss mask
    (completion_mask) is 1 on sampled tokens only, so observation tokens carry no loss and no
    importance ratio, and `logprobs` are the sampler's own on sampled tokens (for the ratios
    and TIS). `lengths` count observation tokens too (the row's extent); `stopped` is True
    where the episode ended on a final answer.
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
    total = np.array([len(e.tokens) for e in episodes], np.int32)
    context = np.array([e.prompt_length for e in episodes], np.int32)
    columns = np.arange(width, dtype=np.int32)[None, :]
    return Rollouts(tokens=tokens, positions=np.where(columns < total[:, None], columns, 0),
                    completion_mask=mask, logprobs=logprobs, context_lengths=context,
                    lengths=total - context,
                    stopped=np.array([e.ended == ANSWER for e in episodes]),
                    group_ids=np.array([e.group for e in episodes], np.int32), n=n)


def episode_metrics(episodes: Sequence[Episode]) -> dict[str, float]:
    """The rollout/ metrics of a batch of episodes (as metrics.jsonl rows name them)."""
    return {"rollout/tool_calls": float(sum(e.tool_calls for e in episodes)),
            "rollout/tool_failures": float(sum(e.tool_failures for e in episodes)),
            "rollout/turns_mean": float(np.mean([e.turns for e in episodes])),
            "rollout/reprefilled_tokens": float(sum(e.reprefilled for e in episodes))}


def reprefilled_tokens(episode: Episode) -> int:
    """Tokens the reference rollout prefilled again: at each turn after the first, the whole
    conversation before the newest observation (whose tokens any rollout must prefill once)."""
    total = 0
    for previous, start in zip(episode.turn_starts, episode.turn_starts[1:]):
        observation = int((1 - episode.sampled[previous:start]).sum())
        total += start - observation
    return total


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
