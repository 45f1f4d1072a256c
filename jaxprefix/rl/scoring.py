"""One round of sampling and scoring: a method's RolloutRequest sampled (one turn a row, or
multi-turn episodes) and scored by the run's verifier, the figures of scored rollouts
(reward_metrics, turn_metrics) and an evaluation of the method's eval requests. The loop runs
rounds; the tool study and the bench run them alone.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable, Sequence

import numpy as np

from jaxprefix import rewards, sampling
from jaxprefix.rl import boundaries
from jaxprefix.rl.loop_settings import LoopSettings, RewardSettings
from jaxprefix.tools import episodes as multi_turn


@dataclasses.dataclass
class RolloutRequest:
    """What to sample: one problem and one value per tag for each context.

    contexts: token-id lists or `SharedContext`s; tags: name -> array [C] (boolean tags such as
    'guided' get their own reward curves); response_prefixes: per context, the text of an
    unfinished answer the context ends with ('' for none): the verifier judges prefix + completion.
    """
    contexts: list
    problems: list
    tags: dict[str, np.ndarray]
    n: int
    response_prefixes: list[str] | None = None

    def __post_init__(self):
        if len(self.contexts) != len(self.problems):
            raise ValueError(f"RolloutRequest: {len(self.contexts)} contexts but "
                             f"{len(self.problems)} problems")
        for name, values in self.tags.items():
            if len(values) != len(self.contexts):
                raise ValueError(f"RolloutRequest: tag {name!r} has {len(values)} values for "
                                 f"{len(self.contexts)} contexts")


@dataclasses.dataclass
class Scored:
    request: RolloutRequest
    rollouts: sampling.Rollouts  # episodes laid out as rows (multi_turn.as_rollouts) too
    rewards: np.ndarray          # [C, n]
    verifier_failures: int
    seconds_sampling: float
    seconds_reward: float
    too_long: int = 0            # completions over rewards.max_chars, scored 0 unread
    prefilled: int = 0           # tokens the sampler prefilled (observations, re-prefills too)
    generated: int = 0           # tokens the policy sampled
    episodes: list | None = None  # multi-turn episodes (None: one turn a row)
    versions: dict | None = None  # {weights version: tokens it drew} when they changed mid-decode
    figures: dict | None = None   # the sampler's own step figures (partial rollouts: partial/*)


@dataclasses.dataclass(frozen=True)
class EpisodeSource:
    """Where a request's rows come from when not one turn each: the run's tool episodes
    (`ToolSettings.episode_rollout`, the request's contexts sampled with tools and the final
    answers scored by the run's verifier) or an external environment's (`EnvironmentSettings.
    episode_source`, the request's problems run against the policy served live and rewarded by
    the environment: `rewarded`)."""
    run: Callable
    rewarded: bool = False

    def __call__(self, model, request: RolloutRequest, **keywords) -> tuple[list, np.ndarray | None]:
        """(the episodes, n per context in order; the environment's rewards [C, n] or None)."""
        if self.rewarded:
            return self.run(model, request.problems, n=request.n, **keywords)
        return self.run(model, request.contexts, n=request.n, **keywords), None


def episode_source(tools, environment, tokenizer, context_length: int) -> EpisodeSource | None:
    """The run's episode source: an external environment's where config.environment names
    one, else the tool episodes where rollout.max_turns > 1, else None (one turn a row)."""
    if environment is not None and environment.active:
        return EpisodeSource(environment.episode_source(tokenizer, context_length), rewarded=True)
    if tools is not None and tools.episodes:
        return EpisodeSource(tools.episode_rollout(tokenizer, context_length))
    return None


def completion_texts(tokenizer, rollouts, prefixes: Sequence[str] | None) -> list[str]:
    """Each row's response prefix + its decoded completion, the stop token left out."""
    texts = []
    for row, ids in enumerate(rollouts.completions()):
        prefix = prefixes[rollouts.group_ids[row]] if prefixes else ""
        texts.append(prefix + tokenizer.decode(list(ids)))
    return texts


def sample_and_score(model, tokenizer, request: RolloutRequest, scoring: RewardSettings, *,
                     rollout: sampling.RolloutSpec, seed: int, stop_ids: Sequence[int],
                     record_routes: bool = False,
                     episodes: EpisodeSource | None = None) -> Scored:
    """Samples the request, one turn a row or as `episodes` says (a row an episode), and scores
    it: by the run's verifier (on an episode, its final answer), or by the environment where it
    rewards its own episodes. With `record_routes`, each row's tokens carry a MoE's experts
    (Rollouts.routes). `model` may be a sampling.LiveWeights (one turn a row): its newer
    weights take over between the decode's chunks, and Scored.versions counts the tokens each
    drew."""
    start = time.perf_counter()
    live = model if isinstance(model, sampling.LiveWeights) else None
    model = live.model if live else model
    boundaries.check_contexts(request.contexts, vocab_size=model.config.vocab_size)
    keywords = rollout.sampler_keywords()
    found, env_rewards, versions = None, None, None
    if episodes is None:
        if live is None:
            rollouts = sampling.generate(model, request.contexts, n=request.n, stop_ids=stop_ids,
                                         seed=seed, record_routes=record_routes, **keywords)
        else:
            decoded = sampling.sample_live(live, request.contexts, n=request.n,
                                           stop_ids=stop_ids, seed=seed,
                                           record_routes=record_routes, **keywords)
            rollouts, versions = decoded.rollouts, decoded.versions
        texts = completion_texts(tokenizer, rollouts, request.response_prefixes)
        prefilled, generated = int(rollouts.context_lengths.sum()), int(rollouts.lengths.sum())
    else:
        found, env_rewards = episodes(model, request, stop_ids=stop_ids, seed=seed,
                                      record_routes=record_routes, **keywords)
        rollouts = multi_turn.as_rollouts(found, request.n)
        prefilled, generated = map(sum, zip(*map(multi_turn.sampler_tokens, found)))
        texts = None if env_rewards is not None else [
            (request.response_prefixes[e.group] if request.response_prefixes and e.turns == 1
             else "") + multi_turn.final_answer(e, tokenizer) for e in found]
    boundaries.check_rollouts(rollouts, contexts=len(request.contexts), n=request.n)
    sampled = time.perf_counter()
    if env_rewards is not None:  # the environment's own, timed with its episodes
        return Scored(request, rollouts, env_rewards, 0, sampled - start, 0.0, 0, prefilled,
                      generated, found)
    scores, failures, too_long = score_rollouts(request, rollouts, scoring, texts)
    return Scored(request, rollouts, scores, failures, sampled - start,
                  time.perf_counter() - sampled, too_long, prefilled, generated, found, versions)


def score_rollouts(request: RolloutRequest, rollouts, scoring: RewardSettings,
                   texts: Sequence[str]) -> tuple[np.ndarray, int, int]:
    """(rewards [C, n], verifier failures, texts too long) of the request's rows by the run's
    verifier; texts: each row's response prefix + completion (`completion_texts`)."""
    problems = [request.problems[g] for g in rollouts.group_ids]
    scores, stats = rewards.score_batch(scoring.verifier, texts, problems,
                                        timeout_s=scoring.timeout_s, workers=scoring.workers,
                                        max_chars=scoring.max_chars)
    failures = int(stats.get("timeouts", 0)) + int(stats.get("errors", 0))
    return rollouts.grouped(scores).astype(np.float32), failures, int(stats["too_long"])


def round_seed(seed: int, step: int, round_index: int) -> int:
    """The sampler seed of one round: a pure function of (run seed, step, round)."""
    return (seed * 1_000_003 + step * 64 + round_index) % (2**31 - 1)


# --- metrics --------------------------------------------------------------------------------

def reward_metrics(scored: Scored) -> dict[str, float]:
    """reward/mean, solve rate, and both sides of every boolean tag (guided / unguided) with its
    contexts, over the method's own request (dynamic-sampling refills are counted in dynamic/*
    instead)."""
    r = scored.rewards
    out = {"reward/mean": float(r.mean()), "solve_rate": float((r > 0.5).any(1).mean()),
           "reward/verifier_failures": scored.verifier_failures,
           "reward/too_long": scored.too_long}
    for name, values in scored.request.tags.items():
        values = np.asarray(values)
        if values.dtype != bool:
            continue
        for label, chosen in ((name, values), (f"un{name}", ~values)):
            out[f"contexts/{label}"] = float(chosen.sum())  # POPE's guided share (issue 43)
            if chosen.any():
                out[f"reward/{label}"] = float(r[chosen].mean())
                out[f"solve_rate/{label}"] = float((r[chosen] > 0.5).any(1).mean())
    return out


def turn_metrics(chunks: list[Scored]) -> dict[str, float]:
    """rollout/* of a step's rollouts: tool calls, their failures, turns per episode, the
    tokens of earlier turns prefilled again and the calls a sandbox refused or a cap ended (a
    one-turn row is an episode of one turn)."""
    found = [e for c in chunks for e in (c.episodes or ())]
    if found:
        return multi_turn.episode_metrics(found)
    return {"rollout/tool_calls": 0.0, "rollout/tool_failures": 0.0, "rollout/turns_mean": 1.0,
            "rollout/reprefilled_tokens": 0.0, "rollout/sandbox_refusals": 0.0,
            "rollout/sandbox_kills": 0.0}


def evaluate(model, tokenizer, method, settings: LoopSettings, *, rollout: sampling.RolloutSpec,
             step: int, stop_ids,
             episodes: EpisodeSource | None = None) -> tuple[dict, dict]:
    """pass@k and friends on each of the method's (unguided) eval requests, and per request
    (samples per problem, correct samples of each problem) for eval_counts.jsonl; with
    `episodes`, of the run's episodes (a reward > 0.5 counted as a solve)."""
    from jaxprefix import evaluation

    out, counts = {}, {}
    for name, request in method.eval_requests().items():
        scored = sample_and_score(model, tokenizer, request, settings.rewards, rollout=rollout,
                                  stop_ids=stop_ids, seed=round_seed(settings.seed + 1, step, 0),
                                  episodes=episodes)
        summary = evaluation.summarize(scored.rewards, settings.eval.ks)
        out.update({f"{name}/{k}": float(v) for k, v in summary.items()})
        out.update(_reward_shares(name, scored.rewards))
        counts[name] = (request.n, [int(c) for c in (scored.rewards > 0.5).sum(axis=1)])
        if settings.eval.greedy:  # one greedy sample a problem: what a user sees
            greedy = sample_and_score(model, tokenizer, dataclasses.replace(request, n=1),
                                      settings.rewards,
                                      rollout=dataclasses.replace(rollout, temperature=0.0),
                                      stop_ids=stop_ids, seed=0, episodes=episodes)
            out[f"{name}_greedy/accuracy"] = float((greedy.rewards > 0.5).mean())
            out.update(_reward_shares(f"{name}_greedy", greedy.rewards))
            counts[f"{name}_greedy"] = (1, [int(c) for c in (greedy.rewards > 0.5).sum(axis=1)])
    return out, counts


def _reward_shares(name: str, rewards: np.ndarray) -> dict[str, float]:
    """The mean reward and the share of samples given the verifier's full reward (with a
    verifier that also values a format, the right answers in that format)."""
    return {f"{name}/reward_mean": float(rewards.mean()),
            f"{name}/full_reward": float((rewards >= 1.0 - 1e-6).mean())}
