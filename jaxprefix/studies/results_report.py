"""docs/RESULTS.md from the results job's record: tables, computed statements and figures.

Every number and statement above the hand-written notes is computed here from results.json;
nothing is typed in by hand, and a regenerated report keeps the notes (from NOTES_MARKER on).
Each table cell is mean ± sample std over seeds [95% interval of the crossed table's mean,
jaxprefix/statistics.py], with the 95% upper bound on the per-sample rate where nothing
succeeded (studies/study_tables.py); comparisons are paired differences, in
the words study_tables.verdict gives their interval. A POPE arm's guided share is stated with
its counts, and an arm under guided_share.GUIDED_SHARE_FLOOR of its designed share is labelled a
defect, not a result.
"""
from __future__ import annotations

import numpy as np

from jaxprefix import storage
from jaxprefix.run_setup.study_settings import ReportSettings
from jaxprefix.studies import study_tables
from jaxprefix.studies.guided_share import guided_share, marked_rows, share_sentence
from jaxprefix.studies.study_tables import Column, Row

NOTES_MARKER = "<!-- hand-written notes below: kept when the report is regenerated -->"
REPORT = "REPORT.md"  # in results.output_dir, beside its figures
# Beside REPORT.md: every per-problem count its tables come from, with the config they were
# read under, so a rerun commits them and `python -m jaxprefix.jobs.report_tables` rebuilds
# every table from the repository alone (runs/ is not committed).
COUNTS = "counts.json"


def _mean_std(values) -> str:
    """mean ± sample std (ddof=1) over seeds."""
    values = np.asarray(values, float)
    return (f"{values.mean():.3f} ± {values.std(ddof=1):.3f}" if len(values) > 1
            else f"{values[0]:.3f}")


def _by_name(report: dict, regime: str, specs) -> dict:
    runs: dict = {}
    for run in report["runs"].values():
        if specs[run["name"]].regime == regime:
            runs.setdefault(run["name"], []).append(run)
    return {name: sorted(rs, key=lambda r: r["seed"]) for name, rs in runs.items()}


def _setting(spec) -> str:
    fields = ", ".join(f"`{k}={v}`" for k, v in spec.settings.items())
    warm = {"oracle": "the oracle solutions", "own_guided": "the policy's own correct guided "
            "answers (found by the prefix search), placed after the unguided question",
            "traces": "the trace pool's traces",
            "other_traces": "a second base's traces", "more_sft": "the base's own traces of as "
            "many problems it already solves (outside the hard and held-out sets)"}
    parts = [spec.about] + ([f"fields {fields}"] if fields else [])
    if spec.warm_start:
        parts.append(f"SFT on {warm[spec.warm_start]}, then GRPO")
    return "; ".join(parts)


def _legend(runs: dict, specs, settings: ReportSettings, hard: int) -> list[str]:
    lines = []
    for name, rs in runs.items():
        done = [r for r in rs if "after" in r]
        if not done:
            lines.append(f"- **{name}**: not run: {rs[0].get('skipped', 'no finished seed')}.")
            continue
        extra = f" Steps: {', '.join(str(r['steps']) for r in done)}."
        missing = [str(r["seed"]) for r in rs if "after" not in r]
        if missing:
            extra += f" Not run at seed {', '.join(missing)} (time)."
        if "pope_problems" in done[0]:
            extra += f" Hard problems guided: {done[0]['pope_problems']}."
            shares = [guided_share(r, settings.designs.get(name), hard) for r in done]
            if shares[0] is not None and not shares[0]["counted"]:  # the same at every seed
                extra += f" Its {share_sentence(shares[0])}."
            elif shares[0] is not None:
                extra += " " + "; ".join(f"Seed {r['seed']}: {share_sentence(s)}"
                                         for r, s in zip(done, shares)) + "."
        if "warm_start_examples" in done[0]:
            extra += f" SFT examples: {done[0]['warm_start_examples']}."
        lines.append(f"- **{name}**: {_setting(specs[name])}.{extra}")
    return lines


def _candidates(settings: ReportSettings, study: dict) -> str:
    """What the hard set was mined from: a built-in task's length, a generator's settings."""
    return settings.task_config or f"{study['digits'][0]}-digit"


