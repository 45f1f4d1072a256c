"""IsoCompute, pre-registered: fit the frontier on small budgets, predict n* at larger ones,
write the prediction down, then run the larger budgets and compare.

    python -m jaxprefix.main --config=configs/isocompute.py:prereg --workdir=runs/iso_prereg
    # the sweep to the fit budgets, the fit, and prediction.json (then commit it);
    python -m jaxprefix.main --config=configs/isocompute.py:prereg \
        --config.isocompute.prereg.phase=outcome --workdir=runs/iso_prereg
    # the same runs resumed to the predicted budgets, and outcome.json

The reward is held-out avg@4 per difficulty group (the problems' digit counts split at
`prereg.split_digits`), read per problem from each run's eval_counts.jsonl, so the outcome has
paired 95% intervals over seeds and problems (jaxprefix/statistics.py).

The prediction, per group, on the seed-mean curves up to `prereg.fit_max` rollouts:
- `envelope`: the n whose fitted reward sigmoid (the paper's per-n fit) is highest at each
  predicted budget, the per-n sigmoids extrapolated;
- `rule`: the fitted allocation rule log2 n*(log2 C) there (rising or falling: the data decide),
  unless it is degenerate: the 95% interval of its span (how far log2 n* moves over the fit's
  budgets; seeds and problems resampled crossed, the frontier refitted per draw) holds 0, or
  its n at a predicted budget leaves the swept n. Then the file says so and gives no rule.
  Either way it states the direction of n* with that interval.
The outcome: the best n of the seed-mean avg@4 at each predicted budget, and the paired
difference between the predicted n and that best n (within noise: the prediction holds).
"""
from __future__ import annotations

import math

import numpy as np

from jaxprefix import statistics, storage
from jaxprefix.run_setup import sweep_points as sweep
from jaxprefix.methods import isocompute
from jaxprefix.rl.eval_counts import read_eval_counts

PREDICTION, OUTCOME, REPORT = "prediction.json", "outcome.json", "REPORT.md"
# Beside them: every run's per-problem correct counts at each evaluation, the problems' groups
# and the seeds, so the outcome and REPORT.md are rebuilt from the repository alone
# (`python -m jaxprefix.jobs.report_tables`; runs/ is not committed).
COUNTS = "counts.json"


def group_of(digits: int, split: int) -> str:
    return f"digits <= {split}" if digits <= split else f"digits > {split}"


def eval_groups(config) -> list[str]:
    """Each held-out problem's group, in the order the runs evaluate them."""
    from jaxprefix.run_setup.problem_sets import load_problem_sets

    problems = load_problem_sets(config.data).eval
    return [group_of(p.metadata["digits"], config.isocompute.prereg.split_digits)
            for p in problems]


def per_problem_curves(config, workdir: str) -> dict:
    """(n, B, seed) -> (rollouts at each evaluation, [evals, problems] avg@k per problem, the
    samples per problem of each evaluation)."""
    curves = {}
    for point in sweep.sweep_points(config):
        for seed in config.isocompute.seeds:
            directory = sweep.point_workdir(sweep.runs_dir(config, workdir), point, seed)
            records = [r for r in read_eval_counts(directory) if r["name"] == "eval"]
            if records:
                rows = point.n * point.batch
                curves[(point.n, point.batch, seed)] = (
                    [r["step"] * rows for r in records],
                    np.asarray([r["correct_counts"] for r in records], float) / records[0]["n"],
                    records[0]["n"])
    return curves


def _at(curve, budget: float) -> np.ndarray | None:
    """Per-problem scores of the last evaluation within `budget` rollouts (None: the run has
    not reached the budget yet)."""
    compute, scores, _ = curve
    within = [i for i, c in enumerate(compute) if c <= budget]
    return scores[within[-1]] if within and compute[-1] >= budget else None


