"""Sample-efficiency metrics over n scored samples per problem: pass@k, avg@k, best@k, worst@k, maj@k.

Every metric is an estimate, from n >= k samples, of what k fresh samples would give, averaged
over problems:

- pass@k (Chen et al. 2021): P(at least one of k is correct), unbiased `1 - C(n-c, k) / C(n, k)`,
  computed as the product `1 - prod_{i=n-c+1}^{n} (1 - k/i)` so no binomial ever overflows.
- avg@k: the mean reward of k samples; its unbiased estimate is the mean over all n, for every k.
- best@k / worst@k (IsoCompute): E[max] / E[min] of the rewards of k samples. For rewards sorted
  ascending r_(1) <= ... <= r_(n), the max of a uniformly random k-subset is r_(i) with
  probability C(i-1, k-1) / C(n, k) (and the min with C(n-i, k-1) / C(n, k)): an exact, unbiased
  weighting of all n samples. For 0/1 rewards best@k is pass@k and worst@k is P(all k correct).
- maj@k: the majority answer of k samples is correct. It depends on which k, so it is averaged
  over all k-subsets when there are few (<= 2000), else over 2000 seeded random ones. Ties are
  broken at random in expectation (the share of tied answers that are correct).
"""

from __future__ import annotations

import collections
import itertools
import json
import math
import os
from collections.abc import Hashable, Sequence

import numpy as np

from jaxprefix import storage

MAJ_SUBSETS = 2000


def _check(n: int, k: int, what: str):
    if not 1 <= k <= n:
        raise ValueError(f"{what}: expected 1 <= k <= n samples, got k={k}, n={n}")


def pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
    """Unbiased P(at least one of k samples correct) from `num_correct` of `num_samples`."""
    n, c = int(num_samples), int(num_correct)
    _check(n, k, "pass_at_k")
    if not 0 <= c <= n:
        raise ValueError(f"pass_at_k: expected 0 <= num_correct <= num_samples, got {c} of {n}")
    if n - c < k:  # every k-subset holds a correct sample
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def order_weights(n: int, k: int) -> np.ndarray:
    """w[i] = P(the max of a random k-subset of n sorted items is item i) = C(i, k-1) / C(n, k).

    Built by the ratio w[i-1] / w[i] = (i - k + 1) / i from w[n-1] = k / n, in floats throughout.
    Reversed, the same weights give the min.
    """
    _check(n, k, "order_weights")
    weights = np.zeros(n)
    weights[n - 1] = k / n
    for i in range(n - 1, k - 1, -1):
        weights[i - 1] = weights[i] * (i - k + 1) / i
    return weights


def _as_matrix(values, name: str) -> np.ndarray:
    array = np.asarray(values, dtype=np.float64)
    if array.ndim != 2 or array.shape[1] == 0:
        raise ValueError(f"{name}: expected a [problems, samples] array, got shape {array.shape}")
    return array


def avg_at_k(rewards, k: int) -> float:
    """Mean reward of k samples, estimated from all n: the mean over the [P, n] rewards."""
    rewards = _as_matrix(rewards, "avg_at_k")
    _check(rewards.shape[1], k, "avg_at_k")
    return float(rewards.mean())


def best_at_k(rewards, k: int) -> float:
    """E[max reward over k samples], averaged over problems; rewards [P, n], any real values."""
    rewards = _as_matrix(rewards, "best_at_k")
    weights = order_weights(rewards.shape[1], k)
    return float((np.sort(rewards, axis=1) @ weights).mean())


def worst_at_k(rewards, k: int) -> float:
    """E[min reward over k samples], averaged over problems; rewards [P, n], any real values."""
    rewards = _as_matrix(rewards, "worst_at_k")
    weights = order_weights(rewards.shape[1], k)[::-1]
    return float((np.sort(rewards, axis=1) @ weights).mean())


def _majority_correct(answers: Sequence[Hashable | None], correct: Sequence[bool]) -> float:
    votes = collections.Counter(a for a in answers if a is not None)
    if not votes:
        return 0.0
    top = max(votes.values())
    winners = {a for a, v in votes.items() if v == top}
    # An answer's correctness is that of any sample giving it (they were scored alike).
    right = {a for a, ok in zip(answers, correct) if a in winners and ok}
    return len(right) / len(winners)