def _base_label(settings: ReportSettings) -> str:
    """The base's row: the SFT base the study trained, or a model it loaded as it is."""
    return f"base{' (SFT)' if settings.base_trained else ''}, one evaluation"


def _base_row(study: dict, label: str) -> Row:
    return Row(label, [{"after": study["base"], "after_hard_set": study["base_hard_set"]}])


def _warm_rows(runs: dict) -> list[Row]:
    """Each warm-started run's policy after its SFT, before RL."""
    rows = []
    for name, rs in runs.items():
        done = [r for r in rs if "warm_start" in r]
        if done:
            rows.append(Row(f"{name}: after SFT, before RL",
                            [{"after": r["warm_start"], "after_hard_set": r["warm_start_hard_set"]}
                             for r in done], [r["warm_flops"] for r in done]))
    return rows


def _pairs(rows: list[Row], base: Row) -> list[tuple[Row, Row]]:
    """Every run against every run listed after it, then every run against the base."""
    return ([(a, b) for i, a in enumerate(rows) for b in rows[i + 1:]]
            + [(a, base) for a in rows])


def hard_section(report: dict, settings: ReportSettings, specs) -> list[str]:
    study = report["studies"]["hard"]
    ks, k = settings.eval_ks, settings.eval_ks[-1]
    runs = _by_name(report, "hard", specs)
    if not runs:
        return []
    rows = marked_rows(study_tables.run_rows(runs), settings.designs, study["hard"])
    base = _base_row(study, _base_label(settings))
    held_out = [Column(f"held-out pass@{x}", "after", x) for x in ks]
    columns = held_out + [Column(f"training hard set pass@{k}", "after_hard_set", k)]
    fractions = np.asarray(next(iter(study["prefix_searches"].values()))["revealed_fractions"]
                           if study.get("prefix_searches") else [], float)
    lines = [
        "## POPE and its baselines on the hard set", "",
        f"Task: {settings.task_name}. Hard set: {study['hard']} of {study['candidates']} "
        f"training candidates ({_candidates(settings, study)}) solved 0 of {study['k']} times by "
        f"the base. Every run starts from the same base with {settings.problems_per_step * 2} "
        f"contexts x {settings.rollout_n} samples a step; seeds change the RL sampling and data order, not "
        f"the base, the hard set or the held-out set ({len(study['base']['correct_counts'])} "
        f"problems, unguided, {study['base']['num_samples']} samples each).", ""]
    if fractions.size:
        lines += [f"POPE's prefix search found a solvable prefix for {fractions.size} of "
                  f"{study['hard']} hard problems (revealing {fractions.min():.2f}-"
                  f"{fractions.max():.2f} of the solution, median {np.median(fractions):.2f}).",
                  ""]
    lines += [*study_tables.metric_table([base] + rows + _warm_rows(runs), columns), "",
              "Rows:", "", *_legend(runs, specs, settings, study["hard"]), "",
              "Paired differences (the same seeds and problems drawn for both runs):", "",
              *study_tables.comparison_table(_pairs(rows, base), [held_out[0], held_out[-1]],
                                             settings.tie_margin),
              "", *_group_tables([base] + rows, [held_out[-1], held_out[0]], study),
              "![held-out pass@k vs FLOPs](curves.png)", "", *prefix_search_lines(study)]
    return lines


def _group_tables(rows: list[Row], columns, study: dict) -> list[str]:
    """Per-group breakdowns by the problems' difficulty knob (the multiplier where it varies);
    none for problems that carry no knob (a file's, reasoning-gym's)."""
    groups = study["base"]["groups"]
    key = "multiplier" if len(set(groups.get("multiplier", []))) > 1 else next(iter(groups), None)
    if key is None:
        return []
    return [line for column in columns
            for line in (*study_tables.group_table(rows, column, key), "")]


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
    cut = study.get("cut")  # results.same_problems: the searches ran on every hard problem
    for name, s in sorted(searches.items()):
        f = np.asarray(s["revealed_fractions"], float)
        # (a, b] bins, as the header says: a prefix at exactly a cap counts under that cap.
        counts = np.bincount(np.searchsorted(bins, f, side="left") - 1, minlength=len(bins) - 1)
        spread = f"{f.min():.2f} / {np.median(f):.2f} / {f.max():.2f}" if f.size else "-"
        found = (f"{cut['found'][name]} of {cut['hard']}" if cut and name in cut["found"]
                 else f"{s['found']} of {study['hard']}")
        lines.append(f"| {name.removeprefix('prefixes_')} | {found} | {spread} | "
                     + " | ".join(str(int(c)) for c in counts) + " |")
    if cut:
        lines += ["", f"Every run trains on the {cut['kept']} hard problems that every POPE "
                  f"run's search solved, of the {cut['hard']} mined (results.same_problems); "
                  f"the fractions above are those problems' prefixes."]
    return lines + [""]