def group_runs(curves: dict, groups: list[str], group: str, max_rollouts: float,
               seed_weights: dict | None = None, problem_weights=None) -> list:
    """Seed-mean isocompute.Run per (n, B): the group's avg@4 at each evaluation within
    `max_rollouts`, over the evaluations every seed reached. `seed_weights` (seed -> how often
    a bootstrap draw took it) and `problem_weights` (per problem of the group) weight the means;
    None: every seed and problem once."""
    columns = [i for i, g in enumerate(groups) if g == group]
    v = np.ones(len(columns)) if problem_weights is None else np.asarray(problem_weights, float)
    by_point: dict = {}
    for (n, batch, seed), (compute, scores, _) in curves.items():
        w = 1.0 if seed_weights is None else seed_weights.get(seed, 0.0)
        if w > 0:
            keep = [i for i, c in enumerate(compute) if c <= max_rollouts]
            by_point.setdefault((n, batch), []).append(
                ([compute[i] for i in keep], scores[keep][:, columns] @ v / v.sum(), w))
    runs = []
    for (n, batch), seeds in sorted(by_point.items()):
        length = min(len(c) for c, _, _ in seeds)
        if length:
            reward = np.average([r[:length] for _, r, _ in seeds], axis=0,
                                weights=[w for _, _, w in seeds])
            runs.append(isocompute.Run(n, batch, tuple(map(float, seeds[0][0][:length])),
                                       tuple(map(float, reward))))
    return runs


def span_interval(curves: dict, groups: list[str], group: str, max_rollouts: float, *,
                  resamples: int, seed: int = 0) -> tuple[float, float]:
    """95% interval of the fitted n* curve's span (isocompute.n_star_span), the seeds and the
    group's problems resampled crossed (one draw of the seeds, one problem draw for every seed
    and every (n, B)), the frontier refitted on each draw. A bootstrap, not the mean-square
    interval of jaxprefix/statistics.py: a fitted span has no such formula, and at 3 seeds this
    resample cannot show the seeds' variance (it may under-cover: issue 43)."""
    rng = np.random.default_rng(seed)
    seeds = sorted({s for _, _, s in curves})
    problems = groups.count(group)
    spans = []
    for _ in range(resamples):
        picked = rng.multinomial(len(seeds), np.full(len(seeds), 1 / len(seeds)))
        v = rng.multinomial(problems, np.full(problems, 1 / problems))
        runs = group_runs(curves, groups, group, max_rollouts,
                          dict(zip(seeds, picked.astype(float))), v)
        try:
            spans.append(isocompute.n_star_span(isocompute.fit_frontier(runs)))
        except ValueError:  # a draw whose curves are all flat: n* does not move
            spans.append(0.0)
    return statistics.percentile_interval(spans)


def direction(span: float, interval: tuple[float, float]) -> str:
    """'rises' / 'falls' when the span's interval excludes 0, else 'undecided'."""
    low, high = interval
    return "rises" if low > 0 else "falls" if high < 0 else "undecided"


def degenerate(span: float, interval: tuple[float, float], rule: dict, ns) -> str:
    """Why a fitted n*(C) rule cannot serve as an allocation rule ('' when it can): its span's
    interval holds 0 (the fit cannot tell whether n* rises or falls, let alone how fast), or
    its n at a predicted budget (`rule`: budget -> n) leaves the swept n, where no run can
    check it."""
    low, high = interval
    if low <= 0 <= high:
        return (f"log2 n* moves {span:+.2f} over the fit's budgets [95% interval {low:+.2f}, "
                f"{high:+.2f}]: the interval holds 0, so the fit cannot tell whether n* rises "
                f"or falls")
    outside = {b: n for b, n in rule.items() if not min(ns) <= n <= max(ns)}
    if outside:
        return (f"the rule's n at budget {', '.join(f'{b}: {n}' for b, n in outside.items())} "
                f"leaves the swept n ({min(ns)}..{max(ns)})")
    return ""


