"""External environments: episodes an environment of its own runs against the live policy over
the OpenAI-compatible API, turned into the rows the RL loop trains on (docs/TOOLS.md,
"Training through such an environment"); `rollout` is one round of the loop.

An environment is any object with

    async def run_episode(client, model: str, problem, sampling_args: dict) -> EpisodeResult

`client` an `openai.AsyncOpenAI` on the live server (live.py), `model` the name to ask for,
`problem` the run's data.Problem, `sampling_args` the run's sampling (rollout.temperature, top_p,
top_k, max_new_tokens) with the token-id fields this needs (`logprobs`, vLLM's
`return_token_ids`), to pass to every request as `**sampling_args` (chat's form; for
/v1/completions pass `logprobs=0` instead of True). It returns the responses of the policy's
turns, in order, and its scalar reward. The environment owns its prompts, its turns and its
reward; the run's method only picks which problems, n episodes of each (GRPO's groups).

`episode_of` lays an episode's turns out as one token sequence (tools.episodes.Episode): the
first turn's prompt, then each turn's sampled tokens (loss mask 1, the server's log-probs) and
what the next turn's prompt appends after them (mask 0). A later turn's prompt must therefore
begin with everything before it, token for token: a chat environment whose template re-renders
an earlier turn's text into other tokens is refused in one line (one row per turn is not built).
"""
from __future__ import annotations

import asyncio
import copy
import dataclasses
import math
import threading
from typing import Any, Protocol, Sequence

import numpy as np

from jaxprefix.errors import UserError
from jaxprefix.serving.live import LiveServer
from jaxprefix.tools.episodes import ANSWER, TRUNCATED, Episode


@dataclasses.dataclass(frozen=True)
class Turn:
    """One policy turn as the server sampled it."""
    prompt_ids: tuple[int, ...]
    completion_ids: tuple[int, ...]   # the stop token included where the turn ended on one
    logprobs: tuple[float, ...]       # the sampler's, one per completion token
    finish_reason: str                # 'stop', 'tool_calls' (ended on a stop token too), 'length'


@dataclasses.dataclass
class EpisodeResult:
    """What an environment's episode returns: its policy turns (openai responses of the live
    server, their dicts, or Turns) and its reward."""
    turns: Sequence[Any]
    reward: float


class ExternalEnvironment(Protocol):
    async def run_episode(self, client, model: str, problem,
                          sampling_args: dict) -> EpisodeResult: ...


def sampling_args(*, max_tokens: int, temperature: float, top_p: float, top_k: int) -> dict:
    """The keywords every request of an episode passes (chat's form: logprobs=True)."""
    return {"max_tokens": max_tokens, "temperature": temperature, "top_p": top_p,
            "logprobs": True, "extra_body": {"return_token_ids": True, "top_k": top_k}}


def turn_of(response) -> Turn:
    """The Turn of a chat or completions response of one choice (an openai object or its dict),
    asked with return_token_ids and logprobs."""
    if isinstance(response, Turn):
        return response
    body = response if isinstance(response, dict) else response.model_dump()
    choices = body.get("choices") or []
    if len(choices) != 1:
        raise ValueError(f"an episode's turn has {len(choices)} choices; expected n=1")
    (choice,) = choices
    prompt = body.get("prompt_token_ids") or choice.get("prompt_token_ids")
    completion = choice.get("token_ids")
    if prompt is None or completion is None:
        raise ValueError("an episode's turn came back without token ids; expected each request "
                         "to pass the environment's sampling_args (extra_body "
                         "return_token_ids=True)")
    logprobs = choice.get("logprobs") or {}
    if "content" in logprobs:  # chat
        values = [entry["logprob"] for entry in logprobs["content"] or ()]
    else:                      # completions
        values = logprobs.get("token_logprobs")
    if values is None or len(values) != len(completion):
        raise ValueError("an episode's turn came back without a log-prob per token; expected "
                         "each request to pass the environment's sampling_args (logprobs)")
    return Turn(tuple(map(int, prompt)), tuple(map(int, completion)), tuple(map(float, values)),
                choice.get("finish_reason") or "length")