def maj_at_k(answers: Sequence[Sequence[Hashable | None]], correct, k: int, seed: int = 0) -> float:
    """P(the most frequent answer among k samples is correct); None answers do not vote.

    Args:
      answers: [P][n] hashable answer keys (e.g. `rewards.math.answer_key`), None for no answer.
      correct: [P, n] whether each sample was judged correct.
    """
    correct = _as_matrix(correct, "maj_at_k") > 0.5
    if len(answers) != correct.shape[0] or any(len(a) != correct.shape[1] for a in answers):
        raise ValueError(f"maj_at_k: answers must be [P][n] like correct {correct.shape}")
    n = correct.shape[1]
    _check(n, k, "maj_at_k")
    if math.comb(n, k) <= MAJ_SUBSETS:
        subsets = [list(s) for s in itertools.combinations(range(n), k)]
    else:
        rng = np.random.default_rng(seed)
        subsets = [rng.choice(n, size=k, replace=False) for _ in range(MAJ_SUBSETS)]
    scores = [
        np.mean([_majority_correct([row[i] for i in s], ok[s]) for s in subsets])
        for row, ok in zip(answers, correct)
    ]
    return float(np.mean(scores))


def summarize(rewards, ks: Sequence[int], answers=None, threshold: float = 0.5) -> dict[str, float]:
    """All metrics for each k <= n, from rewards [P, n] (a sample is correct if reward > threshold).

    Keys: 'pass@k', 'avg@k', 'best@k', 'worst@k' and, given answer keys [P][n], 'maj@k';
    plus 'num_problems', 'num_samples' and 'solved_fraction' (problems with any correct sample).
    """
    rewards = _as_matrix(rewards, "summarize")
    num_problems, n = rewards.shape
    correct = rewards > threshold
    num_correct = correct.sum(axis=1)
    report = {"num_problems": num_problems, "num_samples": n,
              "solved_fraction": float((num_correct > 0).mean())}
    for k in ks:
        if k > n:
            continue
        report[f"pass@{k}"] = float(np.mean([pass_at_k(n, c, k) for c in num_correct]))
        report[f"avg@{k}"] = avg_at_k(rewards, k)
        report[f"best@{k}"] = best_at_k(rewards, k)
        report[f"worst@{k}"] = worst_at_k(rewards, k)
        if answers is not None:
            report[f"maj@{k}"] = maj_at_k(answers, correct, k)
    return report


def per_problem(problem_ids: Sequence[str], rewards, threshold: float = 0.5) -> list[dict]:
    """One row per problem: its id, samples, correct samples and mean reward (for hard-set mining)."""
    rewards = _as_matrix(rewards, "per_problem")
    if len(problem_ids) != rewards.shape[0]:
        raise ValueError(f"per_problem: {len(problem_ids)} ids for {rewards.shape[0]} reward rows")
    return [{"id": pid, "samples": int(row.size), "correct": int((row > threshold).sum()),
             "mean_reward": float(row.mean())} for pid, row in zip(problem_ids, rewards)]


def evaluate_completions(problems: Sequence, completions: Sequence[Sequence[str]], *,
                         verifier: str = "math", ks: Sequence[int] = (1, 4, 8, 16, 32, 64),
                         timeout_s: float = 10.0, workers: int | None = None) -> dict:
    """Scores n completions per problem with a registered verifier and summarises them.

    Returns {'metrics': summarize(...) (maj@k from math answer keys), 'verifier': its timeout and
    error counts, 'problems': per_problem(...)}: one mode (unguided or guided) of an eval report.
    """
    from jaxprefix import rewards  # evaluation's metrics need no verifiers; only this does
    from jaxprefix.rewards.math import answer_key

    if len(problems) != len(completions) or len({len(c) for c in completions}) > 1:
        raise ValueError(f"evaluate_completions: expected n completions for each of {len(problems)} "
                         f"problems, got {[len(c) for c in completions]}")
    n = len(completions[0]) if completions else 0
    texts = [text for row in completions for text in row]
    flat_problems = [problem for problem in problems for _ in range(n)]
    scores, stats = rewards.score_batch(verifier, texts, flat_problems, timeout_s=timeout_s,
                                        workers=workers)
    scores = scores.reshape(len(problems), n)
    answers = [[answer_key(text) for text in row] for row in completions]
    return {"metrics": summarize(scores, ks, answers), "verifier": stats,
            "problems": per_problem([p.id for p in problems], scores)}


def write_report(path: str | os.PathLike, report: dict) -> None:
    """Writes `report` as indented JSON, atomically (a reader never sees half a report)."""
    storage.write_atomic(os.fspath(path), json.dumps(report, indent=2, sort_keys=True))
