"""Run metrics: one JSON object per step in metrics.jsonl plus TensorBoard scalars; FLOPs.

Written by process 0 only, through jaxprefix.storage (local or gs://). TensorBoard event records
come from tensorboard's own record writer, so the library needs neither TensorFlow nor torch.
"""
from __future__ import annotations

import io
import itertools
import json
import math
import os
import socket
import time

import jax
import numpy as np
from tensorboard.compat.proto import event_pb2, summary_pb2
from tensorboard.summary.writer.record_writer import RecordWriter

from jaxprefix import storage


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


_EVENT_FILES = itertools.count()  # one event file per writer, even two in the same second


class MetricsWriter:
    """Writes `{'step': s, **scalars}` records to `workdir/metrics.jsonl` and TensorBoard scalars
    to `workdir/tensorboard/`, local or on gs://.

    GCS has no append, so both files are kept in memory and rewritten whole (one object upload
    each, atomic locally too) at every `write`: a reader or a killed run never sees half a line.
    Resuming keeps only records of steps before the resumed step, so the file stays one line per
    step; each run of a workdir adds its own TensorBoard event file, as TensorBoard expects.
    """

    def __init__(self, workdir: str, *, resume_step: int | None = None, enabled: bool | None = None):
        self.enabled = jax.process_index() == 0 if enabled is None else enabled
        self.path = storage.join(workdir, "metrics.jsonl")
        self._lines: list[str] = []
        self._events = None
        if not self.enabled:
            return
        if storage.exists(self.path):
            step = resume_step or 0
            self._lines = [line + "\n" for line in storage.read_text(self.path).splitlines()
                           if line.strip() and json.loads(line).get("step", 0) < step]
        name = (f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}."
                f"{os.getpid()}.{next(_EVENT_FILES)}")
        self._events_path = storage.join(workdir, "tensorboard", name)
        self._events = io.BytesIO()
        self._records = RecordWriter(self._events)
        self._add_event(event_pb2.Event(wall_time=time.time(), file_version="brain.Event:2"))
        self.flush()  # the kept records, and an event file TensorBoard already recognises

    def _add_event(self, event) -> None:
        self._records.write(event.SerializeToString())

    def write(self, step: int, scalars: dict):
        if not self.enabled:
            return
        record = {"step": int(step)}
        record.update({k: _plain(v) for k, v in sorted(scalars.items())})
        self._lines.append(json.dumps(record) + "\n")
        values = [summary_pb2.Summary.Value(tag=k, simple_value=float(v))
                  for k, v in record.items() if k != "step" and v is not None]
        self._add_event(event_pb2.Event(wall_time=time.time(), step=int(step),
                                        summary=summary_pb2.Summary(value=values)))
        self.flush()

    def flush(self):
        if self._events is not None:
            storage.write_atomic(self.path, "".join(self._lines))
            storage.write_atomic(self._events_path, self._events.getvalue())

    def close(self):
        self.flush()
        self._events = None


def read_metrics(workdir: str) -> list[dict]:
    """All records of `workdir/metrics.jsonl`, in order."""
    text = storage.read_text(storage.join(workdir, "metrics.jsonl"))
    return [json.loads(line) for line in text.splitlines() if line.strip()]
