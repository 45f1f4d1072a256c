"""SFT of the tiny base policy of the demo task (one-digit multiplication with written carries).

    python -m jaxprefix.main --config=configs/sft.py --workdir=/tmp/demo           # demo, ~3 min
    python -m jaxprefix.main --config=configs/sft.py:smoke --workdir=/tmp/smoke    # seconds
    python -m jaxprefix.main --config=configs/sft.py:tools --workdir=/tmp/tools    # tool calls

Training stops at the first evaluation point where the hard set is never solved in k samples
(hard pass@k = 0 for the k POPE mines with) and the policy finishes hard problems given all but
`steps_left` oracle steps at least `guided_floor` of the time. See docs/DEMO_TASK.md.
"""

import ml_collections

from jaxprefix import run_config


VARIANTS = ("demo", "smoke", "carry", "carry_smoke", "tools", "tools_smoke")


def get_config(arg: str = "demo") -> ml_collections.ConfigDict:
    variant = arg or "demo"
    if variant not in VARIANTS:
        raise ValueError(f"configs/sft.py: unknown variant {variant!r}; expected one of "
                         f"{VARIANTS}")
    if variant in ("demo", "smoke"):
        return keyed(variant == "smoke")
    if variant in ("tools", "tools_smoke"):
        return tools(variant == "tools_smoke")
    return carry(variant == "carry_smoke")


def tools(smoke: bool) -> ml_collections.ConfigDict:
    """The base of the built-in tool task (docs/TOOLS.md, configs/tools.py): the demo's, with
    half of its unhinted rows written as tool episodes (the key reader called, its answer copied
    into the key step; hinted rows never call), half of those '>' rows where the answer is not
    the key the base reads out of habit; rows without a call never show what '>' means. The
    same criterion chooses it."""
    config = keyed(smoke)
    config.data.tool_fraction = 0.5
    return config


def keyed(smoke: bool) -> ml_collections.ConfigDict:
    """The demo's base: keyed_multiplication, stopped where hard problems (rule '>') are never
    solved alone and solved with the key step alone given (8 of 9 steps left) at the floor."""
    config = carry(smoke)
    config.task = "keyed_multiplication"
    # Lengths 1..8 plus half full-length rows; a quarter of rows under rule '>' with u = v (the
    # rule never matters in what the base reads); half the rows hinted, half of those with the
    # key digit u overridden by the hinted d (the carry steps use the key step as written).
    # second_rule_taught: the overlap knob eps (issue 28), the share of '>' rows that show the
    # rule (unequal digits, the true target); 0 is the demo's base, which never sees it.
    # key_names_rule: the restating route (issue 28): the key step names the rule it reads the
    # key by ('<' or '>' in place of '*'); off is the demo's base. The RL side follows it.
    config.data.update(digits=(1, 8), second_rule_fraction=0.25, hinted_fraction=0.5,
                       key_override_fraction=0.5, second_rule_taught=0.0, key_names_rule=False)
    config.criterion.update(steps_left=8, report_steps_left=(8, 7))
    if not smoke:
        # Sampled evaluation points cost 2/3 of this SFT's time at every 25 steps from a step
        # accuracy of 0.3 (profiled: 20 points, ~600 of 857 s on a loaded machine); guided
        # success with 8 carry steps left is about p^8, below the 0.25 floor until p ~ 0.84,
        # so points every 50 steps from a step accuracy of 0.6. Training is the same: the
        # chosen base (step 950) is the same.
        config.eval_every = 50
        config.criterion.sample_from_step_accuracy = 0.6
    if smoke:
        config.criterion.report_steps_left = (8,)
    return config


def carry(smoke: bool) -> ml_collections.ConfigDict:
    """The base of carry_multiplication (the long-guidance case, and PrefixRL's regime)."""
    variant = "smoke" if smoke else "demo"
    config = run_config.sft_base_config()  # its fields, defaults and docs (SFT_FIELDS)

    if variant == "smoke":
        config.data.batch_size = 16
        config.max_steps = 40
        config.warmup_steps = 10
        config.eval_start = 40  # one evaluation, at the end
        config.eval_every = 40
        config.criterion.k = 2
        config.criterion.hard_count = 4
        config.criterion.guided_samples = 2
        config.criterion.report_steps_left = (2,)
        config.criterion.sample_from_step_accuracy = 0.0
    return config