def _start(run: dict, study: dict) -> tuple:
    """The pre-RL point of a regime run's curve: (mining + SFT FLOPs, hard-set pass@1)."""
    before = run.get("warm_start_hard_set") or study["base_hard_set"]
    return run["ledger"]["extra_flops"], before["pass@1"]


def _target_missed(probe: dict) -> str:
    if probe.get("no_success"):
        return " (no probed length had a success: the shortest, by default)"
    if probe.get("target_missed"):
        return (f" (no probed length was as hard as the target {probe['target_rate']:.2e}: the "
                f"hardest measured)")
    return ""


def regime_section(report: dict, settings: ReportSettings, specs) -> list[str]:
    if "prefixrl" not in report.get("studies", {}):
        return []
    study, probe = report["studies"]["prefixrl"], report["regime_probe"]
    runs = _by_name(report, "prefixrl", specs)
    rows = study_tables.run_rows(runs)
    base = _base_row(study, _base_label(settings))
    k = settings.eval_ks[-1]
    train = [Column("training hard set pass@1", "after_hard_set", 1),
             Column(f"training hard set pass@{k}", "after_hard_set", k)]
    held_out = [Column("held-out pass@1", "after", 1), Column(f"held-out pass@{k}", "after", k)]
    pool = study.get("trace_pool", {"problems": 0, "samples": 0, "samples_found": []})
    other = study.get("other_trace_pool")
    r = settings.regime
    # A probe from before the rule was recorded ('middle', the only rule then).
    rule = probe.get("rule") or (f"the length whose base success rate per sample is closest "
                                 f"(in log) to 1 / sqrt(k x max_samples) = "
                                 f"{probe['target_rate']:.4f}")
    lines = [
        "## PrefixRL in its own regime, with its controls", "",
        f"The problem length is chosen by a rule fixed before any run: {rule}. Measured "
        f"({r['probe_problems']} problems x {r['probe_samples']} samples per length):", "",
        "| digits | " + " | ".join(probe["digits"]) + " |",
        "|---" * (len(probe["digits"]) + 1) + "|",
        "| base pass@1 | " + " | ".join(f"{v:.4f}" for v in probe["digits"].values()) + " |", "",
        f"Chosen: {probe['chosen']} digits{_target_missed(probe)}. Hard set: {study['hard']} of "
        f"{study['candidates']} "
        f"candidates solved 0 of {study['k']} times. The base's own traces (rejection sampling, "
        f"{settings.trace_samples_per_round} a round, up to {settings.trace_max_samples} per "
        f"problem): {pool['problems']} of {study['hard']} problems in {pool['samples']:,} "
        f"samples."]
    if other:
        lines[-1] += _other_base_sentence(other, study["hard"])
    solved = study.get("solved_pool")
    if solved:
        lines[-1] += (f" The more-SFT control's problems: the base solved {solved['problems']} of "
                      f"the {solved['tried']:,} fresh ones it tried ({solved['samples']:,} "
                      f"samples, {solved['flops']:.3g} FLOPs, charged to that run).")
    budget = float(r.get("flops_budget", 0.0))
    length = (f"to {budget:.3g} FLOPs in all (its mining, SFT and second base included)"
              if budget else f"{r['steps']} RL steps")
    lines += ["", f"Every run: {length}, evaluated every {r['eval_every']} steps ({r['eval_n']} "
              f"samples a problem in the run; the tables' final evaluation {settings.eval_n}). "
              f"Held-out pass@1 is the primary figure; the training reward (unguided pass@1 on "
              f"the training hard set, which the paper plots) rewards memorising SFT'd traces.",
              "", *study_tables.metric_table([base] + rows + _warm_rows(runs),
                                             held_out + train), "",
              "Rows:", "", *_legend(runs, specs, settings, study["hard"]), "",
              "Paired differences of the final policies:", "",
              *study_tables.comparison_table(_pairs(rows, base), held_out[:1] + train[:1],
                                             settings.tie_margin), "",
              *study_tables.group_table([base] + rows, train[0], "multiplier"), ""]
    lines += _targets_lines(runs, study)
    return lines + ["", "![training reward vs FLOPs](regime_curves.png)", ""]


