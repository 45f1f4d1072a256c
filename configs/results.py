"""Regenerates docs/RESULTS.md: the papers' mechanisms and baselines on the demo task.

    python -m jaxprefix.main --config=configs/results.py --workdir=runs/results     # hours, 2 cores
    python -m jaxprefix.main --config=configs/results.py:smoke --workdir=/tmp/results_smoke

Not part of CI. Each run has its own workdir under --workdir: rerunning resumes, finished runs
are only re-evaluated. jobs/results.py lists the runs (RUNS) and what each changes.
"""
import ml_collections

from jaxprefix import run_config

# The study: POPE at three prefix caps, the papers' baselines that fail on hard problems, and
# PrefixRL in its own regime against its SFT baseline. Left out for the 2-core budget (each is a
# RUNS entry of jobs/results.py, run with --config.results.runs=...): pope_solution_prefix (the
# forced-prefix ablation), prefixrl (the 20-digit limit case), prefixrl_oracle, sft_oracle.
RUNS = ("grpo", "pope_cap1", "pope_cap0.5", "pope_cap0.25", "prefixrl_regime",
        "sft_traces_regime", "grpo_entropy", "grpo_pass_at_k", "grpo_easy", "sft_guided")


def get_config(arg: str = ""):
    c, args = run_config.method_config(__file__, "pope", arg)
    c.job = "results"
    if args.variant != "smoke":
        # Study budget on a 2-core machine: 60 RL steps a run (the demo runs 100), the setting
        # docs/RESULTS.md was measured at.
        c.train.total_steps = 60
    c.results = ml_collections.ConfigDict(dict(
        seeds=(0, 1, 2), runs=RUNS, isocompute=True, output_dir="docs",
        # The SFT warm starts (sft_guided, sft_oracle, sft_traces_regime): Adam at the base
        # SFT's rate, 10 epochs over their examples, the rate warmed up over the first 30% (the
        # lowest final SFT loss of 1e-3, 3e-4, 1e-4 on the own guided answers; without a warmup
        # the loss jumped 0.58 -> 2.8 at step 2 and ended at 0.48, with it at 0.31).
        warm_start=dict(epochs=10, batch_size=64, learning_rate=1e-3, warmup_fraction=0.3),
        # PrefixRL's regime: the problem length (of these) whose measured base success rate is
        # closest to 1 / sqrt(mining.k * prefixrl.max_samples); probe_problems x probe_samples.
        regime=dict(probe_digits=(8, 10, 12, 14, 16, 18), probe_problems=32, probe_samples=32),
        # The IsoCompute sweep: mid-length problems, a held-out set large enough to separate n.
        iso_digits=(6, 12), iso_eval_size=512))
    # Rejection sampling: 64 a round, up to 512 per problem (the paper: ~650 on average, capped
    # at 2,500), for the 20-digit limit case and for PrefixRL's regime.
    c.prefixrl.update(samples_per_round=64, max_samples=512)
    # B held at 16 (the paper: B matters little, choose n first), n over 2..16, three seeds,
    # evaluated every 2^11 rollouts on 512 held-out problems x 4 samples.
    c.isocompute.update(seeds=(0, 1, 2), budgets=tuple(2**e for e in range(11, 16)),
                        ns=(2, 4, 8, 16), batches=(16,), eval_every_rollouts=2**11)
    if args.variant == "smoke":
        c.results.update(seeds=(0,), output_dir="", isocompute=False, iso_eval_size=8)
        c.results.regime.update(probe_digits=(2, 4), probe_problems=4, probe_samples=4)
        c.isocompute.update(budgets=(32, 64), ns=(2, 4), batches=(4, 8), eval_every_rollouts=16)
    return c
