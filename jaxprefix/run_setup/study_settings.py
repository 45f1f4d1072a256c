"""What the studies (studies/: the demo's and the results job's comparisons, their reports)
read of a study's config, read here once, by the job, into frozen settings. Below the jobs
nothing reads the config: a study gets its StudySettings, its report a ReportSettings, and an
arm's guided-share check its GuidedDesign.

A report is also rebuilt from the config its counts file kept (jobs/report_tables.py), which
may predate a field: such a field is read with the default it had before it existed.
"""
from __future__ import annotations

import dataclasses

from jaxprefix.methods.pope import PopeSettings
from jaxprefix.methods.prefixrl import PrefixRLSettings


@dataclasses.dataclass(frozen=True)
class StudySettings:
    """A study's evaluation (eval.n samples of each held-out problem, pass@ks, at seed + 7),
    its default prefix search and trace pool, and the task it draws fresh problems from (the
    more-SFT control)."""
    seed: int
    eval_n: int
    eval_ks: tuple[int, ...]
    pope: PopeSettings
    prefixrl: PrefixRLSettings
    task_source: str
    digits: tuple[int, int]
    multipliers: tuple[int, ...]
    data_seed: int

    @classmethod
    def from_config(cls, config) -> StudySettings:
        d = config.data
        return cls(config.seed, config.eval.n, tuple(config.eval.ks),
                   PopeSettings.from_config(config), PrefixRLSettings.from_config(config),
                   d.source, tuple(d.digits), tuple(d.get("multipliers", ())), d.seed)


@dataclasses.dataclass(frozen=True)
class GuidedDesign:
    """How many guided and unguided contexts a POPE arm was designed to train on: its copies
    of each hard problem (pope.guided_copies, unguided_copies), what it does with a problem
    without a prefix (pope.unsolved) and its easy problems a step, at problems_per_step."""
    guided_copies: int
    unguided_copies: int
    unsolved: str
    easy_per_step: int
    problems_per_step: int


def _arm_field(spec, config, field: str):
    """A pope field of an arm: the arm's own setting, else the study's."""
    return spec.settings.get(f"pope.{field}", config.pope[field])


def guided_design(config, spec) -> GuidedDesign | None:
    """The design of the arm `spec` (run_setup/study_arms.RunSpec) of the study `config`; None
    for an arm that is not POPE."""
    if spec.method != "pope":
        return None
    return GuidedDesign(*(_arm_field(spec, config, f) for f in
                          ("guided_copies", "unguided_copies", "unsolved", "easy_per_step")),
                        config.train.problems_per_step)


@dataclasses.dataclass(frozen=True)
class ReportSettings:
    """What the results report says of its study besides the runs' records."""
    task_name: str            # 'reasoning-gym's chain_sum', or a built-in task's name
    task_config: str | None   # a generator's settings (None: a built-in task: its digits)
    base_trained: bool        # the base is the SFT one the study trained (not loaded as is)
    eval_ks: tuple[int, ...]
    eval_n: int
    problems_per_step: int
    rollout_n: int
    tie_margin: float         # inside it a difference is a tie (0: a study from before it)
    regime: dict              # results.regime
    trace_samples_per_round: int
    trace_max_samples: int
    iso_budgets: tuple
    output_dir: str           # '' : the workdir
    designs: dict             # arm name -> GuidedDesign (every POPE arm of the specs)
    command_variant: str      # configs/results.py's variant, for a record without its command

    @classmethod
    def from_config(cls, config, specs) -> ReportSettings:
        d, results = config.data, config.results
        reasoning_gym = d.source == "reasoning_gym"
        return cls(
            task_name=f"reasoning-gym's {d.task}" if reasoning_gym else d.source,
            task_config=(d.get("task_config") or "the generator's defaults") if reasoning_gym
            else None,
            base_trained=config.model.get("source", "sft") == "sft",
            eval_ks=tuple(config.eval.ks), eval_n=config.eval.n,
            problems_per_step=config.train.problems_per_step, rollout_n=config.rollout.n,
            tie_margin=tie_margin(config),
            regime=results.regime.to_dict(),
            trace_samples_per_round=config.prefixrl.samples_per_round,
            trace_max_samples=config.prefixrl.max_samples,
            iso_budgets=tuple(config.get("isocompute", {}).get("budgets", ())),
            output_dir=results.get("output_dir", "") or "",
            designs={name: design for name, spec in specs.items()
                     if (design := guided_design(config, spec)) is not None},
            command_variant=_command_variant(config, specs))


def tie_margin(config) -> float:
    """The margin inside which a paired difference is a tie, stated before the runs
    (results.tie_margin; a study run before the field existed stated none: 0)."""
    return float(config.results.get("tie_margin", 0.0))


def _command_variant(config, specs) -> str:
    """The variant of a record from before the results job kept its own command: the carry
    variant is the one whose runs are in PrefixRL's regime, the overlap variant the one with the
    one step off-policy arm, the eps variant the other one on the restating notation
    (configs/results.py)."""
    runs = config.results.runs
    variant = ":carry" if any(getattr(specs.get(name), "regime", None) == "prefixrl"
                              for name in runs) else ""
    if "grpo_one_step_off" in runs:
        return ":overlap"
    if config.data.get("key_names_rule"):
        sft_data = config.sft.data
        variant = f":eps --config.sft.data.second_rule_taught=" \
                  f"{sft_data.get('second_rule_taught', 0.0)}"
        if sft_data.get("restated_taught", 0.0):
            variant += f" --config.sft.data.restated_taught={sft_data.restated_taught}"
    return variant
