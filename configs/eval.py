"""Evaluate a policy on held-out problems, unguided (and guided with mined POPE prefixes).

    python -m jaxprefix.main --config=configs/eval.py --workdir=runs/pope-demo/pope
    python -m jaxprefix.main --config=configs/eval.py:smollm2 --workdir=/tmp/pope_smollm2

Loads the workdir's latest RL checkpoint (or the configured base model when there is none) and
writes <workdir>/eval_report.json with pass@k, avg@k, best@k, worst@k and maj@k.
"""
from jaxprefix import variants
from jaxprefix.run_setup import preflight


def get_config(arg: str = ""):
    c, _ = variants.method_config(__file__, "pope", arg)
    c.job = "eval"
    # The variant is the evaluated rl run's: what only training reads (its steps, learning rate,
    # checkpoint interval, mesh) goes back to its default, so that a field set is a field read.
    preflight.reset_unread(c)
    return c
