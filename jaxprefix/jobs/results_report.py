"""docs/RESULTS.md from the results job's record: tables, computed statements and figures.

Every number and statement above the hand-written notes is computed here from results.json;
nothing is typed in by hand, and a regenerated report keeps the notes (from NOTES_MARKER on).
"""
from __future__ import annotations

import numpy as np

from jaxprefix import storage
from jaxprefix.methods.isocompute import ComputeLedger

NOTES_MARKER = "<!-- hand-written notes below: kept when the report is regenerated -->"


def _mean_std(values) -> str:
    values = np.asarray(values, float)
    return f"{values.mean():.3f} ± {values.std():.3f}" if len(values) > 1 else f"{values[0]:.3f}"


def _by_name(report: dict, regime: str, specs) -> dict:
    runs: dict = {}
    for run in report["runs"].values():
        if specs[run["name"]].regime == regime:
            runs.setdefault(run["name"], []).append(run)
    return {name: sorted(rs, key=lambda r: r["seed"]) for name, rs in runs.items()}


def _flops(runs) -> float:
    return float(np.mean([ComputeLedger.from_dict(r["ledger"]).total_flops for r in runs]))


def _setting(spec) -> str:
    fields = ", ".join(f"`{k}={v}`" for k, v in spec.settings.items())
    warm = {"oracle": "the oracle solutions", "own_guided": "the policy's own correct guided "
            "answers (found by the prefix search)", "traces": "the trace pool's traces"}
    parts = [spec.about] + ([f"fields {fields}"] if fields else [])
    if spec.warm_start:
        parts.append(f"SFT on {warm[spec.warm_start]}, then GRPO")
    return "; ".join(parts)


def hard_section(report: dict, config, specs) -> list[str]:
    study = report["studies"]["hard"]
    ks, k = config.eval.ks, config.eval.ks[-1]
    runs = _by_name(report, "hard", specs)
    base, base_hard = study["base"], study["base_hard_set"]
    lines = [
        "## POPE and the baselines on the hard set", "",
        f"Hard set: {study['hard']} of {study['candidates']} training candidates "
        f"({study['digits'][0]}-digit numbers x 6..9) solved 0 of {study['k']} times by the base. "
        f"The base's unguided pass@{k}: held-out {base[f'pass@{k}']:.3f}, training hard set "
        f"{base_hard[f'pass@{k}']:.3f}. Every run: {config.train.total_steps} RL steps of "
        f"{config.train.problems_per_step * 2} contexts x {config.rollout.n} samples from the "
        f"same base; seeds change the RL sampling and data order. Cells: mean ± std over seeds.",
        "",
        "| run | seeds | " + " | ".join(f"held-out pass@{x}" for x in ks)
        + f" | training hard set pass@{k} | held-out pass@{k} per seed | FLOPs |",
        "|---" * (len(ks) + 5) + "|",
        "| base (SFT) | - | " + " | ".join(f"{base[f'pass@{x}']:.3f}" for x in ks)
        + f" | {base_hard[f'pass@{k}']:.3f} | - | 0 |"]
    legend, skipped = [], []
    for name, rs in runs.items():
        done = [r for r in rs if "after" in r]
        if not done:
            skipped.append(f"- **{name}**: not run: {rs[0].get('skipped', 'no finished seed')}.")
            continue
        lines.append(f"| {name} | {len(done)} | "
                     + " | ".join(_mean_std([r["after"][f"pass@{x}"] for r in done]) for x in ks)
                     + f" | {_mean_std([r['after_hard_set'][f'pass@{k}'] for r in done])} | "
                     + ", ".join(f"{r['after'][f'pass@{k}']:.3f}" for r in done)
                     + f" | {_flops(done):.3g} |")
        if "warm_start" in done[0]:
            lines.append(f"| {name}: after SFT, before RL | {len(done)} | "
                         + " | ".join(_mean_std([r["warm_start"][f"pass@{x}"] for r in done])
                                      for x in ks)
                         + f" | {_mean_std([r['warm_start_hard_set'][f'pass@{k}'] for r in done])}"
                         + " | " + ", ".join(f"{r['warm_start'][f'pass@{k}']:.3f}" for r in done)
                         + " | - |")
        extra = ""
        if "pope_problems" in done[0]:
            extra = f" {done[0]['pope_problems']} of {study['hard']} hard problems guided."
        if "warm_start_examples" in done[0]:
            extra += f" SFT examples: {done[0]['warm_start_examples']}."
        legend.append(f"- **{name}**: {_setting(specs[name])}.{extra}")
    lines += ["", "Rows:", "", *legend, *skipped, "",
              "![held-out pass@k vs FLOPs](results/curves.png)", "",
              *prefix_search_lines(study)]
    return lines