def _other_base_sentence(other: dict, hard: int) -> str:
    shape = other.get("shape")
    who = (f"{shape['layers']} layers of width {shape['width']}, {other['params']:,} parameters, "
           f"SFT seed {other['seed']}, the first base's notation mix" if shape else
           f"SFT seed {other['seed']}, {other['tens_first']:.0%} of steps in '^' notation")
    charged = (f"{other['sft_flops']:.3g} for its SFT and {other['sampling_flops']:.3g} for the "
               f"sampling" if "sft_flops" in other else "its sampling only")
    return (f" A second base ({who}) found traces for {other['problems']} of {hard} in "
            f"{other['samples']:,} samples; {other['flops']:.3g} FLOPs ({charged}) are charged "
            f"to the runs that use them.")


def _targets_lines(runs: dict, study: dict) -> list[str]:
    """FLOPs (mining and SFT included) to 3 training rewards: a quarter, half and three
    quarters of the way from the base's to the best run's final mean."""
    finals = [np.mean([r["after_hard_set"]["pass@1"] for r in rs if "after" in r])
              for rs in runs.values() if any("after" in r for r in rs)]
    if not finals:
        return []
    start, best = study["base_hard_set"]["pass@1"], max(finals)
    targets = [start + f * (best - start) for f in (0.25, 0.5, 0.75)]
    curves = {name: [[_start(r, study)] + [(p["flops"], p["hard_set/pass@1"])
                                          for p in r["curve"] if "hard_set/pass@1" in p]
                     for r in rs if "after" in r] for name, rs in runs.items()}
    return [f"FLOPs to three training rewards (a quarter, half and three quarters of the way "
            f"from the base's {start:.3f} to the best final mean, {best:.3f}), from the in-run "
            f"evaluations; the mean is over the seeds that reached it:", "",
            *study_tables.flops_to_targets({n: c for n, c in curves.items() if c}, targets,
                                           "pass@1")]


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


def write_report(report: dict, settings: ReportSettings, workdir: str, specs) -> None:
    out_dir = settings.output_dir or workdir
    command = report.get("command") or (f"python -m jaxprefix.main --config=configs/results.py"
                                        f"{settings.command_variant} --workdir={workdir}")
    lines = [f"# Results on {settings.task_name}", "",
             f"Generated by `{command}`"
             f": every number above the hand-written notes is computed from the runs. FLOPs "
             f"include the mining (and SFT) each run uses.", "",
             *hard_section(report, settings, specs), *regime_section(report, settings, specs)]
    if "isocompute" in report:
        lines += ["## IsoCompute sweep", "",
                  *isocompute_section(report["isocompute"], settings.iso_budgets)]
    path = storage.join(out_dir, REPORT)
    notes = _kept_notes(path)
    storage.write_atomic(path, "\n".join(lines) + "\n" + (f"\n{notes}" if notes else ""))
    ks = settings.eval_ks
    _plot_runs(_by_name(report, "hard", specs), storage.join(out_dir, "curves.png"),
               f"eval/pass@{ks[-1]}", f"held-out pass@{ks[-1]} (unguided)", "hard problems")
    if "prefixrl" in report.get("studies", {}):
        _plot_runs(_by_name(report, "prefixrl", specs),
                   storage.join(out_dir, "regime_curves.png"), "hard_set/pass@1",
                   "training hard set pass@1 (unguided)", "PrefixRL's regime",
                   study=report["studies"]["prefixrl"])
    for name in ("frontier.png", "n_star.png"):
        src = storage.join(workdir, "iso", name)
        if "isocompute" in report and storage.exists(src):
            storage.write_atomic(storage.join(out_dir, name), storage.read_bytes(src))


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
    if ax.get_legend_handles_labels()[0]:  # no run may have a curve yet
        ax.legend(loc="center left", bbox_to_anchor=(1.0, 0.5))  # outside: curves fill the axes
    fig.tight_layout()
    storage.write_figure(path, fig, dpi=110)
