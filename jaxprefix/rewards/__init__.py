"""Verifiers by name, scored over a rollout batch in worker processes with a per-answer timeout.

A verifier is a top-level function `fn(completion_text, problem) -> float` (reward in [0, 1]).
Built in: `math` (last `\\boxed{}` vs the reference, math-verify), `math_lenient` (also "answer is
X" and the last number), `exact` (normalised text), `reasoning_gym` (the generator's
score_answer) and `format` (a closed `\\boxed{}` is present). Others register their own:

    rewards.register("my_task", my_task_verifier, in_process=True)

A function in a Python file needs no module: `--config.rewards.path=my_rewards.py:fn`
(rewards/from_file.py; `verifier_name` resolves it). `in_process=True` marks a verifier cheap and
safe (exact match on short strings): it runs in the calling process, without a timeout.
Everything else runs in the shared worker pool, where a crash or a timeout scores 0 and is
counted, never raised into the training loop.
"""

from __future__ import annotations

import dataclasses
import pickle
import time
from collections.abc import Callable, Sequence

import numpy as np

from jaxprefix.data.problem import Problem
from jaxprefix.rewards import from_file
from jaxprefix.rewards.exact import exact_match
from jaxprefix.rewards.math import format_reward, math_reward, math_verifier, math_verifier_lenient
from jaxprefix.rewards.pool import VerifierPool, close_pools, default_workers, shared_pool
from jaxprefix.rewards.reasoning_gym import reasoning_gym_verifier

Verifier = Callable[[str, Problem], float]


@dataclasses.dataclass(frozen=True)
class _Entry:
    fn: Verifier
    in_process: bool


_REGISTRY: dict[str, _Entry] = {}


def register(name: str, fn: Verifier, *, in_process: bool = False, overwrite: bool = False) -> None:
    """Makes `fn` the verifier called `name`.

    `fn` must be a top-level function of an importable module (worker processes receive it by
    reference): not a lambda, a closure, or a function of a script's `__main__`.
    """
    if name in _REGISTRY and _REGISTRY[name].fn is not fn and not overwrite:
        raise ValueError(f"verifier {name!r} is already registered to {_REGISTRY[name].fn!r}; "
                         "pass overwrite=True to replace it")
    if not in_process:
        if getattr(fn, "__module__", None) == "__main__":
            raise ValueError(f"verifier {name!r}: {fn!r} lives in __main__, which worker processes "
                             "cannot import; move it into a module")
        try:
            pickle.dumps(fn)
        except Exception as e:
            raise ValueError(f"verifier {name!r}: {fn!r} cannot be sent to worker processes ({e}); "
                             "use a top-level function of an importable module") from e
    _REGISTRY[name] = _Entry(fn, in_process)


def verifier_name(path: str, default: str) -> str:
    """The verifier a run scores with: the function of `path` ('FILE.py:FUNCTION', the config's
    rewards.path), registered under its absolute spec on first use, or `default` when path is ''."""
    if not path:
        return default
    verifier = from_file.load(path)
    if verifier.spec not in _REGISTRY:
        register(verifier.spec, verifier)
    return verifier.spec


def get(name: str) -> Verifier:
    """The verifier registered as `name`."""
    return _entry(name).fn


def names() -> list[str]:
    return sorted(_REGISTRY)


def _entry(name: str) -> _Entry:
    if name not in _REGISTRY:
        raise KeyError(f"no verifier named {name!r}; registered: {', '.join(names())}")
    return _REGISTRY[name]


def _score_in_process(fn: Verifier, texts, problems) -> tuple[np.ndarray, dict[str, int]]:
    rewards = np.zeros(len(texts), np.float32)
    errors = 0
    for i, (text, problem) in enumerate(zip(texts, problems)):
        try:
            rewards[i] = float(fn(text, problem))
        except Exception:  # scores 0 and is counted, as in the worker pool
            errors += 1
    return rewards, {"timeouts": 0, "errors": errors}


def score_batch(name: str, texts: Sequence[str], problems: Sequence[Problem], *,
                timeout_s: float = 10.0, workers: int | None = None) -> tuple[np.ndarray, dict]:
    """Rewards [N] float32 for completions `texts` of `problems` (one problem per text).

    Args:
      name: a registered verifier.
      timeout_s: the most one answer may take; past it the answer scores 0 and counts a timeout.
      workers: 0 scores in this process (no timeout); None uses the verifier's default (in-process
        verifiers in-process, others in the shared pool of `default_workers()` processes).

    Returns:
      (rewards, stats) with stats {'count', 'timeouts', 'errors', 'seconds'}.
    """
    if len(texts) != len(problems):
        raise ValueError(f"score_batch: {len(texts)} texts but {len(problems)} problems; "
                         "expected one problem per text")
    entry = _entry(name)
    if workers is None:
        workers = 0 if entry.in_process else default_workers()
    start = time.perf_counter()
    if not texts:
        rewards, counts = np.zeros(0, np.float32), {"timeouts": 0, "errors": 0}
    elif workers == 0:
        rewards, counts = _score_in_process(entry.fn, texts, problems)
    else:
        rewards, counts = shared_pool(workers).score(entry.fn, texts, problems, timeout_s)
    return rewards, {"count": len(texts), **counts, "seconds": time.perf_counter() - start}


register("math", math_verifier)
register("math_lenient", math_verifier_lenient)
register("exact", exact_match, in_process=True)
register("format", format_reward, in_process=True)
register("reasoning_gym", reasoning_gym_verifier)

__all__ = [
    "Verifier", "VerifierPool", "close_pools", "default_workers", "exact_match", "format_reward",
    "get", "math_reward", "names", "register", "score_batch", "verifier_name",
]