def prefix_search_lines(study: dict) -> list[str]:
    """Per prefix search (one per guidance and cap): how many problems got a prefix, and the
    distribution of the fraction of the oracle solution it reveals."""
    searches = study.get("prefix_searches", {})
    if not searches:
        return []
    bins = [0.0, 0.25, 0.5, 0.75, 1.0]
    lines = ["Shortest solvable prefixes (m samples per length, searched up to the cap): the "
             "fraction of the oracle solution each reveals.", "",
             "| search | problems with a prefix | fraction min / median / max | "
             + " | ".join(f"({a:g}, {b:g}]" for a, b in zip(bins, bins[1:])) + " |",
             "|---" * (3 + len(bins) - 1) + "|"]
    for name, s in sorted(searches.items()):
        f = np.asarray(s["revealed_fractions"], float)
        # (a, b] bins, as the header says: a prefix at exactly a cap counts under that cap.
        counts = np.bincount(np.searchsorted(bins, f, side="left") - 1, minlength=len(bins) - 1)
        spread = f"{f.min():.2f} / {np.median(f):.2f} / {f.max():.2f}" if f.size else "-"
        lines.append(f"| {name.removeprefix('prefixes_')} | {s['found']} of {study['hard']} | "
                     f"{spread} | " + " | ".join(str(int(c)) for c in counts) + " |")
    return lines + [""]


def _first_reaching(curve, key: str, target: float, start: tuple) -> float | None:
    """FLOPs at which a run's curve (with its pre-RL start point) first reaches `target`."""
    points = [start] + [(p["flops"], p[key]) for p in curve if key in p]
    for flops, value in points:
        if value >= target:
            return flops
    return None


def regime_section(report: dict, config, specs) -> list[str]:
    if "prefixrl" not in report.get("studies", {}):
        return []
    study, probe = report["studies"]["prefixrl"], report["regime_probe"]
    runs = _by_name(report, "prefixrl", specs)
    k = config.eval.ks[-1]
    pool = study.get("trace_pool", {"problems": 0, "samples": 0, "samples_found": []})
    found = pool["samples_found"]
    lines = [
        "## PrefixRL in its own regime", "",
        f"The problem length is chosen by a rule fixed before any run: the length whose base "
        f"success rate per sample is closest (in log) to 1 / sqrt(k x max_samples) = "
        f"{probe['target_rate']:.4f}, between a rate the mining's pass@{config.mining.k} rarely "
        f"sees and one {config.prefixrl.max_samples} rejection samples still find. Measured "
        f"({config.results.regime.probe_problems} problems x "
        f"{config.results.regime.probe_samples} samples per length):", "",
        "| digits | " + " | ".join(probe["digits"]) + " |",
        "|---" * (len(probe["digits"]) + 1) + "|",
        "| base pass@1 | " + " | ".join(f"{v:.4f}" for v in probe["digits"].values()) + " |", "",
        f"Chosen: {probe['chosen']} digits"
        + (" (no probe problem was solved at any length: the shortest was taken)"
           if probe.get("no_success") else "") + f". Hard set: {study['hard']} of "
        f"{study['candidates']} candidates solved 0 of {study['k']} times (the base's pass@{k} on "
        f"it, in fresh samples: {study['base_hard_set'][f'pass@{k}']:.3f}; a set chosen by "
        f"{study['k']} samples holds low rates, not only zero ones). Rejection sampling "
        f"({config.prefixrl.samples_per_round} a round, up to {config.prefixrl.max_samples} per "
        f"problem) found a trace for "
        f"{pool['problems']} of {study['hard']} in {pool['samples']:,} samples"
        + (f" (samples to a found trace: median {np.median(found):.0f}, mean {np.mean(found):.0f};"
           f" the paper: about 650 on average, capped at 2,500)" if found else "") + ". "
        f"Both runs are charged for the hard set and that sampling; the SFT baseline also for "
        f"its SFT updates. The training reward is the unguided pass@1 on the whole training hard "
        f"set ({study['hard']} problems x {config.eval.n} samples), as the paper plots.", "",
        f"| run | seeds | training hard set pass@1 | training hard set pass@{k} | held-out "
        f"pass@1 | held-out pass@{k} | FLOPs |", "|---" * 7 + "|",
        f"| base | - | {study['base_hard_set']['pass@1']:.3f} | "
        f"{study['base_hard_set'][f'pass@{k}']:.3f} | {study['base']['pass@1']:.3f} | "
        f"{study['base'][f'pass@{k}']:.3f} | 0 |"]
    finals = {}
    for name, rs in runs.items():
        done = [r for r in rs if "after" in r]
        if not done:
            continue
        finals[name] = [r["after_hard_set"]["pass@1"] for r in done]
        lines.append(f"| {name} | {len(done)} | {_mean_std(finals[name])} | "
                     f"{_mean_std([r['after_hard_set'][f'pass@{k}'] for r in done])} | "
                     f"{_mean_std([r['after']['pass@1'] for r in done])} | "
                     f"{_mean_std([r['after'][f'pass@{k}'] for r in done])} | {_flops(done):.3g} |")
    lines += ["", *[f"- **{name}**: {_setting(specs[name])}." for name in runs], ""]
    lines += headline_lines(report, runs, study, finals)
    return lines + ["", "![training reward vs FLOPs](results/regime_curves.png)", ""]