def episode_of(turns: Sequence[Turn], group: int) -> Episode:
    """The episode's turns as one token sequence (module docstring); refuses a turn whose prompt
    does not begin with the sequence so far."""
    if not turns:
        raise ValueError("an episode returned no policy turn; expected at least one")
    first = list(turns[0].prompt_ids)
    tokens, sampled, logprobs = list(first), [0] * len(first), [0.0] * len(first)
    starts, reprefilled = [], 0
    for k, turn in enumerate(turns):
        prompt = list(turn.prompt_ids)
        if prompt[:len(tokens)] != tokens:
            at = next((i for i, (a, b) in enumerate(zip(prompt, tokens)) if a != b),
                      min(len(prompt), len(tokens)))
            raise ValueError(f"turn {k + 1} of an episode: its prompt does not begin with the "
                             f"episode so far (they differ at token {at} of {len(tokens)}); "
                             f"expected each turn to extend the last one token for token (a "
                             f"chat template that re-renders an earlier turn into other tokens, "
                             f"or a history cut short, cannot be one training row)")
        appended = prompt[len(tokens):]
        reprefilled += len(tokens) if k else 0  # the server prefills each turn's prompt whole
        tokens += appended
        sampled += [0] * len(appended)
        logprobs += [0.0] * len(appended)
        starts.append(len(tokens))
        tokens += turn.completion_ids
        sampled += [1] * len(turn.completion_ids)
        logprobs += turn.logprobs
    return Episode(np.array(tokens, np.int32), np.array(sampled, np.int32),
                   np.array(logprobs, np.float32), len(first), tuple(starts), 0, 0,
                   ANSWER if turns[-1].finish_reason in ("stop", "tool_calls") else TRUNCATED,
                   group,
                   reprefilled)


class EpisodeStalled(UserError):
    """An episode outlived config.environment.episode_timeout_s: the run stops in one line."""


EPISODE_FIELD = "config.environment.episode_timeout_s"


class EnvironmentFailed(UserError, ValueError):
    """An episode raised (the environment failed or died mid-episode) or came back malformed:
    the run stops in one line, its last checkpoint kept."""


def _failed(what: str, error: BaseException) -> EnvironmentFailed:
    return EnvironmentFailed(f"{what}: {type(error).__name__}: {error} (the environment of "
                             f"config.environment.source; the run stops at its last checkpoint)")


def _stalled(what: str, seconds: float) -> EpisodeStalled:
    return EpisodeStalled(f"{what} did not end within {seconds:g} s (its environment hung or is "
                          f"slower than that); raise {EPISODE_FIELD} if its episodes take longer")


