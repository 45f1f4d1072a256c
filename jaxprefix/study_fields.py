"""The fields of the tiny base's SFT job (configs/sft.py; `config.sft` of the built-in tasks'
RL runs) and the docs of the blocks a study's config file adds (configs/results.py,
configs/isocompute.py, configs/tools.py): their defaults stay in those files, their docs here so
that describe lists them too. run_config gathers them with every run's fields.
"""
from __future__ import annotations

from jaxprefix import distributed
from jaxprefix.config_fields import Field

F = Field

# configs/sft.py: the tiny base policy's SFT (the demo's base; `config.sft` of its RL runs).
SFT_FIELDS = {
    "job": F("sft", "the SFT job"),
    "task": F("carry_multiplication", "the built-in task trained on"),
    "seed": F(0, "seed of initialisation and data"),
    "distributed": distributed.FIELDS,
    # 2 layers, width 64, 4 heads, MLP 4x: ~110K parameters, a few ms per step on one CPU core.
    "model": {
        "layers": F(2, "decoder layers"),
        "width": F(64, "model width"),
        "heads": F(4, "attention heads"),
        "mlp_width": F(256, "MLP hidden width"),
        "experts": F(0, "0: a dense MLP; > 0: a Qwen3-MoE of this many experts per MLP"),
        "experts_per_token": F(2, "experts a token routes to (with experts > 0)"),
    },
    # Lengths 1..20, plus a share of full 20-digit rows so the last slots train as often as the
    # first; multipliers 2..9 (1 is copying).
    "data": {
        "batch_size": F(64, "rows per step"),
        "digits": F((1, 20), "problem lengths trained on"),
        "full_length_fraction": F(0.5, "share of rows at the longest length"),
        "multipliers": F((2, 9), "multiplier range"),
        "tens_first": F(0.5, "probability of each step's '^' notation"),
        "hinted_fraction": F(0.75, "share of rows with their first steps as a hint in the "
                                   "prompt"),
    },

    # AdamW 1e-3 with warmup: the feasibility study's recipe. A lower rate widens the window.
    "lr": F(1e-3, "AdamW learning rate"),
    "warmup_steps": F(100, "linear warmup steps"),
    "weight_decay": F(1e-4, "AdamW weight decay"),
    "max_steps": F(1500, "longest SFT"),
    # Each point costs one forward pass; sampling starts once the step accuracy passes a gate.
    "eval_start": F(300, "first step evaluated"),
    "eval_every": F(25, "steps between evaluation points"),
    "criterion": {
        "k": F(16, "the mining k: hard pass@k must be exactly 0 (unless not hard_unsolved)"),
        # The overlap knob's bases (issue 28) set eps through the data: at eps ~1e-2 a base
        # solves a few hard problems whatever its step; the RL hard set is mined from it anyway.
        "hard_unsolved": F(True, "stop and choose only where hard pass@k = 0; False: the first "
                                 "point at the guided floor, hard successes allowed"),
        "hard_count": F(64, "hard problems measured at each point"),
        "hard_seed": F(10_000, "seed of those (distinct from the RL sets')"),
        "steps_left": F(2, "guided success is measured with this many steps left ..."),
        "guided_floor": F(0.25, "... and must reach this floor"),
        "guided_samples": F(8, "samples per guided measurement"),
        "guidance": F("instruction", "guided as POPE guides: 'instruction' or 'solution_prefix'"),
        "report_steps_left": F((1, 2, 4), "steps left reported at each point"),
        "sample_from_step_accuracy": F(0.3, "sampling skipped below this teacher-forced step "
                                            "accuracy"),
    },
}

# The keyed task's SFT data fields (variants._sft_keyed sets them on configs/sft.py's).
SFT_KEYED_DOCS = {
    "data.second_rule_fraction": "share of rows under rule '>' with u = v",
    "data.key_override_fraction": "share of hinted rows whose key digit is overridden",
    "data.second_rule_taught": "the overlap knob eps: share of '>' rows that show the rule "
                               "(unequal digits, the true target)",
    "data.restated_taught": "share of the other '>' rows given the rule's name at the "
                            "answer's start (no loss on it), then read by the rule",
    "data.key_names_rule": "the restating route: the key step names the rule it reads the key "
                           "by ('<' or '>' in place of '*')",
    "data.tool_fraction": "share of unhinted rows written as tool episodes: the key reader "
                          "called, its answer, then the solution (the built-in tool task)",
}
RESULTS_DOCS = {
    "seeds": "seeds of every run of the study",
    "runs": "the runs of the study (run_setup/study_arms.py RUNS)",
    "isocompute": "also the isocompute comparison",
    "report_only": "the report of the finished runs; the others are 'not run'",
    "same_problems": "every run trains on the hard problems every POPE run's search guides",
    "tie_margin": "a paired difference inside ±this is called a tie (stated before the runs; "
                  "0: nothing is)",
    "output_dir": "where the report and its plots go",
    "warm_start.epochs": "SFT warm starts: epochs over their examples",
    "warm_start.batch_size": "SFT warm starts: rows per step",
    "warm_start.learning_rate": "SFT warm starts: Adam learning rate",
    "warm_start.warmup_fraction": "SFT warm starts: share of steps warming the rate up",
    "regime.rule": "PrefixRL regime: 'hard' (the shortest length whose base pass@k is at "
                   "most max_pass) or 'middle' (rate closest to 1/sqrt(k max_samples))",
    "regime.max_pass": "PrefixRL regime: the base's largest pass@k at the 'hard' rule's length",
    "regime.probe_digits": "PrefixRL regime: problem lengths probed",
    "regime.probe_problems": "PrefixRL regime: problems probed per length",
    "regime.probe_samples": "PrefixRL regime: samples per probed problem",
    "regime.steps": "PrefixRL regime: RL steps of its runs",
    "regime.contexts_per_step": "PrefixRL regime: contexts per step",
    "regime.eval_every": "PrefixRL regime: steps between evaluations",
    "regime.eval_n": "PrefixRL regime: samples per evaluation problem",
    "regime.flops_budget": "PrefixRL regime: every arm's total FLOPs, its mining and SFT "
                           "included (0: regime.steps each)",
    "other_base.seed": "the second base's SFT seed",
    "other_base.layers": "the second base's decoder layers",
    "other_base.width": "the second base's model width",
    "other_base.mlp_width": "the second base's MLP hidden width",
    "iso_digits": "isocompute comparison: problem digit range",
    "iso_eval_size": "isocompute comparison: evaluation problems",
}
PREREG_DOCS = {
    "phase": "pre-registered sweep: 'predict' (fit, write n*) or the test",
    "fit_max": "largest budget the fit uses",
    "predict": "budgets at which n* is predicted",
    "split_digits": "held-out groups: digits <= split_digits, and above",
    "span_resamples": "bootstrap draws of the fitted n*(C) span ('degenerate': its interval "
                      "holds 0)",
}

TOOL_STUDY_DOCS = {"seeds": "seeds of every arm of the tools study (configs/tools.py)"}
