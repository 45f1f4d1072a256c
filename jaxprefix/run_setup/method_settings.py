"""What the configured method asks of a run: its blocks checked once, into a typed object.

`MethodSettings.from_config(config)` checks config.method and what the methods read (the pope
block, PrefixRL's cuts and copies, mining.train_on, the prefix-length schedule), naming the
field, before any model is loaded or problem mined; the jobs then take the object (preflight
makes it; run_settings.resolve makes it for each training run) and check nothing again.
`contexts_per_problem` counts what a method samples of a problem, for the jobs that plan runs
(allocation, studies, the results job).
"""
from __future__ import annotations

import dataclasses

from jaxprefix.errors import need
from jaxprefix.methods import pope
from jaxprefix.methods.prefix_schedules import make_prefix_schedule

METHODS = ("grpo", "pope", "prefixrl")


@dataclasses.dataclass(frozen=True)
class MethodSettings:
    name: str                           # one of METHODS
    pope: pope.PopeSettings             # the pope block (checked whatever the method)
    cut_range: tuple[float, float]      # PrefixRL's cut points, as shares of a trace
    prefixes_per_problem: int           # PrefixRL's prefixed contexts of a problem
    unprefixed_copies: int              # and its plain ones
    train_on: str                       # GRPO's problems: 'all', or 'hard' (the mined set)
    prefix_schedule: tuple              # config.schedule: (('kind', k), (field, v), ...)
    contexts_per_step: int              # the contexts one step samples, n times each

    @classmethod
    def from_config(cls, config) -> MethodSettings:
        need(config.method in METHODS, "config.method", config.method, f"one of {METHODS}")
        settings = pope.PopeSettings.from_config(config)  # raises naming the pope field
        p = config.prefixrl
        need(0.0 <= p.cut_lo <= p.cut_hi <= 1.0, "config.prefixrl.cut_lo/cut_hi",
             (p.cut_lo, p.cut_hi), "0 <= cut_lo <= cut_hi <= 1")
        need(config.mining.train_on in ("all", "hard"), "config.mining.train_on",
             config.mining.train_on, "'all' or 'hard'")
        kind = config.schedule.kind
        schedule = (("kind", kind), *sorted(dict(config.schedule.get(kind, {})).items()))
        make_prefix_schedule(dict(schedule))  # raises naming the schedule's field
        contexts = config.train.problems_per_step * contexts_per_problem(config, config.method)
        return cls(config.method, settings, (p.cut_lo, p.cut_hi), p.prefixes_per_problem,
                   p.unprefixed_copies, config.mining.train_on, schedule,
                   contexts + (settings.easy_per_step if config.method == "pope" else 0))

    def new_prefix_schedule(self):
        """A fresh prefix-length schedule for a run (it learns as the run goes: not shared)."""
        return make_prefix_schedule(dict(self.prefix_schedule))


def contexts_per_problem(config, method: str) -> int:
    """How many contexts `method` asks of each training problem (POPE's guided and plain copies,
    PrefixRL's prefixed and plain ones, GRPO's one)."""
    if method == "pope":
        return config.pope.guided_copies + config.pope.unguided_copies
    if method == "prefixrl":
        return config.prefixrl.prefixes_per_problem + config.prefixrl.unprefixed_copies
    return 1
