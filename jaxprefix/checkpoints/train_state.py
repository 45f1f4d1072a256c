"""Training checkpoints with orbax: arrays (params, optimizer, step, RNG) + JSON (data, method).

One `TrainCheckpointer` per workdir. Arrays are restored onto the shardings of a live template
(the freshly initialised state), so a restart on the same mesh resumes without a host copy of
the model. The JSON part holds whatever Python state the run needs to continue the same
trajectory: the data iterator position, a method's trace pools and schedules.

On gs://, a save that fails transiently (GCS down past its clients' own retries) is logged and
the run goes on: the next save writes a newer checkpoint, and a run's last save (`wait=True`)
is made again until it is complete. Only past config.storage.retry_deadline_s since the first
failing save, or at a permanent failure (403), does it stop the run, in one line
(storage.faults); a checkpoint counts only once complete, so the one before stays the resume
point.
"""
from __future__ import annotations

import os
import time

import jax
import orbax.checkpoint as ocp
from absl import logging

from jaxprefix import errors, storage


def abstract_like(tree):
    """ShapeDtypeStructs carrying each leaf's sharding: the restore target of `tree`."""
    def leaf(x):
        sharding = getattr(x, "sharding", None)
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
    return jax.tree.map(leaf, tree)


class TrainCheckpointer:
    """Saves and restores (arrays pytree, JSON dict) pairs under `directory`, keeping N latest.

    Saves are asynchronous: `save` returns once the arrays are copied off the device, writing
    goes on in the background; `wait()` blocks until it is on disk (call before exiting).
    """

    def __init__(self, directory: str, *, max_to_keep: int = 3, async_save: bool = True):
        # orbax wants an absolute path; a gs:// URL already is one (abspath would mangle it).
        self.directory = directory if storage.is_remote(directory) else os.path.abspath(directory)
        storage.require_backend(self.directory)
        # cleanup_tmp_directories: a save cut short (a SIGKILL, a lost host) leaves a temporary
        # step directory; the next run's manager removes it, so a run killed again and again
        # keeps `max_to_keep` steps and nothing more.
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep, create=True, enable_async_checkpointing=async_save,
            cleanup_tmp_directories=True)
        self._manager = self._storage_call("opening checkpoints", lambda: ocp.CheckpointManager(
            self.directory, options=options, item_names=("arrays", "meta")))
        self._pending = None         # the step of the save in flight
        self._failing_since = None   # when saves began to fail transiently

    def _storage_call(self, operation: str, call):
        """`call()`, retried while GCS fails transiently (remote directories only)."""
        if not storage.is_remote(self.directory):
            return call()
        return storage.faults.retrying(operation, self.directory, call)

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def save(self, step: int, arrays, meta: dict | None = None, *, wait: bool = False) -> bool:
        """Write checkpoint `step`; returns False when it already exists. Raises DiskFull, before
        writing anything, when the local disk cannot take the arrays' bytes.

        wait: return only once the checkpoint is complete, saving it again while it fails
        transiently (up to the deadline): the run's last save, which no later one would replace.
        """
        operation = f"saving checkpoint {step} to"

        def attempt() -> bool:
            self._settle()
            if step in self._manager.all_steps():
                return False
            errors.check_free_space(self.directory, sum(x.nbytes for x in jax.tree.leaves(arrays)))
            args = ocp.args.Composite(arrays=ocp.args.StandardSave(arrays),
                                      meta=ocp.args.JsonSave(dict(meta or {})))
            with storage.faults.reported(operation, self.directory):
                saved = self._manager.save(step, args=args, force=True)
            self._pending = step
            if wait:
                self._settle(tolerate=False)
            return saved

        return storage.faults.retrying(operation, self.directory, attempt) if wait else attempt()

    def _settle(self, *, tolerate: bool = True) -> None:
        """Waits for the save in flight. One that failed transiently is logged and tolerated
        (the next save writes a newer checkpoint) until the deadline since the first failure."""
        if self._pending is None:
            return
        step, self._pending = self._pending, None
        try:
            with storage.faults.reported(f"saving checkpoint {step} to", self.directory):
                self._manager.wait_until_finished()
        except storage.faults.StorageUnavailable as e:
            self._failing_since = self._failing_since or time.monotonic()
            if not tolerate or time.monotonic() - self._failing_since > storage.faults.deadline_s():
                raise
            logging.warning("%s; the run goes on, the next save writes a newer one", e)
            return
        self._failing_since = None

    def restore(self, like, step: int | None = None):
        """(arrays shaped, typed and sharded like `like`, meta dict) of `step` (default latest)."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint under {self.directory}")
        args = ocp.args.Composite(arrays=ocp.args.StandardRestore(abstract_like(like)),
                                  meta=ocp.args.JsonRestore())
        restored = self._storage_call(f"restoring checkpoint {step} from",
                                      lambda: self._manager.restore(step, args=args))
        return restored["arrays"], dict(restored["meta"] or {})

    def wait(self):
        self._settle(tolerate=False)

    def reload(self):
        """Forget what orbax knew of the directory (a step was moved out of it)."""
        self._storage_call("listing checkpoints", self._manager.reload)

    def close(self):
        self._settle(tolerate=False)
        self._manager.close()

    def __enter__(self):
        return self

    def __exit__(self, kind, error, traceback):
        """Closes; when the run stops on an error, the save in flight still ends first (its own
        failure is dropped: the error raised is the run's), so that no background save thread
        outlives the run and holds its process open at exit."""
        if kind is None:
            self.close()
            return
        try:
            self.close()
        except Exception as e:  # noqa: BLE001
            logging.warning("checkpoint %s: %s", self.directory, errors.one_line(e) or repr(e))
