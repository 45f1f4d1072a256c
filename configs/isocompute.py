"""IsoCompute: sweep (n, B) at several budgets of rollouts, then fit the compute-optimal frontier.

    python -m jaxprefix.main --config=configs/isocompute.py --workdir=/tmp/iso           # sweep + fit
    python -m jaxprefix.main --config=configs/isocompute.py:fit --workdir=/tmp/iso       # refit
    python -m jaxprefix.main --config=configs/isocompute.py:smoke --workdir=/tmp/iso_smoke
    python -m jaxprefix.main --config=configs/isocompute.py --config.isocompute.print_only=True

Compute C = B * n * M rollouts. Each (n, B) runs once at the largest budget and is evaluated on the
way (avg@4 on held-out problems), so the smaller budgets are points on its curve. The demo sweep
uses mid-length carry-multiplication problems (6..12 digits), where plain GRPO has signal.
"""
from jaxprefix import run_config


def get_config(arg: str = ""):
    c, args = run_config.method_config(__file__, "grpo", arg, extra_variants=("fit",))
    c.job = "fit" if args.variant == "fit" else "sweep"
    c.data.update(digits=(6, 12), multipliers=(2, 9))
    c.mining.train_on = "all"  # the sweep studies plain GRPO where it has signal: no hard-set mining
    if args.variant == "smoke" or args.variant.endswith("smoke"):
        c.isocompute.update(budgets=(32, 64), ns=(2, 4), batches=(4, 8), eval_every_rollouts=16)
    return c
