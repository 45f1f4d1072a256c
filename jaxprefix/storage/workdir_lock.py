"""Workdir ownership: one run writes a workdir at a time; a second one refuses, naming the first.

Two runs in one workdir interleave their metrics and write the same orbax temporary directory,
which orbax deletes when it finds one: one run can destroy the other's checkpoint. So a run
holds `<workdir>/lock.json` while it runs, a record of its owner (host, pid, start, command;
on gs:// a heartbeat time too):
- locally, under an flock: the kernel drops it when the process dies, however it dies, so a
  lock file left by a killed run is free and is taken over (with a message naming that run);
- on gs://, as an object created with a generation precondition (ifGenerationMatch=0: of two
  creators one wins) and rewritten every `heartbeat_s` on the generation it last wrote. A lock
  whose heartbeat is older than `stale_minutes`, or whose owner is a dead process on this host
  (a preempted VM restarting), is taken over by a rewrite on the generation read, so that of two
  runs taking over one wins. Every call retries transient GCS failures until the run's deadline
  (storage.faults.gcs_retry); a write whose answer was lost (a dropped connection after GCS
  carried it out) is recognised by the record's token, so the run does not refuse itself.
Only process 0 of a multi-host run holds the lock. Locks are re-entrant within a process: a
pipeline (demo, results) holds its workdir while its runs hold theirs.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import fcntl
import functools
import json
import os
import socket
import sys
import threading
import time
import uuid

from absl import logging

from jaxprefix import distributed, storage
from jaxprefix.errors import UserError

LOCK = "lock.json"
STALE_MINUTES = 10.0
HEARTBEAT_S = 60.0


class WorkdirLocked(UserError):
    """Another live run holds the workdir."""


def _now() -> float:
    return time.time()


def _owner() -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid(),
            "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "command": " ".join(sys.argv)[:500], "token": uuid.uuid4().hex}


def _describe(owner: dict) -> str:
    beat = (f"last heartbeat {(_now() - float(owner['heartbeat'])) / 60:.1f} min ago, "
            if "heartbeat" in owner else "")
    return (f"host {owner.get('host')} pid {owner.get('pid')}, started {owner.get('started')}, "
            f"{beat}command: {owner.get('command')}")


def _dead_here(owner: dict) -> bool:
    """The owner ran on this host and its process is gone (a preempted VM restarting)."""
    if owner.get("host") != socket.gethostname():
        return False
    try:
        os.kill(int(owner.get("pid", -1)), 0)
    except ProcessLookupError:
        return True
    except (PermissionError, ValueError, OverflowError):
        return False
    return False


def _refuse(workdir: str, owner: dict):
    raise WorkdirLocked(f"{workdir} is in use by another run ({_describe(owner)}); expected a "
                        f"workdir no live run holds: wait for that run, stop it, or use another "
                        f"--workdir")


class _LocalLock:
    """An flock on the lock file; the file keeps the owner's record for others to read."""

    def __init__(self, workdir: str):
        self.workdir, self.path = workdir, os.path.join(workdir, LOCK)
        self._file = None

    def acquire(self, stale_minutes: float) -> None:
        del stale_minutes  # the kernel frees the flock of a dead process at once
        os.makedirs(self.workdir, exist_ok=True)
        f = open(self.path, "a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            owner = _parse(f.read())
            f.close()
            _refuse(self.workdir, owner)
        f.seek(0)
        previous = _parse(f.read())
        if previous:
            logging.warning("%s: taking over the lock of a run that stopped without releasing "
                            "it (%s)", self.workdir, _describe(previous))
            if previous.get("host") == socket.gethostname():  # its pid names its temporaries
                for path in storage.remove_orphaned_temporaries(self.workdir, previous["pid"]):
                    logging.warning("removed %s, a file it was writing when it stopped", path)
        f.seek(0)
        f.truncate()
        f.write(json.dumps(_owner()))
        f.flush()
        self._file = f

    def release(self) -> None:
        if self._file is not None:
            self._file.truncate(0)  # an empty file: released, not abandoned
            self._file.close()  # closing drops the flock
            self._file = None


class _GcsLock:
    """A lock object with a heartbeat, every write conditioned on the generation last seen."""

    def __init__(self, workdir: str, heartbeat_s: float):
        from google.cloud import storage as gcs  # comes with gcsfs, which gs:// paths need

        bucket, _, prefix = workdir.split("://", 1)[1].partition("/")
        self.workdir, self.heartbeat_s = workdir, heartbeat_s
        self._blob_name = f"{prefix.rstrip('/')}/{LOCK}" if prefix else LOCK
        self._url = f"gs://{bucket}/{self._blob_name}"
        self._bucket = gcs.Client().bucket(bucket)
        self._owner = _owner()
        self.generation = None
        self._stop = threading.Event()
        self._thread = None

    def _write(self, if_generation_match: int) -> None:
        from google.api_core import exceptions

        blob = self._bucket.blob(self._blob_name)
        self._owner["heartbeat"] = _now()
        try:
            with storage.faults.reported("writing the lock", self._url):
                blob.upload_from_string(json.dumps(self._owner), content_type="application/json",
                                        if_generation_match=if_generation_match,
                                        retry=storage.faults.gcs_retry())
        except exceptions.PreconditionFailed:
            current = self._read()
            if current is not None and current[0].get("token") == self._owner["token"]:
                self.generation = current[1]  # ours: a retry after a lost answer
                return
            raise _Lost from None
        self.generation = blob.generation

    def _read(self) -> tuple[dict, int] | None:
        """(owner record, generation) of the lock object, or None when there is none."""
        with storage.faults.reported("reading the lock", self._url):
            blob = self._bucket.get_blob(self._blob_name, retry=storage.faults.gcs_retry())
            if blob is None:
                return None
            return _parse(blob.download_as_text(retry=storage.faults.gcs_retry())), blob.generation

    def acquire(self, stale_minutes: float) -> None:
        for _ in range(5):  # each round loses at most to a run that acquired in between
            try:
                self._write(0)
                break
            except _Lost:
                pass
            current = self._read()
            if current is None:  # released meanwhile
                continue
            owner, generation = current
            age_minutes = (_now() - float(owner.get("heartbeat", 0))) / 60
            if age_minutes < stale_minutes and not _dead_here(owner):
                _refuse(self.workdir, owner)
            try:
                self._write(generation)
            except _Lost:
                continue  # another run took it over, or the owner beat its heart: look again
            logging.warning("%s: took over a stale lock (%s)", self.workdir, _describe(owner))
            break
        else:
            raise WorkdirLocked(f"{self.workdir}: the lock object changed hands 5 times while "
                                f"this run tried to take it; expected one owner, try again")
        self._thread = threading.Thread(target=self._beat, daemon=True, name="workdir-lock")
        self._thread.start()

    def _beat(self):
        while not self._stop.wait(self.heartbeat_s):
            try:
                self._write(self.generation)
            except _Lost:
                logging.error("%s: another run took over this run's lock (no heartbeat for too "
                              "long); both may now write the workdir: stop one of them",
                              self.workdir)
                return
            except Exception as e:  # noqa: BLE001  (GCS down past the deadline: next beat)
                logging.warning("%s: lock heartbeat failed (%s)", self.workdir,
                                storage.faults.classify(e) or e)

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        try:
            self._bucket.blob(self._blob_name).delete(if_generation_match=self.generation,
                                                      retry=storage.faults.gcs_retry())
        except Exception as e:  # noqa: BLE001  (taken over, gone, or GCS refusing)
            failure = storage.faults.classify(e)
            logging.warning("%s: the lock stays (%s); a run on this host takes it over at once, "
                            "one elsewhere after workdir_lock.stale_minutes", self._url,
                            failure.reason if failure else str(e).splitlines()[0])


class _Lost(Exception):
    """A conditional write of the lock object failed: someone else wrote it."""


def _parse(text: str) -> dict:
    try:
        owner = json.loads(text) if text.strip() else {}
    except ValueError:
        owner = {}
    return owner if isinstance(owner, dict) else {}


_HELD: set[str] = set()  # workdirs this process holds


@dataclasses.dataclass(frozen=True)
class LockSettings:
    stale_minutes: float = STALE_MINUTES  # a gs:// lock unrenewed this long is taken over
    heartbeat_s: float = HEARTBEAT_S      # how often a gs:// lock is renewed

    @classmethod
    def from_config(cls, config) -> LockSettings:
        """config.workdir_lock's fields (a config without the block: the defaults)."""
        block = config.get("workdir_lock", None) or {}
        return cls(float(block.get("stale_minutes", STALE_MINUTES)),
                   float(block.get("heartbeat_s", HEARTBEAT_S)))


@contextlib.contextmanager
def hold(workdir: str, settings: LockSettings = LockSettings()):
    """Holds `workdir` for the block (process 0 only); raises WorkdirLocked when a live run
    holds it. Re-entrant: an inner block on a workdir this process holds leaves the lock to the
    outer one."""
    key = workdir.rstrip("/") if storage.is_remote(workdir) else os.path.abspath(workdir)
    if key in _HELD or not distributed.is_primary():
        yield
        return
    if storage.is_remote(key):
        lock = _GcsLock(key, settings.heartbeat_s)
    else:
        lock = _LocalLock(key)
    lock.acquire(settings.stale_minutes)
    _HELD.add(key)
    try:
        yield
    finally:
        _HELD.discard(key)
        lock.release()


def holds_workdir(job):
    """Decorates a job `fn(config, workdir, ...)` to run while holding `workdir`."""
    @functools.wraps(job)
    def run(config, workdir, *args, **kwargs):
        with hold(workdir, LockSettings.from_config(config)):
            return job(config, workdir, *args, **kwargs)
    return run
