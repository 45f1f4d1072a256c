"""jaxprefix: RL post-training for LLMs on hard problems (POPE, PrefixRL, IsoCompute) in JAX.

Subpackages load on first use (`jaxprefix.models`, `jaxprefix.sampling`, ...), so importing a
light one (tokenizers, data) does not start JAX.
"""
import importlib

__version__ = "0.1.0"

_SUBMODULES = ("checkpoints", "data", "distributed", "evaluation", "methods", "models", "rewards",
               "rl", "sampling", "tokenizers")


def __getattr__(name):
    if name in _SUBMODULES:
        return importlib.import_module(f"jaxprefix.{name}")
    raise AttributeError(f"module 'jaxprefix' has no attribute {name!r}")
