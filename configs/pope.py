"""POPE: hard problems asked guided by an oracle-solution prefix and plainly, mixed 1:1.

    python -m jaxprefix.main --config=configs/pope.py                       # the CPU demo: SFT, mining,
                                                                            # POPE vs GRPO, table + plots
    python -m jaxprefix.main --config=configs/pope.py:demo_smoke --workdir=/tmp/demo_smoke
    python -m jaxprefix.main --config=configs/pope.py:rl --workdir=/tmp/pope  # POPE alone, demo task
    python -m jaxprefix.main --config=configs/pope.py:smoke --workdir=/tmp/pope_smoke
    python -m jaxprefix.main --config=configs/pope.py:smollm2 --workdir=/tmp/pope_smollm2
    python -m jaxprefix.main --config=configs/pope.py:paper --workdir=gs://BUCKET/pope \
        --config.model.path=gs://BUCKET/Qwen3-4B-Instruct-2507 --config.data.path=...
    python -m jaxprefix.main --config=configs/pope.py:paper_moe --config.job=compile \
        --config.compile.topology=v6e --workdir=/tmp/compile_moe  # Qwen3-30B-A3B: which slice

Options as fields, e.g. `--config.pope.template=no_restate` (the paper's ablation),
`--config.pope.easy_per_step=16` with `--config.data.easy_size=1024` (hard + easy),
`--config.schedule.kind=adaptive` (shorten a problem's prefix once it is solved guided).
"""
from jaxprefix import variants


def get_config(arg: str = ""):
    c, args = variants.method_config(__file__, "pope", arg, extra_variants=("rl", "demo_smoke"))
    # With no variant the command runs the whole demo pipeline (jobs/demo.py) at the eps sweep's
    # window level W2 (eps 1.4e-3, docs/results/pope/PREDICTIONS.md): the restating hint.
    c.job = "demo" if args.variant in ("demo", "demo_smoke") else "rl"
    if c.job == "demo":
        variants.overlap_axis(c)
        c.sft.data.second_rule_taught = variants.DEMO_OVERLAP
        c.sft.data.restated_taught = variants.DEMO_RESTATED
    if args.variant == "demo":
        # The study's level at the study's size (32 problems a step, 64 contexts), one seed.
        # One problem set for both runs (issue 43): a hard problem without a solvable prefix
        # leaves both, so POPE guides every problem it trains on.
        c.pope.unsolved = "drop"
    return c
