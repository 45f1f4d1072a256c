"""Verifiers by name, scored over a rollout batch in worker processes with a per-answer timeout.

A verifier is a top-level function `fn(completion_text, problem) -> float` (reward in [0, 1]).
Built in: `math` (last `\\boxed{}` vs the reference, math-verify), `math_lenient` (also "answer is
X" and the last number), `exact` (normalised text), `reasoning_gym` (the generator's
score_answer), `format` (a closed `\\boxed{}` is present), `reasoning_gym_boxed` (the generator's check of a
leniently read answer, plus a share for the box asked for), `reasoning_gym_right_boxed` (that
share paid on right answers only), `reasoning_gym_box_nudged` (and a little for a wrong box),
`reasoning_gym_box_own` (that little only for a box around the completion's own result) and
each built-in task's exact check under the task's name (data/tasks). Others register their own:

    rewards.register("my_task", my_task_verifier, in_process=True)

A function in a Python file needs no module: `--config.rewards.path=my_rewards.py:fn`
(rewards/from_file.py; `verifier_name` resolves it). `in_process=True` marks a verifier cheap and
safe (exact match on short strings): it runs in the calling process, still under the timeout (an
interval timer interrupts it, on the main thread). Everything else runs in the shared worker
pool, where a crash or a timeout scores 0 and is counted, never raised into the training loop,
and each worker's memory is capped (`set_max_memory_mb`, config.rewards.max_memory_mb).
Policy output is untrusted: a completion longer than `max_chars` is scored 0 without being read,
and counted; the built-in verifiers are linear in the text besides (tests/test_rewards.py feeds
each a megabyte of unclosed `\\boxed{`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import pickle
import signal
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np

from jaxprefix.data.problem import Problem
from jaxprefix.data.tasks import TASKS
from jaxprefix.rewards import from_file
from jaxprefix.rewards.exact import exact_match
from jaxprefix.rewards.math import format_reward, math_reward, math_verifier, math_verifier_lenient
from jaxprefix.rewards.pool import (VerifierPool, close_pools, default_workers, set_max_memory_mb,
                                    shared_pool)
from jaxprefix.rewards.reasoning_gym import (reasoning_gym_box_nudged_verifier,
                                             reasoning_gym_box_own_verifier,
                                             reasoning_gym_boxed_verifier,
                                             reasoning_gym_right_boxed_verifier,
                                             reasoning_gym_verifier)

Verifier = Callable[[str, Problem], float]
# Completions longer than this are scored 0 unread (config.rewards.max_chars): the paper config's
# longest completions (16,384 tokens) decode to ~70K characters, at about 4 per token.
MAX_CHARS = 200_000


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


def unregister(name: str) -> None:
    """Removes the verifier `name`: one registered for a while (api.run's reward, for its run)."""
    _REGISTRY.pop(name, None)


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


class _Overtime(BaseException):
    """Raised into an in-process verifier at its deadline (not an Exception: a verifier's own
    `except Exception` must not swallow it)."""


@contextlib.contextmanager
def _alarm_handler():
    """SIGALRM raises _Overtime while scoring on the main thread; elsewhere there is no timer,
    and a slow answer is only found out afterwards (signals reach the main thread alone)."""
    if threading.current_thread() is not threading.main_thread():
        yield False
        return

    def overtime(signum, frame):
        raise _Overtime

    previous = signal.signal(signal.SIGALRM, overtime)
    try:
        yield True
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _score_in_process(fn: Verifier, texts, problems, timeout_s: float) -> tuple[np.ndarray, dict]:
    rewards = np.zeros(len(texts), np.float32)
    counts = {"timeouts": 0, "errors": 0}
    with _alarm_handler() as timed:
        for i, (text, problem) in enumerate(zip(texts, problems)):
            start = time.perf_counter()
            try:
                try:
                    if timed:
                        signal.setitimer(signal.ITIMER_REAL, timeout_s)
                    reward = float(fn(text, problem))
                finally:  # the timer may still fire in here: the outer handler counts it
                    if timed:
                        signal.setitimer(signal.ITIMER_REAL, 0)
            except _Overtime:
                counts["timeouts"] += 1
                continue
            except Exception:  # scores 0 and is counted, as in the worker pool
                counts["errors"] += 1
                continue
            if time.perf_counter() - start > timeout_s:  # no timer off the main thread
                counts["timeouts"] += 1
            else:
                rewards[i] = reward
    return rewards, counts


def score_batch(name: str, texts: Sequence[str], problems: Sequence[Problem], *,
                timeout_s: float = 10.0, workers: int | None = None,
                max_chars: int = MAX_CHARS) -> tuple[np.ndarray, dict]:
    """Rewards [N] float32 for completions `texts` of `problems` (one problem per text).

    Args:
      name: a registered verifier.
      timeout_s: the most one answer may take; past it the answer scores 0 and counts a timeout.
      workers: 0 scores in this process; None uses the verifier's default (in-process verifiers
        in-process, others in the shared pool of `default_workers()` processes).
      max_chars: longer texts score 0 unread and count as `too_long` (0: no cap).

    Returns:
      (rewards, stats) with stats {'count', 'timeouts', 'errors', 'too_long', 'seconds'}.
    """
    if len(texts) != len(problems):
        raise ValueError(f"score_batch: {len(texts)} texts but {len(problems)} problems; "
                         "expected one problem per text")
    entry = _entry(name)
    if workers is None:
        workers = 0 if entry.in_process else default_workers()
    start = time.perf_counter()
    rewards = np.zeros(len(texts), np.float32)
    read = [i for i, text in enumerate(texts) if not max_chars or len(text) <= max_chars]
    counts = {"timeouts": 0, "errors": 0}
    if read:
        chosen_texts, chosen_problems = [texts[i] for i in read], [problems[i] for i in read]
        if workers == 0:
            scores, counts = _score_in_process(entry.fn, chosen_texts, chosen_problems, timeout_s)
        else:
            scores, counts = shared_pool(workers).score(entry.fn, chosen_texts, chosen_problems,
                                                        timeout_s)
        rewards[read] = scores
    return rewards, {"count": len(texts), **counts, "too_long": len(texts) - len(read),
                     "seconds": time.perf_counter() - start}


register("math", math_verifier)
register("math_lenient", math_verifier_lenient)
register("exact", exact_match, in_process=True)
register("format", format_reward, in_process=True)
register("reasoning_gym", reasoning_gym_verifier)
register("reasoning_gym_boxed", reasoning_gym_boxed_verifier)
register("reasoning_gym_right_boxed", reasoning_gym_right_boxed_verifier)
register("reasoning_gym_box_nudged", reasoning_gym_box_nudged_verifier)
register("reasoning_gym_box_own", reasoning_gym_box_own_verifier)
for _name, _task in TASKS.items():  # exact match on short strings: cheap and safe, in process
    register(_name, _task.verify, in_process=True)

__all__ = [
    "Verifier", "VerifierPool", "close_pools", "default_workers", "exact_match", "format_reward",
    "get", "math_reward", "names", "register", "score_batch", "set_max_memory_mb", "verifier_name",
]
