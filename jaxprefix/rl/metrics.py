"""Run metrics: one JSON object per step in metrics.jsonl plus TensorBoard scalars; FLOPs.

Written by process 0 only. TensorBoard files come from tensorboard's own event writer, so the
library needs neither TensorFlow nor torch.
"""
from __future__ import annotations

import json
import math
import os
import time

import jax
import numpy as np
from tensorboard.compat.proto import event_pb2, summary_pb2
from tensorboard.summary.writer.event_file_writer import EventFileWriter


def sampling_flops(num_params: int, tokens: int) -> float:
    """Forward FLOPs of producing or scoring `tokens` tokens: 2 N D."""
    return 2.0 * num_params * tokens


def update_flops(num_params: int, tokens: int) -> float:
    """Forward + backward FLOPs of training on `tokens` tokens: 6 N D."""
    return 6.0 * num_params * tokens


def count_params(params) -> int:
    """Number of scalars in a parameter pytree (N of the FLOPs formulas)."""
    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(params)))


def _plain(value):
    """A JSON-able Python scalar (numpy and jax scalars included); non-finite -> None."""
    value = float(np.asarray(value)) if not isinstance(value, (int, float, bool)) else value
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsWriter:
    """Appends `{'step': s, **scalars}` to `workdir/metrics.jsonl`; mirrors scalars to TensorBoard.

    Resuming truncates records at or after the resumed step so the file stays one line per step.
    """

    def __init__(self, workdir: str, *, resume_step: int | None = None, enabled: bool | None = None):
        self.enabled = jax.process_index() == 0 if enabled is None else enabled
        self.path = os.path.join(workdir, "metrics.jsonl")
        self._events = None
        if not self.enabled:
            return
        os.makedirs(workdir, exist_ok=True)
        self._drop_records_from(resume_step or 0)
        self._events = EventFileWriter(os.path.join(workdir, "tensorboard"))

    def _drop_records_from(self, step: int):
        """Keep only records of steps < step (a resumed run rewrites the rest)."""
        if not os.path.exists(self.path):
            return
        with open(self.path) as f:
            kept = [line for line in f if line.strip() and json.loads(line).get("step", 0) < step]
        with open(self.path, "w") as f:
            f.writelines(kept)

    def write(self, step: int, scalars: dict):
        if not self.enabled:
            return
        record = {"step": int(step)}
        record.update({k: _plain(v) for k, v in sorted(scalars.items())})
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        values = [summary_pb2.Summary.Value(tag=k, simple_value=float(v))
                  for k, v in record.items() if k != "step" and v is not None]
        self._events.add_event(event_pb2.Event(wall_time=time.time(), step=int(step),
                                               summary=summary_pb2.Summary(value=values)))

    def flush(self):
        if self._events is not None:
            self._events.flush()

    def close(self):
        if self._events is not None:
            self._events.close()
            self._events = None


def read_metrics(workdir: str) -> list[dict]:
    """All records of `workdir/metrics.jsonl`, in order."""
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]
