"""A researcher's own reward: a function in a Python file, named in the config, no module to write.

    --config.rewards.path=my_rewards.py:score     # def score(completion: str, problem) -> float

`FileVerifier(path, function)` is what the worker pool runs: it pickles as its two strings and
loads the file in each worker process on first use, so the function need not live in an
importable module. It runs where the built-in verifiers run (the shared worker pool, under
`rewards.timeout_s`): a function that raises, hangs, or returns anything but a finite number
scores 0 and is counted as a verifier failure. `load(spec)` checks the file and the function in
this process first, so a typo fails in one line before any model is loaded.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import numbers
import os
import sys

from jaxprefix.data.problem import Problem

_MODULES: dict[str, object] = {}  # path -> the loaded file, once per process


def _module(path: str):
    if path not in _MODULES:
        name = f"jaxprefix_reward_file_{len(_MODULES)}"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses and pickling inside the file look it up
        spec.loader.exec_module(module)
        _MODULES[path] = module
    return _MODULES[path]


@dataclasses.dataclass(frozen=True)
class FileVerifier:
    """`function` of the Python file at `path` (absolute), as a verifier."""
    path: str
    function: str

    @property
    def fn(self):
        """The function itself (the file loaded once per process): a tool or an environment
        named the same way takes it from here."""
        return getattr(_module(self.path), self.function)

    def __call__(self, completion: str, problem: Problem) -> float:
        value = self.fn(completion, problem)
        # float() would take "1" or True without a word: a reward must be a real number.
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"{self.spec} returned {type(value).__name__} {value!r:.40}, "
                            "expected a number")
        return float(value)

    @property
    def spec(self) -> str:
        return f"{self.path}:{self.function}"


def load(spec: str, field: str = "config.rewards.path") -> FileVerifier:
    """The verifier of `spec` ('FILE.py:FUNCTION'), checked here; errors are one line naming
    `field`, the file and the function."""
    path, sep, function = spec.rpartition(":")
    if not sep or not path or not function.isidentifier():
        raise ValueError(f"{field}={spec!r}: expected FILE.py:FUNCTION")
    path = os.path.abspath(os.path.expanduser(path))
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{field}={spec!r}: no such file {path}")
    try:
        module = _module(path)
    except Exception as e:
        _MODULES.pop(path, None)
        where = f" (line {e.lineno})" if isinstance(e, SyntaxError) else ""
        raise ValueError(f"{field}={spec!r}: {path}{where} fails to load: "
                         f"{type(e).__name__}: {e}".splitlines()[0]) from None
    fn = getattr(module, function, None)
    if not callable(fn):
        defined = sorted(n for n, v in vars(module).items()
                         if callable(v) and not n.startswith("_") and
                         getattr(v, "__module__", None) == module.__name__)
        raise ValueError(f"{field}={spec!r}: {path} has no function {function!r} "
                         f"(it defines: {', '.join(defined) or 'none'})")
    return FileVerifier(path, function)
