"""Per-problem results of the loop's in-run evaluations: `<workdir>/eval_counts.jsonl`.

metrics.jsonl holds each evaluation's averages; intervals over problems and per-group tables
(jaxprefix/statistics.py) need each problem's correct samples at each step. One line per
(step, eval request): {'step', 'name', 'n', 'correct_counts'}. Kept in memory and rewritten
whole at each evaluation (GCS has no append): unlike metrics.jsonl, not yet sealed into bounded
segments, so its bytes written grow with the square of a run's evaluations; a resumed run keeps
the lines of the steps before it.
"""
from __future__ import annotations

import json

import jax

from jaxprefix import storage

FILE = "eval_counts.jsonl"


class EvalCountsWriter:
    def __init__(self, workdir: str, *, resume_step: int = 0):
        self.enabled = jax.process_index() == 0
        self.path = storage.join(workdir, FILE)
        self._lines: list[str] = []
        if self.enabled and storage.exists(self.path):
            self._lines = [line + "\n" for line in storage.read_text(self.path).splitlines()
                           if line.strip() and json.loads(line)["step"] < resume_step]

    def write(self, step: int, counts: dict[str, tuple[int, list[int]]]) -> None:
        """counts: eval request name -> (samples per problem, correct samples per problem)."""
        if not self.enabled or not counts:
            return
        for name, (n, correct) in counts.items():
            self._lines.append(json.dumps({"step": step, "name": name, "n": n,
                                           "correct_counts": correct}) + "\n")
        storage.write_atomic(self.path, "".join(self._lines))


def read_eval_counts(workdir: str) -> list[dict]:
    """Every record of a run's eval_counts.jsonl ([] when it has none)."""
    path = storage.join(workdir, FILE)
    if not storage.exists(path):
        return []
    return [json.loads(line) for line in storage.read_text(path).splitlines() if line.strip()]