def predict(config, workdir: str) -> dict:
    """The pre-registered prediction (written once: an existing prediction.json is kept)."""
    path = storage.join(workdir, PREDICTION)
    if storage.exists(path):
        return storage.read_json(path)
    pr = config.isocompute.prereg
    groups = eval_groups(config)
    curves = per_problem_curves(config, workdir)
    record = {"fit_max_rollouts": pr.fit_max, "predicted_budgets": list(pr.predict),
              "ns": list(config.isocompute.ns), "seeds": list(config.isocompute.seeds),
              "lr_rule": config.isocompute.lr_rule, "groups": {}}
    for group in sorted(set(groups)):
        runs = group_runs(curves, groups, group, pr.fit_max)
        entry = {"problems": groups.count(group), "runs": [vars(r) for r in runs],
                 "envelope": {}, "rule": {}}
        try:
            fit = isocompute.fit_frontier(runs)
        except ValueError as e:  # e.g. every curve flat: nothing to predict from, and it says so
            record["groups"][group] = entry | {"fit": None, "degenerate": f"no frontier: {e}"}
            continue
        span = isocompute.n_star_span(fit)
        interval = span_interval(curves, groups, group, pr.fit_max,
                                 resamples=pr.span_resamples)
        rule = {} if fit.n_star_fit is None else {
            str(b): int(2 ** round(float(fit.n_star_fit(math.log2(b))))) for b in pr.predict}
        why = degenerate(span, interval, rule, config.isocompute.ns)
        entry |= {"fit": fit.to_dict(), "degenerate": why,
                  "n_star_span": {"log2": span, "low": interval[0], "high": interval[1],
                                  "direction": direction(span, interval)}}
        for budget in pr.predict:
            x = math.log2(budget)
            entry["envelope"][str(budget)] = int(max(fit.per_n, key=lambda n: fit.per_n[n](x)))
        entry["rule"] = {} if why else rule
        record["groups"][group] = entry
    storage.write_json(path, record)
    return storage.read_json(path)  # what the file says, as a later reader sees it


def write_counts(path: str, curves: dict, groups: list[str], seeds) -> None:
    """counts.json: per run (n, B, seed) its rollouts and per-problem correct counts at each
    evaluation, of `samples` each; the held-out problems' groups; the seeds."""
    runs = [{"n": n, "batch": b, "seed": s, "compute": list(map(int, compute)),
             "samples": int(samples),
             "correct_counts": np.rint(scores * samples).astype(int).tolist()}
            for (n, b, s), (compute, scores, samples) in sorted(curves.items())]
    storage.write_json(path, {"groups": list(groups), "seeds": list(seeds), "runs": runs},
                       indent=None)


def read_counts(path: str) -> tuple[dict, list[str], list]:
    """(curves as per_problem_curves gives them, groups, seeds) from a counts.json."""
    record = storage.read_json(path)
    curves = {(r["n"], r["batch"], r["seed"]): (
        r["compute"], np.asarray(r["correct_counts"], float) / r["samples"], r["samples"])
        for r in record["runs"]}
    return curves, record["groups"], record["seeds"]


def outcome(config, workdir: str) -> dict:
    """What the predicted budgets measured, against prediction.json; written to outcome.json."""
    prediction = storage.read_json(storage.join(workdir, PREDICTION))
    groups = eval_groups(config)
    curves = per_problem_curves(config, workdir)
    record = outcome_of(prediction, curves, groups, list(config.isocompute.seeds))
    storage.write_json(storage.join(workdir, OUTCOME), record)
    return record


def outcome_of(prediction: dict, curves: dict, groups: list[str], seeds) -> dict:
    """The outcome record of `prediction` on per-problem `curves`."""
    record = {"groups": {}}
    for group, entry in prediction["groups"].items():
        columns = [i for i, g in enumerate(groups) if g == group]
        out = {}
        for budget in prediction["predicted_budgets"]:
            tables, samples = {}, {}  # n -> [seeds, problems] scores at the budget, samples
            for n in prediction["ns"]:
                rows = [_at(curves[(n, b, s)], budget) for (m, b, s) in curves
                        if m == n and s in seeds]
                if rows and all(r is not None for r in rows) and len(rows) == len(seeds):
                    tables[n] = np.stack(rows)[:, columns]
                    per_problem = [curves[k][2] for k in curves if k[0] == n and k[2] in seeds]
                    samples[n] = sum(per_problem) * len(columns)
            if not tables:
                continue
            means = {n: float(t.mean()) for n, t in tables.items()}
            best = max(means, key=means.get)
            cell = {"mean": {str(n): means[n] for n in sorted(means)}, "best": best,
                    "summary": {str(n): statistics.summary(t, samples=samples[n])
                                for n, t in sorted(tables.items())}}
            for kind in ("envelope", "rule"):
                predicted = entry[kind].get(str(budget))
                if predicted in tables:
                    low, high = statistics.paired_difference_interval(tables[predicted],
                                                                      tables[best])
                    cell[kind] = {"n": predicted, "minus_best": means[predicted] - means[best],
                                  "low": low, "high": high, "holds": bool(low <= 0 <= high)}
            out[str(budget)] = cell
        record["groups"][group] = out
    return record


