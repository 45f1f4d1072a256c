"""Regenerates docs/RESULTS.md: GRPO vs POPE vs PrefixRL on the demo task, ablations, IsoCompute.

    python -m jaxprefix.main --config=configs/results.py --workdir=runs/results     # ~2 h, 2 cores
    python -m jaxprefix.main --config=configs/results.py:smoke --workdir=/tmp/results_smoke

Not part of CI. Each run has its own workdir under --workdir: rerunning resumes, finished runs
are only re-evaluated.
"""
import ml_collections

from jaxprefix import run_config


def get_config(arg: str = ""):
    c, args = run_config.method_config(__file__, "pope", arg)
    c.job = "results"
    c.results = ml_collections.ConfigDict(dict(
        seeds=(0, 1, 2), isocompute=True, output_dir="docs",
        # at every seed: hard + easy without guidance (ray interference), PrefixRL on oracle
        # solutions, SFT on oracle solutions then GRPO, POPE's "do not restate" instruction
        # (instruction-following policies only)
        ablations=("grpo_easy", "prefixrl_oracle", "sft_oracle", "pope_no_restate"),
        # sft_oracle's warm start: Adam at the base SFT's rate over the hard training problems
        sft_oracle=dict(epochs=10, batch_size=64, learning_rate=1e-3)))
    c.prefixrl.update(samples_per_round=64, max_samples=512)
    if args.variant == "smoke":
        c.results.update(seeds=(0,), output_dir="", isocompute=False)
        c.isocompute.update(budgets=(32, 64), ns=(2, 4), batches=(4, 8), eval_every_rollouts=16)
    return c
