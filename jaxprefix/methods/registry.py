"""Methods by name: each method module registers what it reads, needs and builds; jobs look it up.

    spec = method_spec(config.method)       # one line naming config.method when unknown
    options = spec.settings(config)         # its blocks checked once, into a typed object
    method = spec.build(options, inputs)    # the rl.loop Method that lays out each step's contexts

A method is one module that calls `register_method(MethodSpec(...))` (methods/method_spec.py) next
to its definition: the config blocks only it reads (the variants set them on its runs alone), what
it asks of mining (the artifacts it trains on, its bill), how many contexts a problem and a step
ask, and how the mine job summarises its artifacts. Nothing else switches on a method's name:
adding one (a DAPO-style variant, a new guidance scheme) touches no other file
(tests/test_method_registry.py adds one inside a test file).
"""
from __future__ import annotations

from jaxprefix.errors import need
# The built-in methods register themselves when imported.
from jaxprefix.methods import grpo, pope, prefixrl  # noqa: F401
from jaxprefix.methods.method_spec import METHODS, MethodInputs, MethodSpec, register_method

__all__ = ["METHODS", "MethodInputs", "MethodSpec", "method_names", "method_spec",
           "register_method"]


def method_names() -> tuple[str, ...]:
    return tuple(METHODS)


def method_spec(name: str) -> MethodSpec:
    """The registered method `name`; an unknown one is refused naming config.method."""
    need(name in METHODS, "config.method", name, f"one of {method_names()}")
    return METHODS[name]
