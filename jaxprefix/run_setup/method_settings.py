"""What the configured method asks of a run, checked and counted without loading anything.

Shared by the jobs that plan a run before it starts (rl, mine, preflight, study, isocompute,
compile), so none of them imports another job for it.
"""
from __future__ import annotations

from jaxprefix.errors import need
from jaxprefix.methods import pope
from jaxprefix.methods.schedules import make_schedule

METHODS = ("grpo", "pope", "prefixrl")


def check_method_settings(config) -> None:
    """Fails before any model is loaded or problem mined when a method field is off."""
    need(config.method in METHODS, "config.method", config.method, f"one of {METHODS}")
    pope.PopeSettings.from_config(config)  # raises naming the pope field
    p = config.prefixrl
    need(0.0 <= p.cut_lo <= p.cut_hi <= 1.0, "config.prefixrl.cut_lo/cut_hi",
         (p.cut_lo, p.cut_hi),
         "0 <= cut_lo <= cut_hi <= 1")
    need(config.mining.train_on in ("all", "hard"), "config.mining.train_on",
         config.mining.train_on,
         "'all' or 'hard'")
    schedule(config)  # raises naming the schedule field


def contexts_per_problem(config, method: str) -> int:
    """How many contexts `method` asks of each training problem (POPE's guided and plain copies,
    PrefixRL's prefixed and plain ones, GRPO's one)."""
    if method == "pope":
        return config.pope.guided_copies + config.pope.unguided_copies
    if method == "prefixrl":
        return config.prefixrl.prefixes_per_problem + config.prefixrl.unprefixed_copies
    return 1


def contexts_per_step(config) -> int:
    """The contexts one step of the configured method samples (n times each)."""
    contexts = config.train.problems_per_step * contexts_per_problem(config, config.method)
    return contexts + (config.pope.easy_per_step if config.method == "pope" else 0)


def schedule(config):
    """The guidance schedule the config names (POPE's prefix lengths over training)."""
    return make_schedule({"kind": config.schedule.kind,
                          **config.schedule.get(config.schedule.kind, {})})
