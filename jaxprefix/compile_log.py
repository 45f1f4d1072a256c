"""What XLA compiled and what the persistent compilation cache served, counted from JAX's own
monitoring events, so a run can say where its first step's time went and show that no program
is compiled twice (a metrics row's time/compile and time/compiled_programs are 0 on a step
that compiled nothing).

`install()` registers the listeners once a process; `totals()` reads the running counts and
`Totals.minus` the part of them since an earlier reading.
"""
from __future__ import annotations

import dataclasses
import threading

from jax import monitoring

# jax/_src/dispatch.py and compiler.py: every program obtained for a jit (compiled or read
# from the persistent cache) records one backend-compile duration; a cache read records a hit.
_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
_TRACE = "/jax/core/compile/jaxpr_trace_duration"
_LOWER = "/jax/core/compile/jaxpr_to_mlir_module_duration"
_CACHE_HIT = "/jax/compilation_cache/cache_hits"


@dataclasses.dataclass(frozen=True)
class Totals:
    programs: int = 0        # XLA programs obtained: compiled, or served by the cache
    cache_hits: int = 0      # of them, served by the persistent cache
    seconds: float = 0.0     # tracing, lowering and compiling (or reading from the cache)

    def minus(self, earlier: Totals) -> Totals:
        return Totals(self.programs - earlier.programs, self.cache_hits - earlier.cache_hits,
                      self.seconds - earlier.seconds)

    def metrics(self) -> dict[str, float]:
        """A metrics row's figures, 0 on a step that compiled nothing; under time/ with the
        other figures that differ between a run and its resumed twin."""
        return {"time/compile": self.seconds, "time/compiled_programs": self.programs,
                "time/cached_programs": self.cache_hits}

    def describe(self) -> str:
        if not self.programs:
            return "nothing compiled"
        compiled = self.programs - self.cache_hits
        return (f"{self.seconds:.1f} s obtaining {self.programs} XLA programs: {compiled} "
                f"compiled, {self.cache_hits} served by the persistent compilation cache")


_lock = threading.Lock()
_counts = {"programs": 0, "cache_hits": 0, "seconds": 0.0}
_installed = False


def _on_duration(event: str, seconds: float, **_) -> None:
    if event in (_BACKEND_COMPILE, _TRACE, _LOWER):
        with _lock:
            _counts["seconds"] += seconds
            _counts["programs"] += event == _BACKEND_COMPILE


def _on_event(event: str, **_) -> None:
    if event == _CACHE_HIT:
        with _lock:
            _counts["cache_hits"] += 1


def install() -> None:
    """Starts counting (once a process; later calls do nothing)."""
    global _installed
    with _lock:
        if _installed:
            return
        _installed = True
    monitoring.register_event_duration_secs_listener(_on_duration)
    monitoring.register_event_listener(_on_event)


def totals() -> Totals:
    with _lock:
        return Totals(**_counts)