def _start(run: dict, study: dict) -> tuple:
    """The pre-RL point of a regime run's curve: (mining + SFT FLOPs, hard-set pass@1)."""
    mined = run["ledger"]["extra_flops"]
    before = run.get("warm_start_hard_set") or study["base_hard_set"]
    return mined, before["pass@1"]


def headline_lines(report: dict, runs: dict, study: dict, finals: dict) -> list[str]:
    """The paper's headline, measured: FLOPs to a common training reward, and the final ones."""
    a, b = "prefixrl_regime", "sft_traces_regime"
    if a not in finals or b not in finals:
        return []
    target = min(np.mean(finals[a]), np.mean(finals[b]))
    starts = [_start(r, study)[1] for name in (a, b) for r in runs[name] if "after" in r]
    if target <= max(starts):
        return [f"No speed comparison: the lower final training reward ({target:.3f}) is not above "
                f"every run's reward before RL ({max(starts):.3f})."]
    reach = {}
    for name in (a, b):
        reach[name] = [_first_reaching(r["curve"], "hard_set/pass@1", target, _start(r, study))
                       for r in runs[name] if "after" in r]
    lines = [f"Common target: training hard-set pass@1 {target:.3f} (the lower of the two final "
             f"means). FLOPs (mining and SFT included) at which each seed first reached it, from "
             f"the in-run evaluations:", ""]
    for name in (a, b):
        lines.append(f"- {name}: " + ", ".join("not reached" if f is None else f"{f:.3g}"
                                                for f in reach[name]))
    got = {n: [f for f in v if f is not None] for n, v in reach.items()}
    if got[a] and got[b]:
        ratio = np.mean(got[b]) / np.mean(got[a])
        lines.append(f"- {b} / {a} FLOPs to the target (seed means): {ratio:.2f} "
                     f"(the paper: about 2).")
    lines.append(f"- Final training hard-set pass@1, {a} / {b}: "
                 f"{np.mean(finals[a]):.3f} / {np.mean(finals[b]):.3f}"
                 + (f" = {np.mean(finals[a]) / np.mean(finals[b]):.2f}x (the paper: about 3x)."
                    if np.mean(finals[b]) > 0 else "."))
    return lines


