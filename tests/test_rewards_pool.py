"""The verifier worker pool: timeouts hold, crashes score 0 and are counted, the pool survives."""

import math
import os
import time

import numpy as np
import pytest

from jaxprefix import rewards
from jaxprefix.rewards import pool as pool_module
from jaxprefix.data import Problem

WORKERS = 2  # one shared pool for this module: start-up is paid once
PROBLEM = Problem("p", "What is one half?", "1/2")


# Verifiers for these tests: top-level, so worker processes import them by reference.
def sleepy_verifier(text, problem):
    if text == "slow":
        time.sleep(60)
    return 1.0


def crashing_verifier(text, problem):
    if text == "raise":
        raise RuntimeError("verifier bug")
    if text == "exit":
        os._exit(3)  # the whole worker process dies
    if text == "nan":
        return math.nan
    return 0.5


rewards.register("test_sleepy", sleepy_verifier)
rewards.register("test_crashing", crashing_verifier)


def test_math_in_workers_matches_in_process():
    texts = ["\\boxed{0.5}", "\\boxed{1/3}", "The answer is $\\frac{1}{2}$", "nothing"]
    pooled, stats = rewards.score_batch("math", texts, [PROBLEM] * 4, workers=WORKERS)
    local, _ = rewards.score_batch("math", texts, [PROBLEM] * 4, workers=0)
    np.testing.assert_array_equal(pooled, [1.0, 0.0, 1.0, 0.0])
    np.testing.assert_array_equal(pooled, local)
    assert stats["timeouts"] == stats["errors"] == 0


def test_timeout_holds_on_a_slow_answer():
    rewards.score_batch("test_sleepy", ["warm"] * WORKERS, [PROBLEM] * WORKERS, workers=WORKERS)
    start = time.perf_counter()
    scores, stats = rewards.score_batch("test_sleepy", ["fast", "slow", "fast", "fast"], [PROBLEM] * 4,
                                        timeout_s=1.0, workers=WORKERS)
    elapsed = time.perf_counter() - start
    assert scores.tolist() == [1.0, 0.0, 1.0, 1.0]
    assert stats["timeouts"] == 1 and stats["errors"] == 0
    assert elapsed < 10.0, elapsed  # not the 60 s the answer asks for


def test_pathological_math_answer_times_out():
    # sympy would try to evaluate this power tower for ever, in C, out of reach of signal.alarm.
    texts = ["\\boxed{9^{9^{9^{9}}}}", "\\boxed{\\frac{1}{2}}"]
    start = time.perf_counter()
    scores, stats = rewards.score_batch("math", texts, [PROBLEM] * 2, timeout_s=2.0, workers=WORKERS)
    assert scores.tolist() == [0.0, 1.0] and stats["timeouts"] == 1
    assert time.perf_counter() - start < 20.0


def test_crashes_score_zero_are_counted_and_the_pool_recovers():
    texts = ["ok", "raise", "exit", "nan", "ok"]
    scores, stats = rewards.score_batch("test_crashing", texts, [PROBLEM] * 5, workers=WORKERS)
    assert scores.tolist() == [0.5, 0.0, 0.0, 0.0, 0.5]
    assert stats["errors"] == 3 and stats["timeouts"] == 0
    scores, stats = rewards.score_batch("test_crashing", ["ok"] * 3, [PROBLEM] * 3, workers=WORKERS)
    assert scores.tolist() == [0.5] * 3 and stats["errors"] == 0


def test_pool_is_shared_and_rejects_bad_sizes():
    from jaxprefix.rewards.pool import VerifierPool, shared_pool

    assert shared_pool(WORKERS) is shared_pool(WORKERS)
    with pytest.raises(ValueError, match="workers must be >= 1"):
        VerifierPool(0)


def greedy_verifier(text, problem):
    return float(len(bytearray(int(text))) > 0)


def crashing_hard_verifier(text, problem):
    """Deaths a verifier can die in C or from outside, beyond a Python exception."""
    if text == "segfault":
        import ctypes
        ctypes.string_at(0)  # reads address 0: SIGSEGV
    if text.startswith("killed:"):  # writes its pid for the test to SIGKILL, then waits
        path = text.split(":", 1)[1]
        with open(path + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.replace(path + ".tmp", path)
        time.sleep(60)
    return 0.5


rewards.register("test_crashing_hard", crashing_hard_verifier)


def test_memory_cap_turns_a_huge_allocation_into_an_error():
    from jaxprefix.rewards.pool import VerifierPool

    pool = VerifierPool(1, max_memory_mb=2048)
    try:
        scores, stats = pool.score(greedy_verifier, [str(3 << 30), "10"], [PROBLEM] * 2, timeout_s=30)
    finally:
        pool.close()
    assert scores.tolist() == [0.0, 1.0] and stats["errors"] == 1


def test_a_segfault_and_a_kill_from_outside_score_zero_and_the_pool_goes_on(tmp_path):
    import signal
    import threading

    pid_file = str(tmp_path / "pid")

    def kill_when_busy():
        deadline = time.monotonic() + 60
        while not os.path.exists(pid_file) and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(int(open(pid_file).read()), signal.SIGKILL)

    killer = threading.Thread(target=kill_when_busy)
    killer.start()
    texts = ["ok", "segfault", f"killed:{pid_file}", "ok", "ok"]
    start = time.perf_counter()
    scores, stats = rewards.score_batch("test_crashing_hard", texts, [PROBLEM] * 5, timeout_s=30,
                                        workers=WORKERS)
    killer.join()
    assert scores.tolist() == [0.5, 0.0, 0.0, 0.5, 0.5]
    assert stats["errors"] == 2 and stats["timeouts"] == 0
    assert time.perf_counter() - start < 25  # the kill was seen at once, not at the timeout
    scores, stats = rewards.score_batch("test_crashing_hard", ["ok"] * 4, [PROBLEM] * 4,
                                        workers=WORKERS)
    assert scores.tolist() == [0.5] * 4 and stats["errors"] == 0


def test_the_configured_cap_contains_a_10_gb_allocation():
    # rewards.max_memory_mb, as main sets it: the shared pools' workers start under the cap.
    # Without a cap the allocation succeeds here (the kernel maps 10 GB of untouched zeros).
    rewards.set_max_memory_mb(2048)
    try:
        scores, stats = rewards.score_batch("test_greedy", [str(10 << 30), "10", "10"],
                                            [PROBLEM] * 3, timeout_s=30, workers=WORKERS)
    finally:
        rewards.set_max_memory_mb(pool_module.DEFAULT_MAX_MEMORY_MB)
    assert scores.tolist() == [0.0, 1.0, 1.0] and stats["errors"] == 1
    with pytest.raises(ValueError, match="max_memory_mb=-1"):
        rewards.set_max_memory_mb(-1)


rewards.register("test_greedy", greedy_verifier)
