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
# Rows a metrics.jsonl segment (and events a TensorBoard file) holds before the next one starts
# (config.metrics.segment_rows): a flush rewrites one segment, at most ~1.2 MB at the ~1.2 KB
# rows of an RL step, so a 100k-step run writes 100k x 0.6 MB on average instead of O(steps^2)
# (6 TB whole-file rewrites), and reading it back lists and reads ~100 objects.
SEGMENT_ROWS = 1000
SEGMENTS = "metrics"  # the folder of sealed segments: metrics/<first step, 9 digits>.jsonl


class MetricsWriter:
    """Writes `{'step': s, **scalars}` records to `workdir/metrics.jsonl` and TensorBoard scalars
    to `workdir/tensorboard/`, local or on gs://.

    GCS has no append, so the newest rows are kept in memory and rewritten whole (one object
    upload, atomic locally too) at every `write`: a reader or a killed run never sees half a
    line. metrics.jsonl holds at most `segment_rows` rows; then they are sealed into
    `metrics/<first step>.jsonl` (written once, never again) and metrics.jsonl starts over, so a
    flush's bytes stay bounded however long the run. TensorBoard event files roll over the same
    way. `read_metrics` reads the sealed segments and metrics.jsonl as one file.

    Resuming keeps only records of steps before the resumed step (sealed segments past it are
    removed), so the rows stay one per step; each run of a workdir adds its own TensorBoard
    event file, as TensorBoard expects.
    """

    def __init__(self, workdir: str, *, resume_step: int | None = None, enabled: bool | None = None,
                 segment_rows: int = SEGMENT_ROWS):
        if segment_rows < 1:
            raise ValueError(f"config.metrics.segment_rows={segment_rows}: expected >= 1")
        self.enabled = jax.process_index() == 0 if enabled is None else enabled
        self.workdir, self.segment_rows = workdir, segment_rows
        self.path = storage.join(workdir, "metrics.jsonl")
        self._lines: list[str] = []
        self._events = None
        self._stale_segments: list[str] = []
        if not self.enabled:
            return
        self._lines = [json.dumps(r) + "\n" for r in self._kept_rows(resume_step or 0)]
        self._new_event_file()
        self.flush()  # the kept records, and an event file TensorBoard already recognises

    def _kept_rows(self, step: int) -> list[dict]:
        """The open rows of a run resumed at `step`: the rows before `step` that no kept sealed
        segment holds. A segment with rows at or after `step` is removed, once metrics.jsonl
        holds its rows before `step` (`flush`), so a reader in between sees every row."""
        sealed, current = _segments(self.workdir), _merged([self.path])
        # Segment i holds the steps from its name up to the first step of what follows it.
        following = [_first_step(p) for p in sealed[1:]] + [current[0]["step"] if current else None]
        kept = sum(1 for first in following if first is not None and first <= step)
        self._stale_segments = sealed[kept:]
        rows = _merged([p for p in sealed[kept:] if _first_step(p) < step] + [self.path])
        return [r for r in rows if r.get("step", 0) < step]

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
        if len(self._lines) >= self.segment_rows:  # seal; metrics.jsonl restarts at this row
            first = json.loads(self._lines[0])["step"]
            storage.write_atomic(storage.join(self.workdir, SEGMENTS, f"{first:09d}.jsonl"),
                                 "".join(self._lines))
            self._lines = []
        if self._event_count >= self.segment_rows:
            self._new_event_file()
        record = {"step": int(step)}
        record.update({k: _plain(v) for k, v in sorted(scalars.items())})
        self._lines.append(json.dumps(record) + "\n")
        values = [summary_pb2.Summary.Value(tag=k, simple_value=float(v))
                  for k, v in record.items() if k != "step" and v is not None]
        self._add_event(event_pb2.Event(wall_time=time.time(), step=int(step),
                                        summary=summary_pb2.Summary(value=values)))
        self._event_count += 1
        self.flush()

    def flush(self):
        if self._events is not None:
            storage.write_atomic(self.path, "".join(self._lines))
            storage.write_atomic(self._events_path, self._events.getvalue())
            for path in reversed(self._stale_segments):  # only once metrics.jsonl holds their rows
                storage.remove(path)
            self._stale_segments = []

    def close(self):
        self.flush()
        self._events = None


def _segments(workdir: str) -> list[str]:
    """Sealed metrics segments of `workdir`, oldest first."""
    folder = storage.join(workdir, SEGMENTS)
    return storage.glob(folder, "*.jsonl") if storage.isdir(folder) else []


def _first_step(segment: str) -> int:
    return int(storage.basename(segment).split(".")[0])


def _merged(paths: list[str]) -> list[dict]:
    """Rows of the JSON-lines files `paths` (oldest first), one per step, sorted; a step in two
    files (a run killed while sealing a segment) is taken from the later one."""
    by_step = {}
    for path in paths:
        if storage.exists(path):
            for line in storage.read_text(path).splitlines():
                if line.strip():
                    row = json.loads(line)
                    by_step[row.get("step", 0)] = row
    return [by_step[step] for step in sorted(by_step)]


def read_metrics(workdir: str) -> list[dict]:
    """All records of `workdir`'s metrics (sealed segments, then metrics.jsonl), in step order.
    Workdirs written before segments existed hold them all in metrics.jsonl."""
    path = storage.join(workdir, "metrics.jsonl")
    if not storage.exists(path):
        raise FileNotFoundError(f"{path}: no metrics (the run has not logged a step)")
    return _merged(_segments(workdir) + [path])
