"""The tables of a study's runs, with their statistics (jaxprefix/statistics.py), as markdown.

A row is a label and the evaluations of one run type at each seed (the results job's records,
or the base's single evaluation); an evaluation holds each problem's correct samples
(`correct_counts`, of `num_samples`) and its difficulty knobs (`groups`). Every cell is the
mean, the sample std over seeds (ddof=1) and a 95% interval of the crossed table's mean
(statistics.crossed_interval, from the seeds' and the problems' variance components); a cell
with no success also states its one-sided 95% upper bound on the per-sample rate over the
samples behind it. Differences are paired (the interval of the difference table, the same
seed and problem in both runs).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from jaxprefix import statistics
from jaxprefix.rl.compute_ledger import ComputeLedger


@dataclass(frozen=True)
class Row:
    label: str
    evals: list          # per seed: {'eval': evaluation, ...}-like records
    flops: list = ()     # per seed: FLOPs spent (mining and SFT included)


@dataclass(frozen=True)
class Column:
    header: str
    which: str           # the record's evaluation: 'after', 'after_hard_set', 'base', ...
    k: int               # pass@k


def run_rows(runs: dict) -> list[Row]:
    """One Row per run name of `runs` (name -> records of its seeds, finished ones only)."""
    rows = []
    for name, records in runs.items():
        done = [r for r in records if "after" in r]
        if done:
            rows.append(Row(name, done, [ComputeLedger.from_dict(r["ledger"]).total_flops
                                         for r in done]))
    return rows


def table(row: Row, column: Column) -> np.ndarray:
    """[seeds, problems] pass@k of each problem from each seed's correct counts."""
    evals = [r[column.which] for r in row.evals]
    counts = [e["correct_counts"] for e in evals]
    return statistics.pass_at_k_table(counts, evals[0]["num_samples"], column.k)


def samples(row: Row, column: Column) -> int:
    """The samples behind a cell: per seed, its problems x samples per problem."""
    evals = [r[column.which] for r in row.evals]
    return sum(len(e["correct_counts"]) * e["num_samples"] for e in evals)


def cell(row: Row, column: Column) -> str:
    return statistics.format_cell(statistics.summary(table(row, column),
                                                     samples=samples(row, column)))


def _flops_cell(flops) -> str:
    if not len(flops):
        return "0"
    flops = np.asarray(flops, float)
    return f"{flops.mean():.3g}" + (f" ± {flops.std(ddof=1):.2g}" if len(flops) > 1 else "")


def metric_table(rows: list[Row], columns: list[Column]) -> list[str]:
    """| run | seeds | column cells | FLOPs |."""
    lines = ["| run | seeds | " + " | ".join(c.header for c in columns) + " | FLOPs |",
             "|---" * (len(columns) + 3) + "|"]
    for row in rows:
        cells = [cell(row, c) for c in columns]
        lines.append(f"| {row.label} | {len(row.evals)} | " + " | ".join(cells)
                     + f" | {_flops_cell(row.flops)} |")
    return lines


def paired_tables(a: Row, b: Row, column: Column) -> tuple[np.ndarray, np.ndarray]:
    """a's and b's tables, seed for seed; a single-seed row (the base) pairs with every seed."""
    ta, tb = table(a, column), table(b, column)
    if len(ta) != len(tb):
        ta, tb = (np.repeat(ta, len(tb), 0), tb) if len(ta) == 1 else (ta, np.repeat(tb, len(ta), 0))
    return ta, tb


def paired(a: Row, b: Row, column: Column) -> np.ndarray:
    """a - b, per seed and problem (`paired_tables`)."""
    ta, tb = paired_tables(a, b, column)
    return ta - tb


def difference_cell(a: Row, b: Row, column: Column, margin: float = 0.0) -> str:
    ta, tb = paired_tables(a, b, column)
    diff = ta - tb
    low, high = statistics.paired_difference_interval(ta, tb)
    return f"{diff.mean():+.3f} [{low:+.3f}, {high:+.3f}] ({verdict(low, high, margin)})"


