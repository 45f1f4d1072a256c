"""Probing a policy: k samples of many contexts, scored by a verifier, with the compute counted.

Mining a hard set (POPE), searching the shortest solvable prefix (POPE), rejection sampling a
trace pool (PrefixRL) and evaluating pass@k all ask one question: how often does this policy solve
these contexts in k tries? `Prober.probe` answers it in chunks that fit one sampler call, keeps
the first successful completion of each context when asked, and records every sampled token in a
`ComputeLedger`, so that no method's extra sampling goes uncounted.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
from tqdm.auto import tqdm

from jaxprefix import rewards, sampling
from jaxprefix.data.problem import Problem
from jaxprefix.rl.compute_ledger import ComputeLedger
from jaxprefix.rl import boundaries
from jaxprefix.rl.scoring import completion_texts
from jaxprefix.sampling import RolloutSpec


@dataclasses.dataclass(frozen=True)
class ProbeResult:
    """Per context: which of the k samples were correct, and a successful completion if any."""

    correct: np.ndarray  # bool [C, k]
    first_success: list  # per context: completion token ids of its first correct sample, or None
    verifier_failures: int  # samples whose verifier crashed or timed out (scored 0)

    @property
    def num_correct(self) -> np.ndarray:
        return self.correct.sum(axis=1)


class Prober:
    """Samples and scores a policy; every sampled token is recorded in `ledger`."""

    def __init__(self, model, tokenizer, spec: RolloutSpec, *, stop_ids: Sequence[int],
                 verifier: str,
                 ledger: ComputeLedger, rows_per_call: int = 1024, verifier_timeout_s: float = 10.0,
                 verifier_max_chars: int = rewards.MAX_CHARS, progress: bool = True):
        self.model = model
        self.tokenizer = tokenizer
        self.spec = spec
        self.stop_ids = tuple(stop_ids)
        self.verifier = verifier
        self.ledger = ledger
        self.rows_per_call = rows_per_call
        self.verifier_timeout_s = verifier_timeout_s
        self.verifier_max_chars = verifier_max_chars
        self.progress = progress

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
            boundaries.check_contexts(contexts[start:stop], vocab_size=self.model.config.vocab_size)
            rollouts = sampling.generate(
                self.model, list(contexts[start:stop]), n=k, stop_ids=self.stop_ids,
                seed=seed * 1_000_003 + chunk_index, **self.spec.sampler_keywords())
            prefixes = None if response_prefixes is None else list(response_prefixes[start:stop])
            texts = completion_texts(self.tokenizer, rollouts, prefixes)
            row_problems = [problems[start + g] for g in rollouts.group_ids]
            scores, stats = rewards.score_batch(self.verifier, texts, row_problems,
                                                timeout_s=self.verifier_timeout_s,
                                                max_chars=self.verifier_max_chars)
            failures += stats["timeouts"] + stats["errors"] + stats["too_long"]
            chunk_correct = np.asarray(scores).reshape(stop - start, k) > 0.5
            correct[start:stop] = chunk_correct
            self._record(rollouts, extra_compute)
            if keep_successes:
                completions = rollouts.completions(keep_stop=True)  # traces end on it
                for g, row in zip(*np.nonzero(chunk_correct)):
                    if first_success[start + g] is None:
                        first_success[start + g] = list(completions[g * k + row])
        return ProbeResult(correct, first_success, failures)

    def _record(self, rollouts: sampling.Rollouts, extra: bool) -> None:
        generated = int(rollouts.lengths.sum())
        # The paper's accounting: D = context + generated tokens of every rollout.
        tokens = int(rollouts.context_lengths.sum()) + generated
        if extra:
            self.ledger.record_extra_sampling(rollouts=len(rollouts.lengths), tokens=tokens)
        else:
            self.ledger.record_sampling(rollouts=len(rollouts.lengths),
                                        prefill_tokens=int(rollouts.context_lengths.sum()),
                                        generated_tokens=generated)