def isocompute_section(sweep: dict, budgets) -> list[str]:
    """avg@4 per (n, B) at each budget (mean ± std over seeds), and n* per seed and overall."""
    seeds = sweep.get("seeds", [0])
    header = " | ".join(f"C = 2^{int(np.log2(b))}" for b in budgets)
    lines = [f"GRPO on mid-length problems, held-out avg@4 after C rollouts, mean ± std over "
             f"seeds {seeds}; each (n, B) ran once per seed to the largest budget, its learning "
             f"rate scaled with n x B by the rule in the config.", "",
             f"| n | B | {header} |", "|---" * (len(budgets) + 2) + "|"]
    def at(run: dict, budget: int) -> float | None:  # the last evaluation within the budget
        values = [rw for c, rw in zip(run["compute"], run["reward"]) if c <= budget]
        return values[-1] if values else None

    by_point: dict = {}
    for run in sweep["runs"]:
        by_point.setdefault((run["n"], run["batch"]), []).append(run)
    for (n, batch), group in sorted(by_point.items()):
        cells = []
        for budget in budgets:
            values = [v for v in (at(r, budget) for r in group) if v is not None]
            cells.append(_mean_std(values) if len(values) == len(group) else "-")
        lines.append(f"| {n} | {batch} | " + " | ".join(cells) + " |")
    one_batch = len({r["batch"] for r in sweep["runs"]}) == 1
    best = []  # the raw argmax, beside the fit's smoothed one
    for seed in seeds:
        runs = [r for r in sweep["runs"] if r["seed"] == seed]
        cells = []
        for budget in budgets:
            scored = [(v, r["n"], r["batch"]) for r in runs if (v := at(r, budget)) is not None]
            _, n, batch = max(scored) if scored else (None, None, None)
            label = "-" if n is None else str(n) if one_batch else f"{n} (B {batch})"
            cells.append(f"{label} at 2^{int(np.log2(budget))}")
        best.append(f"seed {seed}: {', '.join(cells)}")

    def n_star_at(fit: dict | None) -> str:
        if not fit:
            return "no fit"
        log_c = np.asarray(fit["log_c"])
        at = [int(np.argmin(np.abs(log_c - np.log2(b)))) for b in budgets]
        return ", ".join(f"{fit['n_star'][i]} at 2^{int(np.log2(b))}" for i, b in zip(at, budgets))
    lines += ["", f"The best n in the table, per seed: {'; '.join(best)}.",
              f"n* on the upper envelope of the fitted frontier: seed-mean curves: "
              f"{n_star_at(sweep.get('fit'))}."]
    for seed, record in sweep.get("per_seed", {}).items():
        lines.append(f"Seed {seed} alone: {n_star_at(record.get('fit'))}.")
    if sweep.get("allocation"):
        a = sweep["allocation"]
        lines.append(f"\nThe allocation rule stored in frontier.json: log2 n*(log2 C) = "
                     f"{a['n_curve']}, B = {a['batch']}, {a['flops_per_rollout']:.3g} FLOPs per "
                     f"rollout.")
    return lines + ["", "![frontier](results/frontier.png) ![n*](results/n_star.png)"]


def write_report(report: dict, config, workdir: str, specs) -> None:
    out_dir = config.results.output_dir or workdir
    lines = ["# Results on the demo task", "",
             f"Generated by `python -m jaxprefix.main --config=configs/results.py "
             f"--workdir={workdir}`: every number above the hand-written notes is computed from "
             f"the runs. FLOPs include the mining (and SFT) each run uses.", "",
             *hard_section(report, config, specs), *regime_section(report, config, specs)]
    if "isocompute" in report:
        lines += ["## IsoCompute sweep", "",
                  *isocompute_section(report["isocompute"], config.isocompute.budgets)]
    path = storage.join(out_dir, "RESULTS.md")
    notes = _kept_notes(path)
    storage.write_atomic(path, "\n".join(lines) + "\n" + (f"\n{notes}" if notes else ""))
    ks = config.eval.ks
    _plot_runs(_by_name(report, "hard", specs), storage.join(out_dir, "results", "curves.png"),
               f"eval/pass@{ks[-1]}", f"held-out pass@{ks[-1]} (unguided)", "hard problems")
    if "prefixrl" in report.get("studies", {}):
        _plot_runs(_by_name(report, "prefixrl", specs),
                   storage.join(out_dir, "results", "regime_curves.png"), "hard_set/pass@1",
                   "training hard set pass@1 (unguided)", "PrefixRL's regime",
                   study=report["studies"]["prefixrl"])
    for name in ("frontier.png", "n_star.png"):
        src = storage.join(workdir, "iso", name)
        if "isocompute" in report and storage.exists(src):
            storage.write_atomic(storage.join(out_dir, "results", name), storage.read_bytes(src))


def _kept_notes(path: str) -> str:
    """The hand-written part of an existing report (from NOTES_MARKER on), which regenerating
    keeps: the numbers above it change, so re-read the notes against them."""
    if not storage.exists(path):
        return ""
    text = storage.read_text(path)
    return text[text.index(NOTES_MARKER):] if NOTES_MARKER in text else ""


def _plot_runs(runs: dict, path: str, key: str, ylabel: str, title: str,
               study: dict | None = None) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8.5, 4.5))
    ax = fig.subplots()
    for i, (name, rs) in enumerate(runs.items()):
        for r in rs:
            points = [(p["flops"], p[key]) for p in r.get("curve", []) if key in p]
            if study is not None and points:
                points.insert(0, _start(r, study))
            if points:
                ax.plot(*zip(*points), marker="o", color=f"C{i}", alpha=0.8,
                        label=name if r is rs[0] else None)
    ax.set(xscale="log", xlabel="FLOPs (sampling + updates + mining + SFT)", ylabel=ylabel,
           title=title)
    ax.grid(alpha=0.3)
    ax.legend(loc="center left", bbox_to_anchor=(1.0, 0.5))  # outside: curves fill the axes
    fig.tight_layout()
    storage.write_figure(path, fig, dpi=110)
