"""The tools study: does RL with the key reader solve the hard problems RL without it cannot?

    python -m jaxprefix.main --config=configs/tools.py --workdir=runs/tools
    python -m jaxprefix.main --config=configs/tools.py:smoke --workdir=/tmp/tools_smoke

The built-in tool task (docs/TOOLS.md): keyed_multiplication's hard problems (rule '>', 8
digits), which the demo's base fails at the key step, and a tool that reads the key by its rule.

1. SFT the base (configs/sft.py:tools): the demo's keyed base, a share of whose unhinted rows
   are tool episodes (the key reader called, its answer copied into the key step).
2. At each seed of tool_study.seeds, from that base: GRPO with tools (episodes of
   rollout.max_turns turns, the environment and tools of config.tools), then GRPO without
   (one turn, no tool) run on to the tools arm's FLOPs (every sampled, observation and
   re-prefilled token booked).
3. Evaluate the base both ways and each trained policy as it was trained (with tools or
   without) on the held-out hard problems, unguided, eval.n samples each, one seed for all;
   write <workdir>/tool_study_report.{md,json}: pass@k with 95% intervals over seeds and
   problems (jaxprefix/statistics.py) and the paired differences.

Each run has its own workdir (<arm>_seed<seed>); rerunning the command resumes, and finished
runs are only read back. Nothing is tuned to an outcome: the report states what was measured.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from jaxprefix import evaluation, run_config, storage
from jaxprefix.jobs.rl import run_rl
from jaxprefix.run_setup.learner_settings import reward_settings
from jaxprefix.run_setup.mining import set_up
from jaxprefix.run_setup.policy import base_dir
from jaxprefix.studies import study_tables
from jaxprefix.studies.study import problem_groups
from jaxprefix.studies.study_tables import Column, Row
from jaxprefix.rl import scoring
from jaxprefix.sampling import RolloutSpec
from jaxprefix.tools.settings import ToolSettings

ARMS = ("tools", "no_tools")  # the tools arm first: the other runs on to its FLOPs
RECORD = "record.json"
REPORT = "tool_study_report"


def arm_config(config, arm: str, seed: int, base: str):
    """One arm's rl config: the study's, from its base, with the tools or with one turn and
    none (the tools block at its defaults)."""
    c = config.copy_and_resolve_references()
    c.job, c.seed, c.model.path = "rl", seed, base
    if arm == "no_tools":
        c.rollout.max_turns = 1
        c.tools = run_config.base_config().tools
    return c


@dataclasses.dataclass(frozen=True)
class Evaluation:
    """How the study evaluates every policy: its config, read once into the rollout spec and the
    tools' settings."""
    config: object
    rollout: RolloutSpec
    tools: ToolSettings

    @classmethod
    def from_config(cls, config) -> "Evaluation":
        return cls(config, RolloutSpec.from_config(config.rollout),
                   ToolSettings.from_config(config))


def evaluate(how: Evaluation, policy, model, problems, *, with_tools: bool) -> dict:
    """pass@k and each problem's correct samples (eval.n each) of `model` on `problems`,
    unguided, as episodes with the study's tools or as one turn; one seed for every model."""
    config = how.config
    request = scoring.RolloutRequest(contexts=[policy.prompts.question(p) for p in problems],
                                  problems=list(problems), tags={}, n=config.eval.n)
    episodes = scoring.EpisodeSource(how.tools.episode_rollout(
        policy.tokenizer, model.config.max_position_embeddings)) if with_tools else None
    scored = scoring.sample_and_score(model, policy.tokenizer, request, reward_settings(config),
                                   rollout=how.rollout, seed=config.seed + 7,
                                   stop_ids=policy.stop_ids, episodes=episodes)
    return (evaluation.summarize(scored.rewards, config.eval.ks)
            | scoring.turn_metrics([scored])
            | {"correct_counts": [int(c) for c in (scored.rewards > 0.5).sum(axis=1)],
               "groups": problem_groups(problems)})


def run_tool_study(config, workdir: str) -> dict:
    policy, sets, _ = set_up(config, workdir)  # the base is trained first when absent
    base = base_dir(config, workdir)
    how = Evaluation.from_config(config)
    report = {"eval_problems": len(sets.eval), "eval_n": config.eval.n,
              "base": {arm: evaluate(how, policy, policy.model, sets.eval,
                                     with_tools=arm == "tools") for arm in ARMS},
              "runs": {arm: [] for arm in ARMS}}
    for seed in config.tool_study.seeds:
        for arm in ARMS:
            c = arm_config(config, arm, seed, base)
            if arm == "no_tools":  # run on to the tools arm's FLOPs (no mining on either)
                c.train.flops_budget = report["runs"]["tools"][-1]["flops"]
                c.train.total_steps *= 10  # the budget, not the steps, ends it
            report["runs"][arm].append(_run(how, c, policy, sets, arm,
                                            storage.join(workdir, f"{arm}_seed{seed}")))
    _write(report, config, workdir)
    return report


