"""Verifier worker processes with a per-answer timeout: a pathological answer never stalls training.

math-verify (sympy underneath) can take forever on an answer such as `\\boxed{9^{9^{9^9}}}`, and it
guards itself with signal.alarm, which neither works in threads nor interrupts a long C-level
integer power. So verifiers run in separate processes, one answer at a time each; a worker past
its deadline is killed and replaced, and its answer scores 0 (counted as a timeout). A verifier
that raises, returns a non-number, or kills its process (a segfault, os._exit, a SIGKILL from
outside, the kernel's OOM killer) also scores 0 (counted as an error), and the worker is replaced.
Each worker's address space is capped (`rewards.max_memory_mb`, RLIMIT_AS), so an answer that
allocates without bound fails with MemoryError in its own process instead of taking the host.

Workers are fresh interpreters (`python -c "...pool._serve(FD)"`, talking over a socket pair),
neither forked from a process that runs JAX threads nor re-importing the caller's `__main__`
(what multiprocessing's spawn would do to an absl app). They start once per process, lazily,
and close at exit, so a training step does not pay start-up. A verifier reaches a worker pickled
by reference (module + name), so it must be a top-level function of an importable module.
"""

from __future__ import annotations

import atexit
import collections
import ctypes
import math
import os
import pickle
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, wait
from typing import Any

import numpy as np

# Imported by each worker before it reports ready, so the first answer's deadline does not pay
# for importing sympy and math-verify.
PRELOAD = ("jaxprefix.rewards",)
START_TIMEOUT_S = 120.0
# A worker that dies before it is ready is started again, this many times in a row at most: one
# killed from outside is replaced, one that cannot start (a cap too small to import sympy, a
# broken environment) stops the run.
START_ATTEMPTS = 3
# Address-space cap per worker (config.rewards.max_memory_mb): an answer like 9^(9^9) makes sympy
# build ever larger integers, and a capped worker fails with MemoryError (scored 0) instead of
# pushing the host into swap. A worker with sympy and math-verify loaded maps about 1 GiB.
DEFAULT_MAX_MEMORY_MB = 8192
_max_memory_mb = DEFAULT_MAX_MEMORY_MB  # of the pools shared_pool starts


