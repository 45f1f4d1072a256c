"""Statistics of a study's score tables: sample std, crossed bootstrap intervals, zero-success
bounds, group breakdowns.

A score table is [seeds, problems]: one run type's per-problem scores (an unbiased pass@k from
n samples, say) at each seed. The design is CROSSED: every seed, and every arm of a comparison,
is evaluated on the SAME held-out problems, so a hard problem is hard at every seed and for
every arm. The intervals resample that design (Brennan's "boot-p,i" for a seeds x problems
table): each bootstrap draw picks seeds with replacement and, independently, ONE draw of the
problems with replacement, used for every drawn seed (and for both arms of a paired
comparison). A nested draw (a fresh problem resample per seed slot, this module before issue
28) averages S independent problem draws and divides the problem variance by S: on tables
where problems dominate it came out ~0.58x the crossed width. For a table y = m + r_s + c_p +
e_sp (its exact two-way decomposition) the crossed draw's variance is exactly
mean(r^2)/S + mean(c^2)/P + mean(e^2)/(S P) (`crossed_variance`); the test checks the draws
against it.

What the tables of docs/RESULTS.md report:

- `seed_std`: the sample std (ddof=1) of the per-seed means: the spread of a rerun.
- `bootstrap_interval`: a 95% percentile interval of the mean, seeds and problems resampled
  (crossed, above).
- `paired_difference_interval`: the same for the difference of two run types, PAIRED: each
  draw takes the same seed indices and the same problem indices for both, so what the problems
  share cancels.
- `zero_upper_bound`: a cell with no success at all states the one-sided 95% upper bound on the
  per-sample success rate over the samples behind it (exact binomial, Clopper-Pearson: for 0 of
  N it is 1 - 0.05^(1/N), ~3/N): "0.000 [0.000, 0.000]" alone hides what 0 of N bounds.
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


def _weights(n: int, resamples: int, rng) -> np.ndarray:
    """How often each of n units is drawn in each of `resamples` draws of n with replacement:
    [R, n] counts, each row summing to n."""
    return rng.multinomial(n, np.full(n, 1.0 / n), size=resamples).astype(np.float64)


def bootstrap_means(scores, *, resamples: int = RESAMPLES, seed: int = 0) -> np.ndarray:
    """The mean of each crossed bootstrap draw of a [seeds, problems] table: [resamples]. A
    draw's seed counts w [S] and problem counts v [P] (one problem draw for every seed) give
    the mean w^T table v / (S P)."""
    table = as_table(scores)
    seeds, problems = table.shape
    rng = np.random.default_rng(seed)
    w = _weights(seeds, resamples, rng)
    v = _weights(problems, resamples, rng)
    return ((w @ table) * v).sum(axis=1) / (seeds * problems)


def crossed_variance(scores) -> float:
    """The exact variance of the crossed bootstrap mean of a table: mean(r^2)/S + mean(c^2)/P
    + mean(e^2)/(S P), with r, c, e its seed effects, problem effects and residuals."""
    table = as_table(scores)
    seeds, problems = table.shape
    grand = table.mean()
    r = table.mean(axis=1) - grand
    c = table.mean(axis=0) - grand
    e = table - grand - r[:, None] - c[None, :]
    return float((r ** 2).mean() / seeds + (c ** 2).mean() / problems
                 + (e ** 2).mean() / (seeds * problems))


def percentile_interval(draws, level: float = LEVEL) -> tuple[float, float]:
    tail = (1.0 - level) / 2.0
    low, high = np.quantile(np.asarray(draws, float), [tail, 1.0 - tail], method="inverted_cdf")
    return float(low), float(high)


def bootstrap_interval(scores, *, level: float = LEVEL, resamples: int = RESAMPLES,
                       seed: int = 0) -> tuple[float, float]:
    """95% interval of the table's mean, seeds and problems resampled (crossed: one problem
    draw for every seed)."""
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


def zero_upper_bound(samples: int, level: float = LEVEL) -> float:
    """One-sided `level` upper bound on a per-sample success rate after 0 successes in
    `samples` (exact binomial, Clopper-Pearson): the p with (1 - p)^N = 1 - level."""
    if samples < 1:
        raise ValueError(f"an upper bound needs at least one sample, got {samples}")
    return float(1.0 - (1.0 - level) ** (1.0 / samples))


def summary(scores, *, samples: int | None = None, resamples: int = RESAMPLES,
            seed: int = 0) -> dict:
    """mean, sample std over seeds (ddof=1), 95% crossed bootstrap interval, per-seed means.
    `samples`: how many samples lie behind the whole table (seeds x problems x samples per
    problem); given and no cell of the table scores, 'upper' is the one-sided 95% bound on the
    per-sample rate (`zero_upper_bound`)."""
    table = as_table(scores)
    low, high = bootstrap_interval(table, resamples=resamples, seed=seed)
    out = {"mean": float(table.mean()), "std": seed_std(table), "low": low, "high": high,
           "per_seed": [float(m) for m in table.mean(axis=1)], "seeds": table.shape[0],
           "problems": table.shape[1]}
    if samples is not None and not table.any():
        out |= {"samples": int(samples), "upper": zero_upper_bound(samples)}
    return out


def zero_bound_note(samples: int) -> str:
    """' (rate < 4.9e-4, 0 of 6144)': what a cell with no success in `samples` bounds."""
    mantissa, exponent = f"{zero_upper_bound(samples):.1e}".split("e")
    return f" (rate < {mantissa}e{int(exponent)}, 0 of {samples})"


def format_cell(s: dict) -> str:
    """'0.341 ± 0.010 [0.300, 0.380]': mean ± sample std over seeds [95% bootstrap interval];
    a cell with no success adds its bound: '(rate < 4.9e-4, 0 of 6144)'."""
    std = "" if np.isnan(s["std"]) else f" ± {s['std']:.3f}"
    bound = zero_bound_note(s["samples"]) if "upper" in s else ""
    return f"{s['mean']:.3f}{std} [{s['low']:.3f}, {s['high']:.3f}]{bound}"
