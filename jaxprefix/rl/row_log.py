"""A run's rows as JSON lines on storage with no append (GCS): bounded rewrites, sealed segments.

A RowLog keeps its newest rows in memory and rewrites `<workdir>/<name>.jsonl` whole (one object
upload, atomic locally too) at every flush, so a reader or a killed run never sees half a line.
Once it holds `segment_rows` rows they are sealed into `<workdir>/<folder>/<first step, 9
digits>.jsonl` (written once, never again) and `<name>.jsonl` starts over: a flush's bytes stay
bounded however long the run. `read_rows` reads the segments and the open file as one.

Every row has a 'step'; its key is the step and the fields named in `key` (metrics: one row a
step; evaluation counts: one a step and request). A key in two files (a run killed while
sealing) is read from the later one. Resuming at step s keeps the rows of steps before s; the
segments holding rows at or after s are removed, once the open file holds their rows before s,
so a reader in between sees every row. Files written before segments existed (every row in
`<name>.jsonl`) stay readable and resume the same way.
"""
from __future__ import annotations

import json
from typing import Sequence

from jaxprefix import storage


class RowLog:
    def __init__(self, workdir: str, name: str, folder: str, *, segment_rows: int,
                 key: Sequence[str] = (), resume_step: int = 0):
        if segment_rows < 1:
            raise ValueError(f"config.metrics.segment_rows={segment_rows}: expected >= 1")
        self.workdir, self.folder, self.key = workdir, folder, tuple(key)
        self.segment_rows = segment_rows
        self.path = storage.join(workdir, f"{name}.jsonl")
        sealed = _segments(workdir, folder)
        current = _merged([self.path], self.key)
        # Segment i holds the steps from its name up to the first step of what follows it.
        following = [_first_step(p) for p in sealed[1:]] + [current[0].get("step", 0) if current else None]
        kept = sum(1 for first in following if first is not None and first <= resume_step)
        self._stale = sealed[kept:]
        rows = _merged([p for p in self._stale if _first_step(p) < resume_step] + [self.path],
                       self.key)
        self._lines = [json.dumps(r) + "\n" for r in rows if r.get("step", 0) < resume_step]

    def append(self, rows: Sequence[dict]) -> None:
        """Adds rows (of one step: a segment starts at a step's first row); `flush` writes them."""
        if len(self._lines) >= self.segment_rows:  # seal; the open file restarts at these rows
            first = json.loads(self._lines[0])["step"]
            storage.write_atomic(storage.join(self.workdir, self.folder, f"{first:09d}.jsonl"),
                                 "".join(self._lines))
            self._lines = []
        self._lines += [json.dumps(r) + "\n" for r in rows]

    def flush(self) -> None:
        storage.write_atomic(self.path, "".join(self._lines))
        for path in reversed(self._stale):  # only once the open file holds their rows
            storage.remove(path)
        self._stale = []


def read_rows(workdir: str, name: str, folder: str, key: Sequence[str] = ()) -> list[dict]:
    """Every row of a RowLog (its sealed segments, then `<name>.jsonl`), in key order; [] when
    the open file does not exist."""
    path = storage.join(workdir, f"{name}.jsonl")
    if not storage.exists(path):
        return []
    return _merged(_segments(workdir, folder) + [path], tuple(key))


def _segments(workdir: str, folder: str) -> list[str]:
    """Sealed segments, oldest first."""
    directory = storage.join(workdir, folder)
    return storage.glob(directory, "*.jsonl") if storage.isdir(directory) else []


def _first_step(segment: str) -> int:
    return int(storage.basename(segment).split(".")[0])


def _merged(paths: list[str], key: tuple[str, ...]) -> list[dict]:
    """Rows of the JSON-lines files `paths` (oldest first), one per key, sorted by it; a key in
    two files is taken from the later one."""
    by_key = {}
    for path in paths:
        if storage.exists(path):
            for line in storage.read_text(path).splitlines():
                if line.strip():
                    row = json.loads(line)
                    by_key[(row.get("step", 0),) + tuple(row[k] for k in key)] = row
    return [by_key[k] for k in sorted(by_key)]