def default_workers() -> int:
    """Half the cores (verifiers share the host with input pipelines), between 1 and 8."""
    return max(1, min(8, (os.cpu_count() or 2) // 2))


class _Worker:
    """One verifier process and the parent's end of its socket."""

    def __init__(self, memory_limit: int):
        parent_end, child_end = socket.socketpair()
        # The child must import what the parent can: tests, the demo task, user verifier modules.
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        self.process = subprocess.Popen(
            [sys.executable, "-c",
             f"from jaxprefix.rewards.pool import _serve; _serve({child_end.fileno()}, {memory_limit})"],
            pass_fds=(child_end.fileno(),), env=env, stdin=subprocess.DEVNULL)
        child_end.close()
        self.conn = Connection(parent_end.detach())
        self.started = time.monotonic()
        self.ready = False

    def kill(self):
        self.conn.close()
        self.process.kill()
        self.process.wait()


class VerifierPool:
    """A fixed number of verifier processes; `score` keeps them all busy until a batch is done."""

    def __init__(self, workers: int, max_memory_mb: int = DEFAULT_MAX_MEMORY_MB):
        if workers < 1:
            raise ValueError(f"VerifierPool: workers must be >= 1, got {workers}")
        self.memory_limit = int(max_memory_mb) << 20
        self._lock = threading.Lock()
        self._workers = [_Worker(self.memory_limit) for _ in range(workers)]
        self.replaced = 0  # workers killed or crashed over the pool's life
        self._failed_starts = 0  # workers in a row that died before they were ready

    def _replace(self, worker: _Worker) -> _Worker:
        worker.kill()
        fresh = _Worker(self.memory_limit)
        self._workers[self._workers.index(worker)] = fresh
        self.replaced += 1
        return fresh

    def _failed_start(self, worker: _Worker) -> None:
        self._failed_starts += 1
        if self._failed_starts >= START_ATTEMPTS:
            raise RuntimeError(
                f"{START_ATTEMPTS} verifier workers in a row exited before they were ready (the "
                f"last with status {worker.process.wait()}; its stderr above says why); expected "
                f"workers that start: is config.rewards.max_memory_mb="
                f"{self.memory_limit >> 20} enough to import the verifier?")

    def score(self, fn: Callable, texts: Sequence[str], problems: Sequence[Any],
              timeout_s: float) -> tuple[np.ndarray, dict[str, int]]:
        """Rewards [N] float32 in input order, and counts of timeouts and errors (which score 0)."""
        with self._lock:  # one batch at a time: two callers would hand answers to one worker
            busy: dict[_Worker, tuple[int, float]] = {}  # worker -> (answer index, deadline)
            try:
                return self._score(fn, texts, problems, timeout_s, busy)
            except BaseException:
                # Interrupted (Ctrl-C, a pickling error): a busy worker would later answer an old
                # question, so it goes.
                for worker in list(busy):
                    self._replace(worker)
                raise

    def _score(self, fn, texts, problems, timeout_s, busy):
        payloads = [pickle.dumps((fn, text, problem)) for text, problem in zip(texts, problems)]
        rewards = np.zeros(len(payloads), np.float32)
        counts = {"timeouts": 0, "errors": 0}
        todo = collections.deque(range(len(payloads)))

        while todo or busy:
            for worker in self._workers:
                if worker.ready and worker not in busy and todo:
                    index = todo.popleft()
                    try:
                        worker.conn.send((index, payloads[index]))
                        busy[worker] = (index, time.monotonic() + timeout_s)
                    except OSError:  # died while idle: replace, retry the answer elsewhere
                        todo.appendleft(index)
                        self._replace(worker)

            now = time.monotonic()
            deadlines = [deadline for _, deadline in busy.values()]
            deadlines += [w.started + START_TIMEOUT_S for w in self._workers if not w.ready]
            listening = {w.conn: w for w in self._workers if not w.ready or w in busy}
            for conn in wait(list(listening), timeout=max(0.0, min(deadlines) - now)):
                worker = listening[conn]
                try:
                    message = conn.recv()
                except (EOFError, OSError):  # the process died (a crash, os._exit, a kill)
                    if worker in busy:
                        counts["errors"] += 1
                        busy.pop(worker)
                    else:
                        self._failed_start(worker)
                    self._replace(worker)
                    continue
                if message[0] == "ready":
                    worker.ready = True
                    self._failed_starts = 0
                    continue
                status, index, value = message
                busy.pop(worker)
                if status == "ok":
                    rewards[index] = value
                else:
                    counts["errors"] += 1

            now = time.monotonic()
            for worker, (index, deadline) in list(busy.items()):
                if now >= deadline:
                    counts["timeouts"] += 1
                    busy.pop(worker)
                    self._replace(worker)
            for worker in self._workers:
                if not worker.ready and now - worker.started > START_TIMEOUT_S:
                    raise RuntimeError(f"a verifier worker did not start within {START_TIMEOUT_S:.0f} s")
        return rewards, counts

    def close(self):
        for worker in self._workers:
            try:
                worker.conn.send(None)
            except OSError:
                pass
        for worker in self._workers:
            try:
                worker.process.wait(timeout=2.0)
            except subprocess.TimeoutExpired:
                worker.process.kill()
                worker.process.wait()
            worker.conn.close()
        self._workers = []


_POOLS: dict[int, VerifierPool] = {}


def set_max_memory_mb(max_memory_mb: int) -> None:
    """The address-space cap of every shared pool's workers (config.rewards.max_memory_mb; 0: no
    cap). Pools started under another cap are closed; the next score starts them again."""
    global _max_memory_mb
    if int(max_memory_mb) < 0:
        raise ValueError(f"config.rewards.max_memory_mb={max_memory_mb}: expected >= 0 (0: no cap)")
    if int(max_memory_mb) != _max_memory_mb:
        close_pools()
        _max_memory_mb = int(max_memory_mb)


def shared_pool(workers: int) -> VerifierPool:
    """This process's pool of `workers` processes, started on first use and closed at exit."""
    if workers not in _POOLS:
        if not _POOLS:
            atexit.register(close_pools)
        _POOLS[workers] = VerifierPool(workers, _max_memory_mb)
    return _POOLS[workers]


def close_pools():
    while _POOLS:
        _POOLS.popitem()[1].close()


def _as_reward(value: Any) -> float:
    reward = float(value)  # a verifier returning a non-number is an error, not a 0 by accident
    if not math.isfinite(reward):
        raise ValueError(f"verifier returned {value!r}")
    return reward


def _die_with_parent():
    # A worker stuck in C on a pathological answer never reads its socket again; without this
    # it would outlive a killed trainer. (Linux: PR_SET_PDEATHSIG = 1.)
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def _serve(fd: int, memory_limit: int):
    """A worker's loop: (index, pickled (fn, text, problem)) in, (status, index, reward) out."""
    import importlib

    _die_with_parent()
    if memory_limit > 0:
        resource.setrlimit(resource.RLIMIT_AS, (memory_limit, memory_limit))
    conn = Connection(fd)
    for module in PRELOAD:
        importlib.import_module(module)
    conn.send(("ready",))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message is None:
            return
        index, payload = message
        try:
            fn, text, problem = pickle.loads(payload)
            conn.send(("ok", index, _as_reward(fn(text, problem))))
        except Exception as e:  # any verifier failure scores 0; the parent counts it
            conn.send(("error", index, f"{type(e).__name__}: {e}"[:500]))