def _run(how: Evaluation, c, policy, sets, arm: str, run_dir: str) -> dict:
    """Trains one arm at one seed (config `c`; or reads its finished record) and evaluates it
    as the study evaluates every policy."""
    saved = storage.join(run_dir, RECORD)
    if storage.exists(saved):
        record = storage.read_json(saved)
        if record["config_steps"] == c.train.total_steps and \
                record["flops_budget"] == c.train.flops_budget:
            return record
    out = run_rl(c, run_dir)
    record = {"seed": c.seed, "steps": out["step"], "config_steps": c.train.total_steps,
              "flops_budget": c.train.flops_budget, "ledger": out["ledger"].to_dict(),
              "flops": out["ledger"].total_flops,
              "after": evaluate(how, policy, out["policy"].model, sets.eval,
                                with_tools=arm == "tools")}
    storage.write_json(saved, record, default=float)
    return record


LABELS = {"tools": "with tools", "no_tools": "without tools"}


def _rows(report: dict) -> dict[str, Row]:
    rows = {f"base_{arm}": Row(f"base, {LABELS[arm]}", [{"after": report["base"][arm]}])
            for arm in ARMS}
    rows |= {arm: Row(f"GRPO {LABELS[arm]}", records, [r["flops"] for r in records])
             for arm, records in report["runs"].items()}
    return rows


def tables(report: dict, ks) -> str:
    """The study's markdown: pass@k per arm, tool use, the paired differences."""
    rows = _rows(report)
    columns = [Column(f"pass@{k}", "after", k) for k in ks if k <= report["eval_n"]]
    lines = study_tables.metric_table(list(rows.values()), columns)
    lines += ["", "| run | tool calls per episode | failed calls | turns per episode |",
              "|---|---|---|---|"]
    for row in rows.values():
        evals = [r["after"] for r in row.evals]
        episodes = report["eval_problems"] * report["eval_n"] * len(evals)
        calls = sum(e["rollout/tool_calls"] for e in evals)
        lines.append(f"| {row.label} | {calls / episodes:.3f} | "
                     f"{sum(e['rollout/tool_failures'] for e in evals):.0f} | "
                     f"{np.mean([e['rollout/turns_mean'] for e in evals]):.3f} |")
    lines += [""] + study_tables.comparison_table(
        [(rows["tools"], rows["no_tools"]), (rows["tools"], rows["base_tools"]),
         (rows["no_tools"], rows["base_no_tools"])], columns)
    return "\n".join(lines)


CELLS = ("Cells: mean ± std over seeds [95% interval over seeds and problems, "
         "jaxprefix/statistics.py]; differences paired.")


def rebuild_report(folder: str) -> None:
    """REPORT.md of a committed study folder again from its report.json (the tool study's
    record, every per-problem count in it): its description paragraph kept, the cells'
    sentence and every table rebuilt."""
    report = storage.read_json(storage.join(folder, "report.json"))
    committed = storage.read_text(storage.join(folder, "REPORT.md"))
    described = committed.split("\n\n", 1)[0].split(" Cells: ", 1)[0]
    ks = sorted(int(k.split("@")[1]) for k in report["base"]["tools"] if k.startswith("pass@"))
    storage.write_atomic(storage.join(folder, "REPORT.md"),
                         f"{described} {CELLS}\n\n{tables(report, ks)}\n")


def _write(report: dict, config, workdir: str) -> None:
    steps = [r["steps"] for r in report["runs"]["no_tools"]]
    text = (f"Held-out hard problems ({report['eval_problems']}), unguided, {report['eval_n']} "
            f"samples each, seeds {list(config.tool_study.seeds)}. GRPO with tools: "
            f"{config.train.total_steps} steps of episodes of up to {config.rollout.max_turns} "
            f"turns ({', '.join(config.tools.names)}; environment "
            f"{config.tools.environment}); GRPO without tools: one turn, run on to the tools "
            f"arm's FLOPs ({', '.join(map(str, steps))} steps). Each policy is evaluated as it "
            f"was trained; the base both ways. {CELLS}\n\n"
            + tables(report, config.eval.ks) + "\n")
    print("\n" + text)
    storage.write_atomic(storage.join(workdir, f"{REPORT}.md"), text)
    storage.write_json(storage.join(workdir, f"{REPORT}.json"), report, default=float)
