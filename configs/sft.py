"""SFT of the tiny base policy of the demo task (one-digit multiplication with written carries).

    python -m jaxprefix.main --config=configs/sft.py --workdir=/tmp/demo           # demo, ~3 min
    python -m jaxprefix.main --config=configs/sft.py:smoke --workdir=/tmp/smoke    # seconds
    python -m jaxprefix.main --config=configs/sft.py:tools --workdir=/tmp/tools    # tool calls

Training stops at the first evaluation point where the hard set is never solved in k samples
(hard pass@k = 0 for the k POPE mines with) and the policy finishes hard problems given all but
`steps_left` oracle steps at least `guided_floor` of the time. See docs/DEMO_TASK.md.
"""

from jaxprefix import variants


def get_config(arg: str = "demo"):
    return variants.sft_config(arg)
