"""The demo: on problems where plain GRPO gets little signal, does POPE make the policy solve them?

    python -m jaxprefix.main --config=configs/pope.py              # ~11 minutes on 2 idle cores

The regime the overlap study pre-registered as the paper's mechanism (configs/pope.py,
docs/DEMO_TASK.md "The demo's regime"): the key step names its rule and POPE's hint is the
oracle prefix up to that name, so the policy reads the key itself.

1. SFT a tiny policy on the built-in keyed_multiplication task, stopping at a measured window
   (hard problems at most rarely solved alone, solved when the key step, the first of 9, is
   given).
2. Mine the hard set (0 of k) and each hard problem's shortest solvable oracle prefix of at most
   pope.max_prefix_fraction of the solution (the demo: the restating hint); a problem with none
   is handled as pope.unsolved says and counted (the demo: dropped from both runs, so POPE and
   GRPO train on the same problems and POPE guides every one of them, issue 43).
3. Train POPE, then plain GRPO from the same base at the same rollouts per step, run on to
   POPE's FLOPs (its prefix search included).
4. Evaluate both, unguided, on held-out hard problems; print a table and write
   <workdir>/demo_report.{md,json} and <workdir>/demo_curves.png.

Nothing here is tuned to a result: the numbers are whatever the runs measure.
"""
from __future__ import annotations

import time

import numpy as np

from jaxprefix import statistics, storage
from jaxprefix.jobs.rl import run_rl
from jaxprefix.jobs.study_setup import guiding_searches, study_of
from jaxprefix.rl.compute_ledger import ComputeLedger
from jaxprefix.rl.metrics import read_metrics
from jaxprefix.run_setup.mining import mined_artifacts
from jaxprefix.run_setup.study_arms import arm_config

# Each method, and the run whose FLOPs it runs on to (its prefix search included): POPE first.
RUNS = {"pope": None, "grpo": "pope"}
UNSOLVED = {"drop": "dropped from both runs' training (POPE and GRPO train on the same "
                    "problems)", "longest": "guided by the longest prefix tried",
            "unguided": "kept in POPE's training, unguided"}


def run_demo(config, workdir: str) -> dict:
    study = study_of(config, workdir)
    hard = study.hard
    search = study.prefix_search()
    report = {"hard_set": {"candidates": len(study.sets.train), "hard": len(hard.problems),
                           "k": hard.k},
              "prefixes": {"guidance": config.pope.guidance,
                           "max_prefix_fraction": config.pope.max_prefix_fraction,
                           "found": sum(v is not None for v in search["shortest_units"].values()),
                           "revealed_fractions": search["revealed_fractions"]},
              "eval_problems": len(study.sets.eval),
              "base": study.evaluate(study.policy.model, "eval base"), "runs": {}}
    if config.pope.unsolved == "drop":  # GRPO on the problems POPE guides, as POPE
        study = study.on_problems_all_guide(guiding_searches([_method_config(config, study,
                                                                             "pope")]))
    for method, matched in RUNS.items():
        started = time.perf_counter()
        config_ = _method_config(config, study, method)
        if matched:
            flops = ComputeLedger.from_dict(report["runs"][matched]["ledger"]).total_flops
            config_.train.flops_budget = flops - study.mining.cost(
                mined_artifacts(config_)).extra_flops
            config_.train.total_steps *= 10  # the budget, not the steps, ends it
        out = run_rl(config_, storage.join(workdir, method))
        report["runs"][method] = {
            "after": study.evaluate(out["policy"].model, f"eval {method}"),
            "steps": out["step"],
            "ledger": out["ledger"].to_dict(),
            "seconds": time.perf_counter() - started,
        }
    _write(report, workdir, config)
    return report


def _method_config(config, study, method: str):
    return arm_config(config, study.workdir, study.mining.dir, method)


