"""POPE against FLOP-matched GRPO along the overlap axis: the phase table and figure.

    python -m jaxprefix.jobs.eps_phase docs/results/pope_eps

Reads every folder under the root that holds a results job's counts.json from
configs/results.py:eps (one knob level each), and writes PHASE.md and phase.png in the root:
at each level's eps (the base's teacher-forced P(a right key step) on the held-out problems,
jaxprefix/key_step_probe.py) and its unguided success rate, POPE with the value hint and with
the restating hint minus GRPO at the larger POPE arm's FLOPs, held-out pass@16 and pass@1, each a
paired 95% interval (jaxprefix/statistics.py: the interval of the difference table, the same
seed and problem in both arms), and each arm's guided share (an arm under 0.9 of its designed
share is marked a defect, not a result: studies/guided_share.py). A level shows the seeds it
has; the figure is rebuilt from the committed counts.
"""
from __future__ import annotations

import os
import sys

import ml_collections

from jaxprefix import statistics, storage
from jaxprefix.run_setup.study_settings import guided_design, tie_margin
from jaxprefix.studies import guided_share, results_report, study_tables
from jaxprefix.studies.study_tables import Column

GRPO = "grpo_matched_hints"
ARMS = {"pope_value_hint": "value hint", "pope_restating_hint": "restating hint"}


def columns(ks) -> tuple[Column, Column]:
    """Held-out pass@k at the largest k evaluated (16 in the study), and pass@1."""
    return (Column("held-out pass@k", "after", max(ks)), Column("held-out pass@1", "after", 1))


def header(column: Column, k: int) -> str:
    return column.header.replace("@k", f"@{k}")


def level_folders(root: str) -> list[str]:
    return sorted(d for d, _, files in os.walk(root) if results_report.COUNTS in files)


def _knob(sft_data: dict) -> str:
    """The level's SFT mixture: the overlap knob, and the continuation knob where set."""
    restated = sft_data.get("restated_taught", 0.0)
    return f"{sft_data.get('second_rule_taught', 0.0)}" + (
        f", restated {restated}" if restated else "")


def level(folder: str) -> dict:
    """One level: its base's probe, and each arm's paired difference from GRPO per column."""
    from jaxprefix.run_setup.study_arms import RUNS

    record = storage.read_json(storage.join(folder, results_report.COUNTS))
    report, config = record["report"], ml_collections.ConfigDict(record["config"])
    by_name: dict = {}
    for run in report["runs"].values():
        by_name.setdefault(run["name"], []).append(run)
    rows = {row.label: row for row in study_tables.run_rows(by_name)}
    probe = report["studies"]["hard"].get("base_probe")
    if probe is None:
        raise ValueError(f"{folder}: no base probe in counts.json; expected a run of "
                         f"configs/results.py:eps (eval.key_step_probe)")
    out = {"folder": folder, "k": max(record["config"]["eval"]["ks"]), "eps": probe["probe/key_step"], "success": probe["probe/success"],
           "knob": _knob(record["config"]["sft"]["data"]), "arms": {},
           "tie_margin": tie_margin(config)}
    for arm in ARMS:
        if arm not in rows or GRPO not in rows:
            continue
        pair = [r for r in rows[arm].evals if r["seed"] in {g["seed"] for g in rows[GRPO].evals}]
        a = study_tables.Row(arm, pair)
        b = study_tables.Row(GRPO, [g for g in rows[GRPO].evals
                                    if g["seed"] in {r["seed"] for r in pair}])
        share = guided_share.guided_share(pair[0], guided_design(config, RUNS[arm]),
                                          report["studies"]["hard"]["hard"])
        out["arms"][arm] = {"seeds": len(pair), "guided": share}
        for column in columns(record["config"]["eval"]["ks"]):
            ta, tb = study_tables.paired_tables(a, b, column)
            low, high = statistics.paired_difference_interval(ta, tb)
            out["arms"][arm][column.header] = (float((ta - tb).mean()), float(low), float(high))
    return out


def table_lines(levels: list[dict]) -> list[str]:
    headers = [header(c, levels[0]["k"]) for c in columns([1])]
    lines = ["| knob | eps | unguided success | arm | guided share | seeds | "
             + " | ".join(f"Δ {h} vs GRPO" for h in headers) + " |",
             "|---" * (6 + len(headers)) + "|"]
    for lv in levels:
        for arm, d in lv["arms"].items():
            cells = [f"{m:+.3f} [{lo:+.3f}, {hi:+.3f}]: "
                     f"{study_tables.verdict(lo, hi, lv['tie_margin'])}"
                     for m, lo, hi in (d[c.header] for c in columns([1]))]
            share = d["guided"]
            guided = ("-" if share is None else f"{share['share']:.2f}"
                      + (" (defect: not a result)" if share["defect"] else ""))
            lines.append(f"| {lv['knob']} | {lv['eps']:.2g} | {lv['success']:.2g} | "
                         f"{ARMS[arm]} | {guided} | {d['seeds']} | " + " | ".join(cells) + " |")
    return lines


def plot(levels: list[dict], path: str) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4))
    for ax, column in zip(fig.subplots(1, 2), columns([1])):
        for i, (arm, label) in enumerate(ARMS.items()):
            points = [(lv["eps"], *lv["arms"][arm][column.header]) for lv in levels
                      if arm in lv["arms"]]
            defect = any((lv["arms"][arm]["guided"] or {}).get("defect") for lv in levels
                         if arm in lv["arms"])
            if defect:  # a share of guided contexts under the floor: not a result
                label += " (defect)"
            if points:
                eps, mean, low, high = zip(*sorted(points))
                ax.errorbar(eps, mean, yerr=[[m - lo for m, lo in zip(mean, low)],
                                             [hi - m for m, hi in zip(mean, high)]],
                            marker="o", capsize=3, color=f"C{i}", label=f"POPE, {label}")
        ax.axhline(0.0, color="grey", lw=0.8)
        ax.set(xscale="log",
               xlabel="eps: the base's P(right key step), teacher-forced, held-out problems",
               ylabel=f"POPE − GRPO, Δ {header(column, levels[0]['k'])}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.tight_layout()
    storage.write_figure(path, fig, dpi=110)


def main(argv: list[str]) -> int:
    root = argv[1] if len(argv) > 1 else os.path.join("docs", "results", "pope_eps")
    levels = sorted((level(f) for f in level_folders(root)), key=lambda lv: lv["eps"])
    if not levels:
        print(f"{root}: no level folder with counts.json (run configs/results.py:eps first)")
        return 1
    lines = ["# POPE minus FLOP-matched GRPO along eps", "",
             f"Generated by `python -m jaxprefix.jobs.eps_phase {root}` from each level's "
             f"counts.json; paired 95% intervals (jaxprefix/statistics.py). Guided share: the "
             f"arm's share of guided training contexts (1:1 mixing: 0.50); an arm under "
             f"{guided_share.GUIDED_SHARE_FLOOR:g} of its designed share is mostly plain GRPO, "
             f"a defect of the study, not a result. Words: 'higher'/'lower' where the interval "
             f"excludes 0, 'tie' only inside the margin its runs registered (results.tie_margin; "
             f"none before the window levels), else not distinguishable, with the smallest "
             f"difference the runs could have detected.", "", *table_lines(levels), "",
             "![phase](phase.png)"]
    storage.write_atomic(storage.join(root, "PHASE.md"), "\n".join(lines) + "\n")
    plot(levels, storage.join(root, "phase.png"))
    print(f"{root}: PHASE.md and phase.png from {len(levels)} levels")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
