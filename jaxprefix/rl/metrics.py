"""Run metrics: one JSON object per step in metrics.jsonl plus TensorBoard scalars; FLOPs.

Written by process 0 only, through jaxprefix.storage (local or gs://). TensorBoard event records
come from tensorboard's own record writer, so the library needs neither TensorFlow nor torch.
"""
from __future__ import annotations

import io
import itertools
import math
import os
import socket
import time

import jax
import numpy as np
from tensorboard.compat.proto import event_pb2, summary_pb2
from tensorboard.summary.writer.record_writer import RecordWriter

from jaxprefix import storage
from jaxprefix.rl import row_log


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
# Rows a metrics.jsonl segment (and events a TensorBoard file) holds before the next one starts
# (config.metrics.segment_rows): a flush rewrites one segment, at most ~1.2 MB at the ~1.2 KB
# rows of an RL step, so a 100k-step run writes 100k x 0.6 MB on average instead of O(steps^2)
# (6 TB whole-file rewrites), and reading it back lists and reads ~100 objects.
SEGMENT_ROWS = 1000
SEGMENTS = "metrics"  # the folder of sealed segments: metrics/<first step, 9 digits>.jsonl


class MetricsWriter:
    """Writes `{'step': s, **scalars}` records to `workdir/metrics.jsonl` and TensorBoard scalars
    to `workdir/tensorboard/`, local or on gs://.

    metrics.jsonl is a RowLog (row_log.py): rewritten whole at every `write`, at most
    `segment_rows` rows before they are sealed into `metrics/<first step>.jsonl`, so a flush's
    bytes stay bounded however long the run; `read_metrics` reads it all as one file.
    TensorBoard event files roll over at the same count. Resuming keeps only records of steps
    before the resumed step, so the rows stay one per step; each run of a workdir adds its own
    TensorBoard event file, as TensorBoard expects.
    """

    def __init__(self, workdir: str, *, resume_step: int | None = None, enabled: bool | None = None,
                 segment_rows: int = SEGMENT_ROWS):
        self.enabled = jax.process_index() == 0 if enabled is None else enabled
        self.workdir, self.segment_rows = workdir, segment_rows
        self._events = None
        if not self.enabled:
            return
        self._rows = row_log.RowLog(workdir, "metrics", SEGMENTS, segment_rows=segment_rows,
                                    resume_step=resume_step or 0)
        self._new_event_file()
        if resume_step:
            # The steps from resume_step on are trained again (their rows rewritten above), and
            # an earlier process may have logged them before it was killed: TensorBoard drops
            # the older files' events from a SessionLog START's step on, so each step shows once.
            self._add_event(event_pb2.Event(wall_time=time.time(), step=int(resume_step),
                                            session_log=event_pb2.SessionLog(
                                                status=event_pb2.SessionLog.START)))
        self.flush()  # the kept records, and an event file TensorBoard already recognises

    def _new_event_file(self) -> None:
        name = (f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}."
                f"{os.getpid()}.{next(_EVENT_FILES):06d}")
        self._events_path = storage.join(self.workdir, "tensorboard", name)
        self._events = io.BytesIO()
        self._records = RecordWriter(self._events)
        self._event_count = 0
        self._add_event(event_pb2.Event(wall_time=time.time(), file_version="brain.Event:2"))

    def _add_event(self, event) -> None:
        self._records.write(event.SerializeToString())

    def write(self, step: int, scalars: dict):
        if not self.enabled:
            return
        if self._event_count >= self.segment_rows:
            self._new_event_file()
        record = {"step": int(step)}
        record.update({k: _plain(v) for k, v in sorted(scalars.items())})
        values = [summary_pb2.Summary.Value(tag=k, simple_value=float(v))
                  for k, v in record.items() if k != "step" and v is not None]
        self._add_event(event_pb2.Event(wall_time=time.time(), step=int(step),
                                        summary=summary_pb2.Summary(value=values)))
        self._event_count += 1
        self._rows.append([record])
        self.flush()

    def flush(self):
        if self._events is not None:
            self._rows.flush()
            storage.write_atomic(self._events_path, self._events.getvalue())

    def close(self):
        self.flush()
        self._events = None


def read_metrics(workdir: str) -> list[dict]:
    """All records of `workdir`'s metrics (sealed segments, then metrics.jsonl), in step order.
    Workdirs written before segments existed hold them all in metrics.jsonl."""
    path = storage.join(workdir, "metrics.jsonl")
    if not storage.exists(path):
        raise FileNotFoundError(f"{path}: no metrics (the run has not logged a step)")
    return row_log.read_rows(workdir, "metrics", SEGMENTS)
