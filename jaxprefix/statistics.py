"""Statistics of a study's score tables: sample std, 95% intervals of a crossed table's mean,
zero-success bounds, group breakdowns.

A score table is [seeds, problems]: one run type's per-problem scores (an unbiased pass@k from
n samples, say) at each seed. The design is CROSSED: every seed, and every arm of a comparison,
is evaluated on the SAME held-out problems, so a hard problem is hard at every seed and for
every arm. The mean's target is the population one (a fresh seed, a fresh problem), and the
table is the two-way random-effects model y_sp = m + r_s + c_p + e_sp, whose mean has

    Var(mean) = s2_seed/S + s2_problem/P + s2_resid/(S P) = E[MS_seed + MS_problem - MS_resid]/(S P)

from the ANOVA mean squares (MS_seed = P var(seed means), MS_problem = S var(problem means),
MS_resid the interaction's, with S-1, P-1 and (S-1)(P-1) degrees of freedom).

The interval (issue 43): at 3-5 seeds the seed mean square has 2-4 degrees of freedom, and
what the interval may claim hinges on it. The crossed bootstrap used before (one draw of the
seeds, one of the problems) cannot show seed variance from 3 values: on synthetic tables it
covered the true mean 0.74-0.89 of the time when seeds dominate, and 0.99-1.00 when the
residual does. Two standard small-sample answers built on the mean squares bracket 95% here:

- `satterthwaite_interval`: a t-interval on the estimate above with Satterthwaite's degrees of
  freedom. Anti-conservative at 3 seeds (0.92-0.93 when seeds carry most of the variance): the
  estimated df rise exactly when the seed mean square comes out small, i.e. when the interval
  is already too narrow.
- `pivot_interval`: the generalized pivot (Weerahandi's fiducial interval for a sum of
  variance components): each mean square is redrawn as MS x df / chi2(df), the pivot
  mean - z sqrt(Var~) taken over the draws. Exact (a t_{S-1}) when seeds alone matter;
  conservative (0.97-0.98) when problems dominate at 3 seeds, from the heavy tail of
  MS_seed x 2 / chi2(2).

`crossed_interval`, what the tables report, takes the mean of the two intervals' ends: its
coverage measured on synthetic crossed tables (tests/test_statistics.py: Gaussian tables with
seed-, problem- and residual-dominated variance, and binomial pass@1 tables, at 3 and 5 seeds
and 64-256 problems) is 0.94-0.97 in every regime (2,000 tables a cell, sd 0.005; at worst
0.976 in one run of 5 seeds x 64 problems with the residual dominating, where its true value
sits at the band's top). Its width is that of the design: at 3 seeds, when seeds matter, the
interval is ~t(2)/1.96 ~ 2x the normal one, and that is what the data can say. Rules at the
edges:

- ONE seed (the base's single evaluation, the demo): no seed variance can be estimated; the
  interval is the one-sample t over the problem means (df P-1). It covers the mean over
  problems at that seed, not a rerun's.
- Clipped to the scale: a score lies in [0, 1], a paired difference in [-1, 1].
- A constant table (all zeros: nothing succeeded) has no spread to estimate: its interval is
  (c, c), and the tables state what the samples bound instead (`zero_upper_bound`). A
  non-constant table whose ANOVA estimate comes out <= 0 keeps a width: the Satterthwaite end
  collapses to the mean, the pivot's does not.
- Very low rates: with a handful of successes in the whole table the normal-theory interval
  under-covers (0/1 tables at P(success) ~0.01, 3 seeds x 64 problems: 0.84, 11% of them all
  zeros); from ~10 successes on it is in the band (the same rate at 3 x 128: 0.94). A cell
  with fewer says so only through its counts; read it with `zero_upper_bound`'s logic, not its
  interval.

What the tables of docs/RESULTS.md report:

- `seed_std`: the sample std (ddof=1) of the per-seed means: the spread of a rerun.
- `bootstrap_interval` (its name a contract from before issue 43): the 95% `crossed_interval`
  of the table's mean.
- `paired_difference_interval`: the same on the difference table a - b, PAIRED: the same seed
  and problem in both, so what the problems share cancels.
- `zero_upper_bound`: a cell with no success at all states the one-sided 95% upper bound on the
  per-sample success rate over the samples behind it (exact binomial, Clopper-Pearson: for 0 of
  N it is 1 - 0.05^(1/N), ~3/N): "0.000 [0.000, 0.000]" alone hides what 0 of N bounds.
- `group_table`: per group (a multiplier, a digit count), the problems and their mean; the
  problem-weighted sum of the group means is the overall mean (`overall_from_groups`).

`percentile_interval` stays for a bootstrap of a fitted statistic (jobs/isocompute_prereg.py's
n* span), where no mean-square formula applies.
"""
from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np
from scipy import stats as scipy_stats

