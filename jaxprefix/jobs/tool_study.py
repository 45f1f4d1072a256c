"""The tools study: does RL with the key reader solve the hard problems RL without it cannot?

    python -m jaxprefix.main --config=configs/tools.py --workdir=runs/tools
    python -m jaxprefix.main --config=configs/tools.py:smoke --workdir=/tmp/tools_smoke

The built-in tool task (docs/TOOLS.md): keyed_multiplication's hard problems (rule '>', 8
digits), which the demo's base fails at the key step, and a tool that reads the key by its rule.

1. SFT the base (configs/sft.py:tools): the demo's keyed base, a share of whose unhinted rows
   are tool episodes (the key reader called, its answer copied into the key step).
2. At each seed of tool_study.seeds, from that base: GRPO with tools (episodes of
   rollout.max_turns turns, the environment and tools of config.tools), then, each run on to
   the tools arm's FLOPs (every sampled, observation and re-prefilled token booked), GRPO
   without (one turn, no tool) and the two controls that separate what the key gives from what
   RL on tool episodes learns (issue 43): the key given in the prompt with no tool
   (data.key_given, one turn), and an uninformative tool (`read_key_blind`: the same call,
   answer format and turns, answering by rule '<' whatever is asked).
3. Evaluate the base every way and each trained policy as it was trained on the held-out hard
   problems, unguided, eval.n samples each, one seed for all;
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
from jaxprefix.run_setup.problem_sets import load_problem_sets
from jaxprefix.run_setup.policy import base_dir
from jaxprefix.studies import study_tables
from jaxprefix.studies.study import problem_groups
from jaxprefix.studies.study_tables import Column, Row
from jaxprefix.rl import scoring
from jaxprefix.sampling import RolloutSpec
from jaxprefix.tools.settings import ToolSettings

# The tools arm first: the others run on to its FLOPs.
ARMS = ("tools", "no_tools", "key_given", "blind_tool")
ONE_TURN = ("no_tools", "key_given")  # one turn, no tool
RECORD = "record.json"
REPORT = "tool_study_report"


def arm_config(config, arm: str, seed: int, base: str):
    """One arm's rl config: the study's, from its base, with the tools, with one turn and none
    (the tools block at its defaults; key_given: every problem's key in its prompt), or with
    the uninformative reader in place of the key reader."""
    c = config.copy_and_resolve_references()
    c.job, c.seed, c.model.path = "rl", seed, base
    if arm in ONE_TURN:
        c.rollout.max_turns = 1
        c.tools = run_config.base_config().tools
    if arm == "key_given":
        c.data.key_given = True
    if arm == "blind_tool":
        c.tools.names = tuple("read_key_blind" if n == "read_key" else n for n in c.tools.names)
    return c


@dataclasses.dataclass(frozen=True)
class Evaluation:
    """How the study evaluates every policy: its config, read once into the rollout spec, and
    each arm's held-out problems and tools' settings (None: one turn)."""
    config: object
    rollout: RolloutSpec
    problems: dict
    tools: dict

    @classmethod
    def from_config(cls, config, base: str) -> "Evaluation":
        arms = {arm: arm_config(config, arm, config.seed, base) for arm in ARMS}
        return cls(config, RolloutSpec.from_config(config.rollout),
                   {arm: load_problem_sets(c.data).eval for arm, c in arms.items()},
                   {arm: None if arm in ONE_TURN else ToolSettings.from_config(c)
                    for arm, c in arms.items()})


def evaluate(how: Evaluation, policy, model, arm: str) -> dict:
    """pass@k and each problem's correct samples (eval.n each) of `model` on the held-out
    problems as `arm` trains (the key in the prompt for key_given), unguided, as episodes with
    its tools or as one turn; one seed for every model."""
    config, problems, tools = how.config, how.problems[arm], how.tools[arm]
    request = scoring.RolloutRequest(contexts=[policy.prompts.question(p) for p in problems],
                                  problems=list(problems), tags={}, n=config.eval.n)
    episodes = scoring.EpisodeSource(tools.episode_rollout(
        policy.tokenizer, model.config.max_position_embeddings)) if tools else None
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
    how = Evaluation.from_config(config, base)
    report = {"eval_problems": len(sets.eval), "eval_n": config.eval.n,
              "base": {arm: evaluate(how, policy, policy.model, arm) for arm in ARMS},
              "runs": {arm: [] for arm in ARMS}}
    for seed in config.tool_study.seeds:
        for arm in ARMS:
            c = arm_config(config, arm, seed, base)
            if arm != "tools":  # run on to the tools arm's FLOPs (no mining on any)
                c.train.flops_budget = report["runs"]["tools"][-1]["flops"]
                c.train.total_steps *= 10  # the budget, not the steps, ends it
            report["runs"][arm].append(_run(how, c, policy, arm,
                                            storage.join(workdir, f"{arm}_seed{seed}")))
    _write(report, config, workdir)
    return report


def _run(how: Evaluation, c, policy, arm: str, run_dir: str) -> dict:
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
              "after": evaluate(how, policy, out["policy"].model, arm)}
    storage.write_json(saved, record, default=float)
    return record


LABELS = {"tools": "with tools", "no_tools": "without tools",
          "key_given": "with the key in the prompt, no tool",
          "blind_tool": "with an uninformative tool"}


def _rows(report: dict) -> dict[str, Row]:
    """The base's and each arm's rows, of the arms the record has (a study from before the
    controls has two)."""
    rows = {f"base_{arm}": Row(f"base, {LABELS[arm]}", [{"after": base}])
            for arm, base in report["base"].items()}
    rows |= {arm: Row(f"GRPO {LABELS[arm]}", records, [r["flops"] for r in records])
             for arm, records in report["runs"].items()}
    return rows


# What each comparison separates: RL with the key reader against RL without, against RL with the
# key handed over (what calling it costs or adds), against RL with a reader that answers nothing
# the problem needs (what its answers, not the call format and turns, give); and each arm's RL.
COMPARISONS = (("tools", "no_tools"), ("tools", "key_given"), ("tools", "blind_tool"),
               ("key_given", "no_tools"), ("blind_tool", "no_tools"))


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
    pairs = [(rows[a], rows[b]) for a, b in COMPARISONS if a in rows and b in rows]
    pairs += [(rows[arm], rows[f"base_{arm}"]) for arm in ARMS if arm in rows]
    lines += [""] + study_tables.comparison_table(pairs, columns)
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
    steps = {arm: ", ".join(str(r["steps"]) for r in report["runs"][arm]) for arm in ARMS}
    text = (f"Held-out hard problems ({report['eval_problems']}), unguided, {report['eval_n']} "
            f"samples each, seeds {list(config.tool_study.seeds)}. GRPO with tools: "
            f"{config.train.total_steps} steps of episodes of up to {config.rollout.max_turns} "
            f"turns ({', '.join(config.tools.names)}; environment "
            f"{config.tools.environment}). Run on to its FLOPs: GRPO without tools (one turn; "
            f"{steps['no_tools']} steps), with the key in the prompt and no tool (one turn; "
            f"{steps['key_given']} steps), and with an uninformative tool (read_key_blind: the "
            f"same call and turns, answering by rule '<'; {steps['blind_tool']} steps). Each "
            f"policy is evaluated as it was trained; the base every way. {CELLS}\n\n"
            + tables(report, config.eval.ks) + "\n")
    print("\n" + text)
    storage.write_atomic(storage.join(workdir, f"{REPORT}.md"), text)
    storage.write_json(storage.join(workdir, f"{REPORT}.json"), report, default=float)
