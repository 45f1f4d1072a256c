"""Training checkpoints with orbax: arrays (params, optimizer, step, RNG) + JSON (data, method).

One `TrainCheckpointer` per workdir. Arrays are restored onto the shardings of a live template
(the freshly initialised state), so a restart on the same mesh resumes without a host copy of
the model. The JSON part holds whatever Python state the run needs to continue the same
trajectory: the data iterator position, a method's trace pools and schedules.
"""
from __future__ import annotations

import os

import jax
import orbax.checkpoint as ocp

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
        self._manager = ocp.CheckpointManager(self.directory, options=options,
                                              item_names=("arrays", "meta"))

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def save(self, step: int, arrays, meta: dict | None = None) -> bool:
        """Write checkpoint `step`; returns False when it already exists. Raises DiskFull, before
        writing anything, when the local disk cannot take the arrays' bytes."""
        if step in self._manager.all_steps():
            return False
        errors.check_free_space(self.directory, sum(x.nbytes for x in jax.tree.leaves(arrays)))
        args = ocp.args.Composite(arrays=ocp.args.StandardSave(arrays),
                                  meta=ocp.args.JsonSave(dict(meta or {})))
        return self._manager.save(step, args=args, force=True)

    def restore(self, like, step: int | None = None):
        """(arrays shaped, typed and sharded like `like`, meta dict) of `step` (default latest)."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint under {self.directory}")
        args = ocp.args.Composite(arrays=ocp.args.StandardRestore(abstract_like(like)),
                                  meta=ocp.args.JsonRestore())
        restored = self._manager.restore(step, args=args)
        return restored["arrays"], dict(restored["meta"] or {})

    def wait(self):
        self._manager.wait_until_finished()

    def reload(self):
        """Forget what orbax knew of the directory (a step was moved out of it)."""
        self._manager.reload()

    def close(self):
        self._manager.wait_until_finished()
        self._manager.close()
