"""Every committed table, rebuilt from the committed per-problem counts: the one command.

    python -m jaxprefix.jobs.report_tables            # every report under docs/results
    python -m jaxprefix.jobs.report_tables docs/results/pope

The study jobs write `counts.json` beside each report (`write_counts` below: the results
record and its config; jobs/isocompute_prereg.py: each run's per-problem counts at every
evaluation), and a rerun commits them with the report: runs/ is not committed, so without them
a table could not be re-derived, and a change to the statistics could not be applied to it.
A folder with REPORT.md and counts.json from the results job gets REPORT.md (and its figures)
again, its hand-written notes kept; one with prediction.json gets outcome.json and REPORT.md
again from the prediction as committed (a pre-registered prediction is never refitted).
A folder with the tool study's record (report.json: its per-problem counts in every
evaluation) gets its REPORT.md tables again, its description paragraph kept. A report folder
with none of these is listed as such: its tables cannot be rebuilt.
"""
from __future__ import annotations

import os
import sys

import ml_collections

from jaxprefix import storage
from jaxprefix.jobs import isocompute_prereg, tool_study
from jaxprefix.run_setup.study_settings import ReportSettings
from jaxprefix.studies import results_report

DOCS = os.path.join("docs", "results")
TOOL_STUDY_RECORD = "report.json"  # the tool study's record, committed as tool_study_report.json


def regenerate(folder: str) -> str:
    """Rebuilds the report of one folder from its counts.json; what it did, in a line."""
    counts = storage.join(folder, results_report.COUNTS)
    if storage.exists(storage.join(folder, TOOL_STUDY_RECORD)):
        tool_study.rebuild_report(folder)
        return f"{folder}: REPORT.md's tables from report.json (the tool study's record)"
    if not storage.exists(counts):
        return f"{folder}: no counts.json: its tables cannot be rebuilt (rerun the study)"
    prediction = storage.join(folder, isocompute_prereg.PREDICTION)
    if storage.exists(prediction):
        prediction = storage.read_json(prediction)
        curves, groups, seeds = isocompute_prereg.read_counts(counts)
        outcome = isocompute_prereg.outcome_of(prediction, curves, groups, seeds)
        storage.write_json(storage.join(folder, isocompute_prereg.OUTCOME), outcome)
        storage.write_atomic(storage.join(folder, isocompute_prereg.REPORT), "\n".join(
            isocompute_prereg.report_lines(prediction, outcome)) + "\n")
        return f"{folder}: outcome.json and REPORT.md from counts.json and prediction.json"
    from jaxprefix.run_setup.study_arms import RUNS

    record = storage.read_json(counts)
    config = ml_collections.ConfigDict(record["config"])
    config.results.output_dir = folder
    results_report.write_report(record["report"], ReportSettings.from_config(config, RUNS),
                                record["workdir"], RUNS)
    return f"{folder}: REPORT.md from counts.json"


def write_counts(report: dict, config, workdir: str) -> str:
    """counts.json in the report's folder (results.output_dir, else the workdir): the results
    record (each evaluation's per-problem correct counts, samples, groups; ledgers; curves)
    and the config it ran under, from which `regenerate` rebuilds the report. Its path."""
    path = storage.join(config.results.output_dir or workdir, results_report.COUNTS)
    storage.write_json(path, {"workdir": workdir, "config": config.to_dict(), "report": report},
                       indent=None, default=float)
    return path


def report_folders(root: str = DOCS) -> list[str]:
    """The folders under `root` (and root itself) that hold a REPORT.md."""
    return sorted(d for d, _, files in os.walk(root) if "REPORT.md" in files)


def main(argv: list[str]) -> int:
    folders = argv[1:] or report_folders()
    for folder in folders:
        print(regenerate(folder))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
