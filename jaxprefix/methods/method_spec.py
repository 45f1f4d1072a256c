"""What a method declares when it registers: `register_method(MethodSpec(...))` next to its
definition (methods/grpo.py, pope.py, prefixrl.py); methods/registry.py looks them up by name.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable



@dataclasses.dataclass(frozen=True)
class MethodInputs:
    """What a method is built over: the policy's prompts, the problem sets, the run's mining
    (hard_set(), prefixes(hard), trace_pool(problems), each mined on first request) and the
    keywords every method takes (problems_per_step, n, seed, the eval problems)."""
    prompts: Any
    sets: Any
    mining: Any
    common: dict


def _nothing_extra(options) -> int:
    return 0


def _no_summary(options, mining, hard) -> dict:
    return {}


@dataclasses.dataclass(frozen=True)
class MethodSpec:
    name: str
    settings: Callable[[Any], Any]               # config -> its typed settings (errors: one line)
    build: Callable[[Any, MethodInputs], Any]    # (settings, inputs) -> an rl.loop Method
    contexts_per_problem: Callable[[Any], int]   # settings -> contexts a training problem asks
    needs: Callable[[Any], tuple[str, ...]]      # settings -> mining artifacts it trains on
    blocks: tuple[str, ...] = ()                 # config blocks no other method reads
    extra_contexts_per_step: Callable[[Any], int] = _nothing_extra  # beyond B x per problem
    guides_in_prompt: Callable[[Any], bool] = lambda options: False  # POPE's hint slots
    mined_summary: Callable[[Any, Any, Any], dict] = _no_summary  # the mine job's extra lines
    # Whether every context it samples is a plain problem (no guidance, no prefix): an external
    # environment, which writes its own prompts from the problem, can only run such a method.
    plain_contexts: bool = False


METHODS: dict[str, MethodSpec] = {}


def register_method(spec: MethodSpec) -> MethodSpec:
    """Adds `spec` under its name (a second spec of one name is a programming error)."""
    if spec.name in METHODS and METHODS[spec.name] is not spec:
        raise ValueError(f"method {spec.name!r} is registered already")
    METHODS[spec.name] = spec
    return spec


