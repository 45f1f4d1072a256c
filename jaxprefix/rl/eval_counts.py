"""Per-problem results of the loop's in-run evaluations: `<workdir>/eval_counts.jsonl`.

metrics.jsonl holds each evaluation's averages; intervals over problems and per-group tables
(jaxprefix/statistics.py) need each problem's correct samples at each step. One row per
(step, eval request): {'step', 'name', 'n', 'correct_counts'}, in a RowLog (row_log.py) sealed
into `eval_counts/<first step>.jsonl` segments as metrics.jsonl is; a resumed run keeps the
rows of the steps before it.
"""
from __future__ import annotations

import jax

from jaxprefix.rl import row_log

NAME = "eval_counts"
KEY = ("name",)  # besides the step


class EvalCountsWriter:
    def __init__(self, workdir: str, *, segment_rows: int, resume_step: int = 0):
        self.enabled = jax.process_index() == 0
        if self.enabled:
            self._rows = row_log.RowLog(workdir, NAME, NAME, segment_rows=segment_rows, key=KEY,
                                        resume_step=resume_step)

    def write(self, step: int, counts: dict[str, tuple[int, list[int]]]) -> None:
        """counts: eval request name -> (samples per problem, correct samples per problem)."""
        if not self.enabled or not counts:
            return
        self._rows.append([{"step": step, "name": name, "n": n, "correct_counts": correct}
                           for name, (n, correct) in counts.items()])
        self._rows.flush()


def read_eval_counts(workdir: str) -> list[dict]:
    """Every record of a run's evaluation counts, by step and request name ([] when none)."""
    return row_log.read_rows(workdir, NAME, NAME, KEY)