def comparison_table(pairs: list[tuple[Row, Row]], columns: list[Column],
                     margin: float = 0.0) -> list[str]:
    """| a - b | paired difference of each column [95% interval] (what the interval says, a
    tie only inside the `margin` registered before the runs) | FLOPs of a / FLOPs of b |."""
    lines = ["| comparison | " + " | ".join(f"Δ {c.header}" for c in columns)
             + " | FLOPs ratio |", "|---" * (len(columns) + 2) + "|"]
    for a, b in pairs:
        ratio = (f"{np.mean(a.flops) / np.mean(b.flops):.2f}"
                 if len(a.flops) and len(b.flops) and np.mean(b.flops) > 0 else "-")
        lines.append(f"| {a.label} − {b.label} | "
                     + " | ".join(difference_cell(a, b, c, margin) for c in columns)
                     + f" | {ratio} |")
    return lines


def group_table(rows: list[Row], column: Column, key: str) -> list[str]:
    """The column's mean per difficulty group (`key`: 'multiplier', 'digits') and overall:
    the problem-weighted sum of a row's group means is its overall mean."""
    labels = rows[0].evals[0][column.which]["groups"][key]
    groups = sorted(set(labels))
    header = " | ".join(f"{key} {g} ({labels.count(g)})" for g in groups)
    lines = [f"| {column.header} by {key} (problems) | {header} | overall |",
             "|---" * (len(groups) + 2) + "|"]
    for row in rows:
        by_group = statistics.group_table(table(row, column), labels)
        cells = [f"{by_group[g]['mean']:.3f}" for g in groups]
        lines.append(f"| {row.label} | " + " | ".join(cells)
                     + f" | {statistics.overall_from_groups(by_group):.3f} |")
    return lines


def first_reaching(points, target: float) -> float | None:
    """The FLOPs of the first (flops, value) point at or above `target`."""
    for flops, value in points:
        if value >= target:
            return flops
    return None


def flops_to_targets(curves: dict, targets, label: str) -> list[str]:
    """Per run (name -> per seed its (flops, value) points, in order): the FLOPs at which each
    seed first reached each target; a seed that never did is 'missing' and counted, not
    dropped: the mean is over the seeds that reached it, with how many did."""
    lines = ["| run | " + " | ".join(f"{label} >= {t:.3f}" for t in targets) + " |",
             "|---" * (len(targets) + 1) + "|"]
    for name, per_seed in curves.items():
        cells = []
        for target in targets:
            reached = [first_reaching(points, target) for points in per_seed]
            got = [f for f in reached if f is not None]
            mean = f"{np.mean(got):.3g}" if got else "missing"
            cells.append(f"{mean} ({len(got)} of {len(reached)} seeds; "
                         + ", ".join("missing" if f is None else f"{f:.3g}" for f in reached)
                         + ")")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


# 80% power at two-sided 5%: (1.96 + 0.84) / 1.96 of an interval's half-width.
DETECTABLE_PER_HALF_WIDTH = 1.43


def verdict(low: float, high: float, margin: float = 0.0) -> str:
    """The words a paired difference's 95% interval carries: 'higher' or 'lower' where it
    excludes 0; 'tie' only where it lies inside ±margin, a margin stated before the runs
    (results.tie_margin; 0: none was, so nothing is a tie); else 'not distinguishable', with
    the smallest difference these runs could have detected."""
    if low == high == 0:  # every paired count the same: no success in either, typically
        return "identical"
    if low > 0:
        return "higher"
    if high < 0:
        return "lower"
    if margin > 0 and -margin <= low and high <= margin:
        return f"tie, within ±{margin:g}"
    detectable = DETECTABLE_PER_HALF_WIDTH * (high - low) / 2
    return f"not distinguishable; detectable ≥ {detectable:.2f}"