from jaxprefix.evaluation import pass_at_k

RESAMPLES = 10_000  # the generalized pivot's draws
LEVEL = 0.95
SCORE_RANGE = (0.0, 1.0)
DIFFERENCE_RANGE = (-1.0, 1.0)


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


def mean_squares(tables) -> tuple[np.ndarray, ...]:
    """The two-way ANOVA of [..., S, P] tables (S, P >= 2): (mean, MS_seed, MS_problem,
    MS_resid), each [...]."""
    tables = np.asarray(tables, np.float64)
    seeds, problems = tables.shape[-2:]
    grand = tables.mean(axis=(-2, -1), keepdims=True)
    seed_means = tables.mean(axis=-1, keepdims=True)
    problem_means = tables.mean(axis=-2, keepdims=True)
    ms_seed = problems * ((seed_means - grand) ** 2).sum(axis=(-2, -1)) / (seeds - 1)
    ms_problem = seeds * ((problem_means - grand) ** 2).sum(axis=(-2, -1)) / (problems - 1)
    resid = tables - seed_means - problem_means + grand
    ms_resid = (resid ** 2).sum(axis=(-2, -1)) / ((seeds - 1) * (problems - 1))
    return grand[..., 0, 0], ms_seed, ms_problem, ms_resid


def mean_variance(tables) -> np.ndarray:
    """The ANOVA estimate of Var(mean): (MS_seed + MS_problem - MS_resid) / (S P), floored at 0."""
    seeds, problems = np.shape(tables)[-2:]
    _, ms_seed, ms_problem, ms_resid = mean_squares(tables)
    return np.maximum(ms_seed + ms_problem - ms_resid, 0.0) / (seeds * problems)


def satterthwaite_interval(tables, level: float = LEVEL) -> tuple[np.ndarray, np.ndarray]:
    """mean -+ t(df) sqrt(`mean_variance`), df = (sum_i c_i MS_i)^2 / sum_i c_i^2 MS_i^2 / df_i."""
    seeds, problems = np.shape(tables)[-2:]
    mean, ms_seed, ms_problem, ms_resid = mean_squares(tables)
    total = np.maximum(ms_seed + ms_problem - ms_resid, 0.0)
    spread = (ms_seed ** 2 / (seeds - 1) + ms_problem ** 2 / (problems - 1)
              + ms_resid ** 2 / ((seeds - 1) * (problems - 1)))
    df = np.where(spread > 0, total ** 2 / np.where(spread > 0, spread, 1.0), np.inf)
    half = scipy_stats.t.ppf(0.5 + level / 2, np.maximum(df, 1.0)) * np.sqrt(
        total / (seeds * problems))
    return mean - half, mean + half


