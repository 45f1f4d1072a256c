"""IsoCompute: sweep (n, B) at several budgets of rollouts, then fit the compute-optimal frontier.

    python -m jaxprefix.main --config=configs/isocompute.py --workdir=/tmp/iso           # sweep + fit
    python -m jaxprefix.main --config=configs/isocompute.py:fit --workdir=/tmp/iso       # refit
    python -m jaxprefix.main --config=configs/isocompute.py:smoke --workdir=/tmp/iso_smoke
    python -m jaxprefix.main --config=configs/isocompute.py --config.isocompute.print_only=True

Compute C = B * n * M rollouts. Each (n, B) runs once per seed at the largest budget and is
evaluated on the way (avg@4 on held-out problems), so the smaller budgets are points on its curve;
its learning rate is train.learning_rate at isocompute.lr_reference_rollouts rollouts a step,
scaled by isocompute.lr_rule ('sqrt', the paper's). The fit writes frontier.json, whose allocation
rule any run can use: `--config.isocompute.budget=C --config.isocompute.frontier_path=.../frontier.json`
(`isocompute.budget_unit=flops` for a budget in FLOPs). The demo sweep uses mid-length
carry-multiplication problems (6..12 digits), where plain GRPO has signal.
"""
import os

from jaxprefix import run_config


def get_config(arg: str = ""):
    c, args = run_config.method_config(__file__, "grpo", arg, extra_variants=("fit",))
    c.job = "fit" if args.variant == "fit" else "sweep"
    c.data.update(digits=(6, 12), multipliers=(2, 9))
    c.mining.train_on = "all"  # the sweep studies plain GRPO where it has signal: no hard-set mining
    # What the printed commands (print_only) load before their overrides: this very file.
    c.isocompute.config_arg = os.path.relpath(__file__) + (f":{arg}" if arg else "")
    if args.variant == "smoke" or args.variant.endswith("smoke"):
        c.isocompute.update(budgets=(32, 64), ns=(2, 4), batches=(4, 8), eval_every_rollouts=16)
    return c