def run_prereg(config, workdir: str) -> dict:
    """phase 'predict': the sweep to prereg.fit_max, then prediction.json; phase 'outcome':
    the sweep to the largest predicted budget, then outcome.json."""
    pr = config.isocompute.prereg
    last = pr.fit_max if pr.phase == "predict" else max(pr.predict)
    c = config.copy_and_resolve_references()
    c.isocompute.budgets = tuple(b for b in c.isocompute.budgets if b <= last)
    for point in sweep.sweep_points(c):
        for seed in c.isocompute.seeds:
            from jaxprefix.jobs.rl import run_rl

            run_rl(sweep.point_config(c, point, seed, workdir),
                   sweep.point_workdir(sweep.runs_dir(c, workdir), point, seed))
    prediction = predict(c, workdir)
    result = prediction if pr.phase == "predict" else outcome(c, workdir)
    write_counts(storage.join(workdir, COUNTS), per_problem_curves(c, workdir), eval_groups(c),
                 list(c.isocompute.seeds))
    storage.write_atomic(storage.join(workdir, REPORT), "\n".join(
        report_lines(prediction, None if pr.phase == "predict" else result)) + "\n")
    return result


def report_lines(prediction: dict, outcome: dict | None) -> list[str]:
    """The markdown of a pre-registered sweep: what was predicted, then what was measured."""
    lines = [f"Fit on budgets up to {prediction['fit_max_rollouts']} rollouts (n in "
             f"{prediction['ns']}, seeds {prediction['seeds']}, lr rule "
             f"{prediction['lr_rule']}); predicted for {prediction['predicted_budgets']}.", ""]
    for group, entry in prediction["groups"].items():
        span = entry.get("n_star_span")
        moves = "" if span is None else (
            f"n* {span['direction']} with the budget over the fit: log2 n* {span['log2']:+.2f} "
            f"[95% interval {span['low']:+.2f}, {span['high']:+.2f}] (the paper's rises, then "
            f"saturates). ")
        lines.append(f"**{group}** ({entry['problems']} held-out problems). {moves}Fitted rule: "
                     + (f"degenerate: {entry['degenerate']}; it is not an allocation rule."
                        if entry["degenerate"] else
                        "log2 n*(log2 C) = " + ", ".join(
                            f"{k} {v:.3g}" for k, v in entry["fit"]["n_star_fit"].items()) + "."))
        cells = outcome["groups"].get(group, {}) if outcome else {}
        lines += ["", "| budget | predicted n (envelope) | predicted n (rule) | measured avg@4 "
                  "per n: mean ± std [95% interval] | best n | predicted − best [95% interval] |",
                  "|---" * 6 + "|"]
        for budget in prediction["predicted_budgets"]:
            cell = cells.get(str(budget))
            envelope, rule = entry["envelope"].get(str(budget)), entry["rule"].get(str(budget))
            if cell is None:
                lines.append(f"| {budget} | {envelope or '-'} | {rule or '-'} | not run | - | - |")
                continue
            measured = "; ".join(f"n={n}: {statistics.format_cell(s)}"
                                 for n, s in cell["summary"].items())
            checks = []
            for kind in ("envelope", "rule"):
                if kind in cell:
                    c = cell[kind]
                    checks.append(f"{kind} {c['minus_best']:+.3f} [{c['low']:+.3f}, "
                                  f"{c['high']:+.3f}] ("
                                  + ("holds: within noise of the best" if c["holds"]
                                     else "does not hold") + ")")
            lines.append(f"| {budget} | {envelope or '-'} | {rule or '-'} | {measured} | {cell['best']}"
                         f" | {'; '.join(checks)} |")
        lines.append("")
    return lines