def _cell(evaluation: dict, k: int) -> str:
    """pass@k [95% t-interval over the held-out problems] (one seed: no std); with no
    success, the one-sided 95% bound on the per-sample rate."""
    counts = evaluation["correct_counts"]
    scores = statistics.pass_at_k_table([counts], evaluation["num_samples"], k)
    low, high = statistics.bootstrap_interval(scores)
    bound = "" if any(counts) else statistics.zero_bound_note(len(counts)
                                                               * evaluation["num_samples"])
    return f"{evaluation[f'pass@{k}']:.3f} [{low:.3f}, {high:.3f}]{bound}"


def table(report: dict, ks) -> str:
    """The demo's result as a markdown table."""
    keys = [f"pass@{k}" for k in ks]
    lines = ["| policy | " + " | ".join(keys) + " | rollouts | FLOPs (incl. mining) |",
             "|---" * (len(keys) + 3) + "|"]
    base = report["base"]
    lines.append("| base (SFT) | " + " | ".join(_cell(base, k) for k in ks) + " | 0 | 0 |")
    for method, run in report["runs"].items():
        ledger = run["ledger"]
        total = ComputeLedger.from_dict(ledger).total_flops
        lines.append(f"| {method.upper()} ({run['steps']} steps) | "
                     + " | ".join(_cell(run["after"], k) for k in ks)
                     + f" | {ledger['rollouts']} | {total:.3g} |")
    return "\n".join(lines)


def _write(report: dict, workdir: str, config) -> None:
    prefixes = report["prefixes"]
    fractions = prefixes["revealed_fractions"] or [float("nan")]
    text = (f"Held-out hard problems ({report['eval_problems']}), unguided, "
            f"{config.eval.n} samples each. Hard set: {report['hard_set']['hard']} of "
            f"{report['hard_set']['candidates']} candidates solved 0 of "
            f"{report['hard_set']['k']} times by the base policy. POPE's guidance "
            f"({_guidance(config)}): a solvable oracle prefix for {prefixes['found']} of them "
            f"(revealing {np.min(fractions):.2f}-{np.max(fractions):.2f} of the solution, median "
            f"{np.median(fractions):.2f}); the others are "
            + UNSOLVED[config.pope.unsolved] + ". GRPO runs on to POPE's FLOPs. Cells: "
            "pass@k [95% t-interval over the problems].\n\n"
            + table(report, config.eval.ks) + "\n")
    print("\n" + text)
    storage.write_atomic(storage.join(workdir, "demo_report.md"), text)
    storage.write_json(storage.join(workdir, "demo_report.json"), report)
    plot_curves(workdir, list(report["runs"]), storage.join(workdir, "demo_curves.png"),
                ks=config.eval.ks, base=report["base"])


def _guidance(config) -> str:
    if config.data.get("key_names_rule") and config.pope.template == "default":
        return ("the restating hint: the oracle answer up to the rule's name, one forced "
                "token; the fractions revealed are the search's lengths, which all force it")
    return config.pope.guidance


def plot_curves(workdir: str, methods, path: str, ks, base: dict | None = None) -> None:
    """Held-out pass@k (from the base's at step 0) and training rewards (guided apart from
    unguided) against steps."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4))
    left, right = fig.subplots(1, 2)
    for method in methods:
        records = read_metrics(storage.join(workdir, method))
        for k in ks[-1:]:
            points = [(0, base[f"pass@{k}"])] if base else []
            points += [(r["step"], r[f"eval/pass@{k}"]) for r in records if f"eval/pass@{k}" in r]
            if points:
                left.plot(*zip(*points), marker="o", label=f"{method} pass@{k}")
        for tag in ("guided", "unguided"):
            points = [(r["step"], r[f"reward/{tag}"]) for r in records if f"reward/{tag}" in r]
            if points:
                right.plot(*zip(*points), label=f"{method} {tag}", alpha=0.8)
    left.set(title="held-out hard problems, unguided", xlabel="RL step", ylabel="pass@k")
    right.set(title="training reward", xlabel="RL step", ylabel="mean reward")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    storage.write_figure(path, fig, dpi=110)