def run_episodes(environment: ExternalEnvironment, server, problems: Sequence, n: int,
                 args: dict, *, max_concurrent: int = 0, timeout_s: float = 600.0,
                 episode_timeout_s: float = 3600.0) -> tuple[list[Episode], np.ndarray]:
    """n episodes of each problem against `server` (a started LiveServer): (episode i*n + j of
    problems[i], in order; their rewards [len(problems), n]). An episode that outlives
    `episode_timeout_s` (its own time, not its wait for a slot) stops the round: EpisodeStalled."""
    import openai

    total = len(problems) * n
    slots_n = max_concurrent or total

    async def run_all():
        client = openai.AsyncOpenAI(base_url=server.base_url, api_key="none", max_retries=0,
                                    timeout=timeout_s)
        slots = asyncio.Semaphore(slots_n)

        async def one(problem):
            async with slots:
                try:
                    return await asyncio.wait_for(environment.run_episode(
                        client, server.model_name, problem, copy.deepcopy(args)),
                        episode_timeout_s)
                except asyncio.TimeoutError:
                    raise _stalled(f"an episode of problem {problem.id!r}",
                                   episode_timeout_s) from None
                except Exception as e:  # noqa: BLE001  (the environment's own failure)
                    raise _failed(f"an episode of problem {problem.id!r} raised", e) from e
        try:
            return await asyncio.gather(*(one(p) for p in problems for _ in range(n)))
        finally:
            await client.close()

    # The round's event loop runs in a thread of its own, so that an environment blocking it
    # (synchronous code in run_episode, which wait_for cannot cut) still meets a deadline:
    # every wave of episodes its own, and a second for the loop's start and close.
    deadline = math.ceil(total / slots_n) * episode_timeout_s + 1.0
    outcome: dict = {}

    def round_():
        try:
            outcome["results"] = asyncio.run(run_all())
        except BaseException as e:  # noqa: BLE001  (raised again in the caller's thread)
            outcome["error"] = e
    thread = threading.Thread(target=round_, name="environment round", daemon=True)
    thread.start()
    thread.join(deadline)
    if thread.is_alive():  # left behind as a daemon: the run stops, its process ends
        raise _stalled(f"a round of {total} episodes (one blocks the event loop, which no "
                       f"episode's deadline can cut)", deadline)
    if "error" in outcome:
        raise outcome["error"]
    episodes, rewards = [], []
    for e, result in enumerate(outcome["results"]):
        try:
            episodes.append(_checked_episode(result, e, n))
        except (TypeError, ValueError) as error:  # malformed: refused whole, in one line
            raise _failed(f"episode {e} (problem {problems[e // n].id!r}) came back malformed",
                          error) from error
        rewards.append(float(result.reward))
    return episodes, np.array(rewards, np.float32).reshape(len(problems), n)


def _checked_episode(result, e: int, n: int) -> Episode:
    """Episode e of a round as the learner takes it; raises on what an environment got wrong."""
    if not isinstance(result, EpisodeResult):
        raise TypeError(f"run_episode returned {type(result).__name__}; expected a "
                        f"jaxprefix.serving.external.EpisodeResult")
    if not np.isfinite(float(result.reward)):
        raise ValueError(f"reward {result.reward!r}; expected a finite number")
    return episode_of([turn_of(t) for t in result.turns], group=e // n)


def rollout(environment: ExternalEnvironment, model, problems: Sequence, *, tokenizer,
            context_length: int, n: int, stop_ids, seed: int, record_routes: bool = False,
            max_concurrent: int = 0, max_batch_rows: int = 64, timeout_s: float = 600.0,
            episode_timeout_s: float = 3600.0, **keywords) -> tuple[list[Episode], np.ndarray]:
    """One round: `model` served live (LiveServer, its batcher seeded by `seed`) with the run's
    sampler keywords (RolloutSpec.sampler_keywords()), n episodes of each problem by
    `environment` against it (run_episodes), the server stopped. A request that asks for other
    sampling than the run's is a 400: the learner scores the run's."""
    if record_routes:
        raise ValueError("config.environment.source: routing replay (a mixture of experts, "
                         "train.routing_replay) needs each token's experts, which the live "
                         "server does not record; expected train.routing_replay='off'")
    args = sampling_args(max_tokens=keywords.pop("max_new_tokens"),
                         temperature=keywords.pop("temperature"), top_p=keywords.pop("top_p"),
                         top_k=keywords.pop("top_k"))
    sampling = {"temperature": args["temperature"], "top_p": args["top_p"],
                "top_k": args["extra_body"]["top_k"]}
    with LiveServer(model, tokenizer, stop_ids=stop_ids, sampler_keywords=keywords,
                    max_tokens=args["max_tokens"], context_length=context_length,
                    max_batch_rows=max_batch_rows, seed=seed, sampling=sampling) as server:
        return run_episodes(environment, server, problems, n, args,
                            max_concurrent=max_concurrent, timeout_s=timeout_s,
                            episode_timeout_s=episode_timeout_s)
