"""IsoCompute: sweep (n, B) at several budgets of rollouts, then fit the compute-optimal frontier.

    python -m jaxprefix.main --config=configs/isocompute.py --workdir=/tmp/iso           # sweep + fit
    python -m jaxprefix.main --config=configs/isocompute.py:fit --workdir=/tmp/iso       # refit
    python -m jaxprefix.main --config=configs/isocompute.py:smoke --workdir=/tmp/iso_smoke
    python -m jaxprefix.main --config=configs/isocompute.py --config.isocompute.print_only=True
    python -m jaxprefix.main --config=configs/isocompute.py:prereg --workdir=/tmp/iso_prereg

Compute C = B * n * M rollouts. Each (n, B) runs once per seed at the largest budget and is
evaluated on the way (avg@4 on held-out problems), so the smaller budgets are points on its curve;
its learning rate is train.learning_rate at isocompute.lr_reference_rollouts rollouts a step,
scaled by isocompute.lr_rule ('sqrt', the paper's). The fit writes frontier.json, whose allocation
rule any run can use: `--config.isocompute.budget=C --config.isocompute.frontier_path=.../frontier.json`
(`isocompute.budget_unit=flops` for a budget in FLOPs). The demo sweep uses mid-length
carry-multiplication problems (6..12 digits), where plain GRPO has signal.
"""
import os

import ml_collections

from jaxprefix import run_config, variants


def get_config(arg: str = ""):
    args = run_config.parse_arg(arg, variant="demo")
    # On the demo tasks the sweep studies plain GRPO on carry_multiplication's mid-length
    # problems; smollm2, paper, colab are the method config's own.
    base = {"demo": "carry", "fit": "carry", "prereg": "carry"}.get(args.variant, args.variant)
    base = "carry_smoke" if base.endswith("smoke") else base
    c, _ = variants.method_config(__file__, "grpo", ",".join([base] + arg.split(",")[1:]))
    c.job = "prereg" if args.variant.startswith("prereg") else (
        "fit" if args.variant == "fit" else "sweep")
    if base.startswith("carry"):  # the demo task's mid-length problems
        c.data.update(digits=(6, 12), multipliers=(2, 9))
    c.mining.train_on = "all"  # the sweep studies plain GRPO where it has signal: no hard-set mining
    # What the printed commands (print_only) load before their overrides: this very file.
    c.isocompute.config_arg = os.path.relpath(__file__) + (f":{arg}" if arg else "")
    # The pre-registered sweep (jobs/isocompute_prereg.py): fit up to fit_max rollouts, predict
    # n* at `predict`; held-out avg@4 in two difficulty groups (digits <= split_digits, above).
    # span_resamples: crossed bootstrap draws of the n* fit's span (each refits the frontier,
    # ~0.1 s on a loaded core); the span's sign, not its third digit, is what they decide.
    c.isocompute.prereg = ml_collections.ConfigDict(dict(
        phase="predict", fit_max=2**11, predict=(2**12, 2**13), split_digits=9,
        span_resamples=200))
    if args.variant == "prereg":
        # n from 2 to 64 at B = 4, 3 seeds, one learning rate for every n (lr_rule constant:
        # n and the rate do not move together); evaluated every 2^9 rollouts on 192 problems.
        # Budgets 2^9..2^13: what 2 shared cores hold (18 runs); the fit stops at 2^11.
        c.isocompute.update(ns=(2, 4, 8, 16, 32, 64), batches=(4,), seeds=(0, 1, 2),
                            lr_rule="constant", budgets=tuple(2**e for e in range(9, 14)),
                            eval_every_rollouts=2**9)
        c.data.eval_size = 192
    if args.variant.endswith("smoke"):
        c.isocompute.update(budgets=(32, 64), ns=(2, 4), batches=(4, 8), eval_every_rollouts=16)
        c.isocompute.prereg.update(fit_max=32, predict=(64,))
    return c
