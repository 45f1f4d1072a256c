"""The built-in tool task (docs/TOOLS.md): GRPO with the key reader against GRPO without it,
FLOP-matched, from one base SFT'd with tool calls on easy problems.

    python -m jaxprefix.main --config=configs/tools.py --workdir=runs/tools            # the study
    python -m jaxprefix.main --config=configs/tools.py:smoke --workdir=/tmp/tools_smoke
    python -m jaxprefix.main --config=configs/tools.py:rl --workdir=/tmp/tools_rl   # one arm

The study (jobs/tool_study.py) is a long job: SFT, then at each of tool_study.seeds the tools arm
and, on to its FLOPs, GRPO without tools and the two controls (the key in the prompt; an
uninformative reader), then the report, <workdir>/tool_study_report.md. Rerunning resumes. `rl`:
the tools arm alone, the rl job (its base trained in <workdir>/base when absent).
"""
import ml_collections

from jaxprefix import variants
from jaxprefix.run_config import base_config, parse_variant

VARIANTS = ("study", "smoke", "rl")


def get_config(arg: str = ""):
    args = parse_variant(arg, __file__, VARIANTS, "study")
    smoke = args.variant == "smoke"
    c = base_config()
    c.method = "grpo"
    sft = variants.sft_config("tools_smoke" if smoke else "tools")
    (variants.smoke if smoke else variants.demo_task)(c, sft)
    variants.tool_task(c)
    if smoke:
        c.train.total_steps = 3  # a resume lands mid-run (tests/test_jobs.py)
    else:  # the whole study: ~25 minutes on 2 idle cores, estimated (docs/TOOLS.md)
        c.train.update(problems_per_step=16, total_steps=100)
    if "seed" in args:
        c.seed = args.seed
    if args.variant == "rl":
        return c
    c.job = "tools"
    c.tool_study = ml_collections.ConfigDict(dict(seeds=(0,) if smoke else (0, 1, 2)))
    return c
