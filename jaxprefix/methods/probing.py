"""Probing a policy: k samples of many contexts, scored by a verifier, with the compute counted.

Mining a hard set (POPE), searching the shortest solvable prefix (POPE), rejection sampling a
trace pool (PrefixRL) and evaluating pass@k all ask one question: how often does this policy solve
these contexts in k tries? `Prober.probe` answers it in chunks that fit one sampler call, keeps
the first successful completion of each context when asked, and records every sampled token in a
`ComputeLedger`, so that no method's extra sampling goes uncounted. A sample is what the run's
RL samples (rl/scoring.sample_and_score): one turn, or, given the run's tool episodes, an episode
whose final answer is scored (a success then holds its tools' observations, masked apart).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
from tqdm.auto import tqdm

from jaxprefix import rewards
from jaxprefix.data.problem import Problem
from jaxprefix.rl.compute_ledger import ComputeLedger
from jaxprefix.rl.loop_settings import RewardSettings
from jaxprefix.rl.scoring import EpisodeSource, RolloutRequest, sample_and_score
from jaxprefix.sampling import RolloutSpec


@dataclasses.dataclass(frozen=True)
class Success:
    """A correct sample's tokens after its context, and which of them the policy sampled (1) or
    a tool's observation appended (0; all 1 for a sample of one turn)."""
    tokens: list
    sampled: list

    def without_stop(self, stop_ids) -> "Success":
        """Without the stop token it ends on: the policy's to write, not a prefix's."""
        if self.tokens and self.tokens[-1] in stop_ids:
            return Success(self.tokens[:-1], self.sampled[:-1])
        return self


@dataclasses.dataclass(frozen=True)
class ProbeResult:
    """Per context: which of the k samples were correct, and a successful completion if any."""

    correct: np.ndarray  # bool [C, k]
    first_success: list  # per context: the Success of its first correct sample, or None
    verifier_failures: int  # samples whose verifier crashed, timed out or ran too long (scored 0)

    @property
    def num_correct(self) -> np.ndarray:
        return self.correct.sum(axis=1)


class Prober:
    """Samples and scores a policy; every sampled token is recorded in `ledger`."""

    def __init__(self, model, tokenizer, spec: RolloutSpec, *, stop_ids: Sequence[int],
                 verifier: str,
                 ledger: ComputeLedger, rows_per_call: int = 1024, verifier_timeout_s: float = 10.0,
                 verifier_max_chars: int = rewards.MAX_CHARS, progress: bool = True,
                 episodes: EpisodeSource | None = None):
        self.model = model
        self.tokenizer = tokenizer
        self.spec = spec
        self.stop_ids = tuple(stop_ids)
        self.scoring = RewardSettings(verifier, verifier_timeout_s, max_chars=verifier_max_chars)
        self.ledger = ledger
        self.rows_per_call = rows_per_call
        self.progress = progress
        self.episodes = episodes  # the run's tool episodes (None: one turn a sample)

    def probe(self, contexts: Sequence, problems: Sequence[Problem], k: int, *, seed: int,
              response_prefixes: Sequence[str] | None = None, keep_successes: bool = False,
              description: str = "probing", extra_compute: bool = True) -> ProbeResult:
        """k samples of each context, scored against its problem.

        `response_prefixes[i]`, when given, is the text of context i's unfinished answer: the
        verifier judges prefix + completion. `extra_compute` books the samples as sampling outside
        the RL updates (mining, trace pools, evaluation), not as training rollouts.
        """
        if len(contexts) != len(problems):
            raise ValueError(f"{len(contexts)} contexts but {len(problems)} problems")
        per_call = max(1, self.rows_per_call // k)
        correct = np.zeros((len(contexts), k), bool)
        first_success: list = [None] * len(contexts)
        failures = 0
        chunks = range(0, len(contexts), per_call)
        for chunk_index, start in enumerate(tqdm(chunks, desc=description, unit="chunk",
                                                 disable=not self.progress, leave=False)):
            stop = min(start + per_call, len(contexts))
            prefixes = None if response_prefixes is None else list(response_prefixes[start:stop])
            request = RolloutRequest(list(contexts[start:stop]), list(problems[start:stop]), {},
                                     k, prefixes)
            scored = sample_and_score(self.model, self.tokenizer, request, self.scoring,
                                      rollout=self.spec, seed=seed * 1_000_003 + chunk_index,
                                      stop_ids=self.stop_ids, episodes=self.episodes)
            failures += scored.verifier_failures + scored.too_long
            chunk_correct = scored.rewards > 0.5
            correct[start:stop] = chunk_correct
            self._record(scored, extra_compute)
            if keep_successes:
                for g, row in zip(*np.nonzero(chunk_correct)):
                    if first_success[start + g] is None:
                        first_success[start + g] = _success(scored.rollouts, g * k + row)
        return ProbeResult(correct, first_success, failures)

    def _record(self, scored, extra: bool) -> None:
        # The paper's accounting: D = context + generated tokens of every rollout (an episode's
        # observations and any re-prefill among the prefilled).
        rows = len(scored.rollouts.lengths)
        if extra:
            self.ledger.record_extra_sampling(rollouts=rows,
                                              tokens=scored.prefilled + scored.generated)
        else:
            self.ledger.record_sampling(rollouts=rows, prefill_tokens=scored.prefilled,
                                        generated_tokens=scored.generated)


def _success(rollouts, row: int) -> Success:
    """Row `row`'s tokens after its context (its stop token kept: a trace ends on it) and their
    sampled mask."""
    start = int(rollouts.context_lengths[row])
    end = start + int(rollouts.lengths[row])
    return Success(rollouts.tokens[row, start:end].tolist(),
                   rollouts.completion_mask[row, start:end].tolist())