def pivot_interval(tables, level: float = LEVEL, *, resamples: int = RESAMPLES,
                   seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """The generalized pivot's interval: each mean square redrawn as MS df / chi2(df), the
    ends the quantiles of mean - z sqrt(Var~). The draws are the same for every table (`seed`)."""
    seeds, problems = np.shape(tables)[-2:]
    mean, ms_seed, ms_problem, ms_resid = mean_squares(tables)
    rng = np.random.default_rng(seed)
    dfs = (seeds - 1, problems - 1, (seeds - 1) * (problems - 1))
    # Antithetic pairs (z, u) and (-z, u): the pivot is symmetric, and so are its ends.
    seed_u, problem_u, resid_u = (np.tile(df / rng.chisquare(df, resamples // 2), 2)
                                  for df in dfs)
    z = rng.standard_normal(resamples // 2)
    z = np.concatenate([z, -z])
    variance = (ms_seed[..., None] * seed_u + ms_problem[..., None] * problem_u
                - ms_resid[..., None] * resid_u) / (seeds * problems)
    pivot = z * np.sqrt(np.maximum(variance, 0.0))
    tail = (1.0 - level) / 2.0
    low, high = np.quantile(pivot, [tail, 1.0 - tail], axis=-1)
    return mean - high, mean - low


def crossed_interval(tables, level: float = LEVEL, *, bounds=SCORE_RANGE,
                     resamples: int = RESAMPLES, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """The reported 95% interval of the mean of [..., S, P] tables: the mean of the
    Satterthwaite and generalized-pivot intervals' ends (module docstring), clipped to
    `bounds`; one seed (S = 1): the one-sample t over the problems."""
    tables = np.asarray(tables, np.float64)
    seeds, problems = tables.shape[-2:]
    if seeds == 1 or problems == 1:
        values = tables.reshape(*tables.shape[:-2], seeds * problems)
        mean = values.mean(axis=-1)
        if values.shape[-1] == 1:
            return np.clip(mean, *bounds), np.clip(mean, *bounds)
        half = scipy_stats.t.ppf(0.5 + level / 2, values.shape[-1] - 1) * np.sqrt(
            values.var(axis=-1, ddof=1) / values.shape[-1])
        return np.clip(mean - half, *bounds), np.clip(mean + half, *bounds)
    (t_low, t_high) = satterthwaite_interval(tables, level)
    (p_low, p_high) = pivot_interval(tables, level, resamples=resamples, seed=seed)
    return (np.clip((t_low + p_low) / 2, *bounds), np.clip((t_high + p_high) / 2, *bounds))


def percentile_interval(draws, level: float = LEVEL) -> tuple[float, float]:
    tail = (1.0 - level) / 2.0
    low, high = np.quantile(np.asarray(draws, float), [tail, 1.0 - tail], method="inverted_cdf")
    return float(low), float(high)


def bootstrap_interval(scores, *, level: float = LEVEL, resamples: int = RESAMPLES,
                       seed: int = 0) -> tuple[float, float]:
    """95% interval of a [seeds, problems] score table's mean (`crossed_interval`; the name is
    kept from the bootstrap it replaced)."""
    low, high = crossed_interval(as_table(scores), level, resamples=resamples, seed=seed)
    return float(low), float(high)


def paired_difference_interval(scores_a, scores_b, *, level: float = LEVEL,
                               resamples: int = RESAMPLES, seed: int = 0) -> tuple[float, float]:
    """95% interval of mean(a) - mean(b) from the paired difference table a - b."""
    a, b = as_table(scores_a), as_table(scores_b)
    if a.shape != b.shape:
        raise ValueError(f"paired tables must have one shape, got {a.shape} and {b.shape} "
                         f"(the same seeds, the same problems in the same order)")
    low, high = crossed_interval(a - b, level, bounds=DIFFERENCE_RANGE, resamples=resamples,
                                 seed=seed)
    return float(low), float(high)


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
    """mean, sample std over seeds (ddof=1), 95% interval (`crossed_interval`), per-seed means.
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
    """'0.341 ± 0.010 [0.300, 0.380]': mean ± sample std over seeds [95% interval];
    a cell with no success adds its bound: '(rate < 4.9e-4, 0 of 6144)'."""
    std = "" if np.isnan(s["std"]) else f" ± {s['std']:.3f}"
    bound = zero_bound_note(s["samples"]) if "upper" in s else ""
    return f"{s['mean']:.3f}{std} [{s['low']:.3f}, {s['high']:.3f}]{bound}"
