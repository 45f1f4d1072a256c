"""Statistics of a study's score tables: sample std, paired bootstrap intervals, group breakdowns.

A score table is [seeds, problems]: one run type's per-problem scores (an unbiased pass@k from
n samples, say) at each seed, every seed evaluated on the same problems. What the tables of
docs/RESULTS.md report:

- `seed_std`: the sample std (ddof=1) of the per-seed means: the spread of a rerun.
- `bootstrap_interval`: a 95% percentile interval of the mean, resampling seeds and then
  problems with replacement (two-stage): both the RL seed and the choice of problems vary.
- `paired_difference_interval`: the same for the difference of two run types, PAIRED: each
  bootstrap draw takes the same seed indices and the same problem indices for both, so what
  the problems share (a hard problem is hard for both) cancels.
- `group_table`: per group (a multiplier, a digit count), the problems and their mean; the
  problem-weighted sum of the group means is the overall mean (`overall_from_groups`).

Percentiles are the inverted CDF of the bootstrap draws (numpy 'inverted_cdf'): the interval's
ends are draws themselves, so a hand enumeration of all resamples of a small table gives
the same ends as enough random draws.
"""
from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np

from jaxprefix.evaluation import pass_at_k

RESAMPLES = 10_000
LEVEL = 0.95


def as_table(scores) -> np.ndarray:
    """[seeds, problems] floats; a 1-D table is one seed."""
    table = np.asarray(scores, dtype=np.float64)
    if table.ndim == 1:
        table = table[None, :]
    if table.ndim != 2 or 0 in table.shape:
        raise ValueError(f"expected a [seeds, problems] score table, got shape {table.shape}")
    return table


def pass_at_k_table(correct_counts, n: int, k: int) -> np.ndarray:
    """[seeds, problems] unbiased pass@k of each problem from its correct counts of n samples."""
    counts = np.asarray(correct_counts, dtype=np.int64)
    return np.vectorize(lambda c: pass_at_k(n, int(c), k), otypes=[float])(counts)


def seed_std(scores) -> float:
    """Sample std (ddof=1) of the per-seed means; nan for one seed."""
    means = as_table(scores).mean(axis=1)
    return float(means.std(ddof=1)) if len(means) > 1 else float("nan")


def _draws(seeds: int, problems: int, resamples: int, seed: int):
    """Seed and problem indices of each bootstrap draw: [R, S] and [R, S, P]."""
    rng = np.random.default_rng(seed)
    seed_idx = rng.integers(0, seeds, size=(resamples, seeds))
    problem_idx = rng.integers(0, problems, size=(resamples, seeds, problems))
    return seed_idx, problem_idx


def bootstrap_means(scores, *, resamples: int = RESAMPLES, seed: int = 0) -> np.ndarray:
    """The mean of each two-stage bootstrap draw of a [seeds, problems] table: [resamples]."""
    table = as_table(scores)
    seed_idx, problem_idx = _draws(*table.shape, resamples, seed)
    rows = table[seed_idx]  # [R, S, P]: the drawn seeds' rows
    return np.take_along_axis(rows, problem_idx, axis=2).mean(axis=(1, 2))


def percentile_interval(draws, level: float = LEVEL) -> tuple[float, float]:
    tail = (1.0 - level) / 2.0
    low, high = np.quantile(np.asarray(draws, float), [tail, 1.0 - tail], method="inverted_cdf")
    return float(low), float(high)


def bootstrap_interval(scores, *, level: float = LEVEL, resamples: int = RESAMPLES,
                       seed: int = 0) -> tuple[float, float]:
    """95% interval of the table's mean, seeds and problems resampled."""
    return percentile_interval(bootstrap_means(scores, resamples=resamples, seed=seed), level)


def paired_difference_interval(scores_a, scores_b, *, level: float = LEVEL,
                               resamples: int = RESAMPLES, seed: int = 0) -> tuple[float, float]:
    """95% interval of mean(a) - mean(b), the same seeds and problems drawn for both."""
    a, b = as_table(scores_a), as_table(scores_b)
    if a.shape != b.shape:
        raise ValueError(f"paired tables must have one shape, got {a.shape} and {b.shape} "
                         f"(the same seeds, the same problems in the same order)")
    return bootstrap_interval(a - b, level=level, resamples=resamples, seed=seed)


def group_table(scores, groups: Sequence[Hashable]) -> dict:
    """Per group: {'problems': count, 'mean': mean over seeds and the group's problems}; keys
    sorted. `groups[p]` is problem p's group."""
    table = as_table(scores)
    labels = list(groups)
    if len(labels) != table.shape[1]:
        raise ValueError(f"{len(labels)} group labels for {table.shape[1]} problems")
    out = {}
    for label in sorted(set(labels)):
        columns = [i for i, g in enumerate(labels) if g == label]
        out[label] = {"problems": len(columns), "mean": float(table[:, columns].mean())}
    return out


def overall_from_groups(groups: dict) -> float:
    """The overall mean from a group_table: the group means weighted by their problems."""
    total = sum(g["problems"] for g in groups.values())
    return sum(g["problems"] * g["mean"] for g in groups.values()) / total


def summary(scores, *, resamples: int = RESAMPLES, seed: int = 0) -> dict:
    """mean, sample std over seeds (ddof=1), 95% bootstrap interval, per-seed means."""
    table = as_table(scores)
    low, high = bootstrap_interval(table, resamples=resamples, seed=seed)
    return {"mean": float(table.mean()), "std": seed_std(table), "low": low, "high": high,
            "per_seed": [float(m) for m in table.mean(axis=1)], "seeds": table.shape[0],
            "problems": table.shape[1]}


def format_cell(s: dict) -> str:
    """'0.341 ± 0.010 [0.30, 0.38]': mean ± sample std over seeds [95% bootstrap interval]."""
    std = "" if np.isnan(s["std"]) else f" ± {s['std']:.3f}"
    return f"{s['mean']:.3f}{std} [{s['low']:.3f}, {s['high']:.3f}]"
