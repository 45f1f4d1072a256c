"""The results study's arms: each a method, the config fields it changes from the study's
compute-matched method config, and how it starts (warm start, regime, trace pool).

The results job runs them (`results.runs` names them); preflight checks each arm's settings as
it checks a run's; the report says what each row is (`about`).
"""
from __future__ import annotations

import dataclasses

from jaxprefix.run_setup.method_settings import contexts_per_problem
from jaxprefix.run_setup.policy import base_dir


@dataclasses.dataclass(frozen=True)
class RunSpec:
    method: str
    settings: dict          # config fields changed from the study's compute-matched method config
    about: str              # what the row is, for the report
    warm_start: str = ""    # SFT before RL on: 'oracle' | 'own_guided' | 'traces' |
    #                         'other_traces' (a second base's) | 'more_sft' (non-hard problems)
    regime: str = "hard"    # 'hard': the task's hard set; 'prefixrl': PrefixRL's regime
    pool: str = ""          # PrefixRL's traces: '' its own, 'other': a second base's
    # Run on past total_steps until the largest FLOPs of these runs at the same seed.
    flops_match: tuple[str, ...] = ()


RUNS = {
    "grpo": RunSpec("grpo", {}, "plain GRPO on the hard set"),
    "grpo_matched": RunSpec("grpo", {}, "plain GRPO on the hard set, run on to POPE's FLOPs "
                            "(pope_cap0.25's at the same seed, its mining included)",
                            flops_match=("pope_cap0.25",)),
    "grpo_matched_cap0.5": RunSpec("grpo", {}, "plain GRPO on the hard set, run on to POPE's "
                                   "FLOPs (pope_cap0.5's at the same seed, its mining included)",
                                   flops_match=("pope_cap0.5",)),
    "pope_cap1": RunSpec("pope", {"pope.max_prefix_fraction": 1.0},
                         "POPE, prefixes up to all steps but one"),
    "pope_cap0.5": RunSpec("pope", {"pope.max_prefix_fraction": 0.5},
                           "POPE, prefixes of at most half of the solution"),
    "pope_cap0.25": RunSpec("pope", {"pope.max_prefix_fraction": 0.25},
                            "POPE, prefixes of at most a quarter of the solution"),
    "pope_solution_prefix": RunSpec(
        "pope", {"pope.guidance": "solution_prefix", "pope.max_prefix_fraction": 1.0},
        "POPE with the prefix forced as the start of the answer instead of given in the prompt "
        "(PrefixRL's mechanism; the ablation of pope_cap1)"),
    "pope_no_restate": RunSpec("pope", {"pope.template": "no_restate"},
                               "POPE, the instruction forbids restating the prefix"),
    # The eps sweep's arms (configs/results.py:eps, docs/results/pope/PREDICTIONS.md): on the
    # restating notation (data.key_names_rule) POPE guides by the restating hint unless the
    # template forbids it, and then by the value hint; GRPO runs on to the larger's FLOPs.
    "pope_value_hint": RunSpec("pope", {"pope.max_prefix_fraction": 0.25,
                                        "pope.template": "no_restate"},
                               "POPE with the value hint (d and c in the prompt's key slot)"),
    "pope_restating_hint": RunSpec("pope", {"pope.max_prefix_fraction": 0.25},
                                   "POPE with the restating hint (the oracle prefix up to the "
                                   "rule's name, forced; the policy reads d and c itself)"),
    "grpo_matched_hints": RunSpec("grpo", {}, "plain GRPO on the hard set, run on to the larger "
                                  "of the two POPE arms' FLOPs at the same seed (mining included)",
                                  flops_match=("pope_value_hint", "pope_restating_hint")),
    # Issue 44: is one step off-policy (docs/OVERLAP.md) as good as the synchronous loop?
    "grpo_one_step_off": RunSpec("grpo", {"train.max_staleness": 1},
                                 "plain GRPO on the hard set, one step off-policy (each step "
                                 "sampled with the weights of one update before)"),
    "grpo_inflight": RunSpec("grpo", {"train.max_staleness": 1, "rollout.inflight_kv": "keep"},
                             "GRPO one step off, newer weights taking over mid-decode (each "
                             "token drawn by the newest weights published, up to the step's own)"),
    "grpo_entropy": RunSpec("grpo", {"train.entropy_coef": 0.01}, "GRPO + entropy bonus"),
    "grpo_pass_at_k": RunSpec("grpo", {"train.advantage": "pass_at_k", "train.pass_k": 4},
                              "GRPO with pass@k advantages (Chen et al. 2025)"),
    "grpo_easy": RunSpec("pope", {"pope.guided_copies": 0, "pope.unguided_copies": 1,
                                  "data.easy_size": 1024},
                         "hard + as many easy (1..10-digit) problems, no guidance"),
    # A warm start's row says what the SFT learnt from (results_report: "SFT on ..., then GRPO").
    # Not transfer: the SFT trains the unguided question followed by the answer, key step and all.
    "sft_guided": RunSpec("grpo", {}, "POPE's SFT baseline (direct supervision of the unguided "
                          "question's answer, not transfer)", warm_start="own_guided"),
    "sft_oracle": RunSpec("grpo", {}, "the oracle solutions' SFT baseline", warm_start="oracle"),
    "prefixrl": RunSpec("prefixrl", {}, "PrefixRL with its own rejection-sampled traces (limit "
                        "case: few traces exist)"),
    "prefixrl_oracle": RunSpec("prefixrl", {"prefixrl.oracle_traces": True},
                               "PrefixRL's cuts and mix on the oracle solutions"),
    "prefixrl_regime": RunSpec("prefixrl", {}, "PrefixRL with its own traces, in its regime",
                               regime="prefixrl"),
    "sft_traces_regime": RunSpec("grpo", {}, "PrefixRL's SFT baseline, in its regime",
                                 warm_start="traces", regime="prefixrl"),
    # PrefixRL's controls (studies/prefixrl_controls.py): which explanation of SFT's lead survives.
    "grpo_regime": RunSpec("grpo", {}, "plain GRPO on the regime's hard set", regime="prefixrl"),
    "sft_more_regime": RunSpec("grpo", {}, "the more-SFT control (is the base just "
                               "undertrained?): SFT on the base's own traces of problems it "
                               "already solves", warm_start="more_sft", regime="prefixrl"),
    "prefixrl_other_regime": RunSpec("prefixrl", {}, "PrefixRL on a second base's traces "
                                     "(off-policy traces)", regime="prefixrl", pool="other"),
    "sft_other_traces_regime": RunSpec("grpo", {}, "the off-policy SFT baseline",
                                       warm_start="other_traces", regime="prefixrl"),
}


def arm_config(config, workdir: str, mining_dir: str, method: str, seed: int | None = None):
    """One method's rl config in a study of `config` (its base in `workdir`, its mining in
    `mining_dir`), at POPE's rollouts per step: the same contexts a step for every method."""
    c = config.copy_and_resolve_references()
    c.job, c.method = "rl", method
    c.seed = config.seed if seed is None else seed
    c.model.path = base_dir(config, workdir)
    c.mining.dir = mining_dir
    contexts = config.train.problems_per_step * contexts_per_problem(config, "pope")
    c.train.problems_per_step = max(1, contexts // contexts_per_problem(config, method))
    return c
