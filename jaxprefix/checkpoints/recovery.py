"""Resuming from the newest checkpoint that restores, so a corrupt one cannot block a run forever.

A checkpoint can be damaged after orbax committed it (a truncated array file, a disk error, a
copy cut short). Restoring it raises deep inside tensorstore, on every rerun: under a
preemption-restart loop that is a crash loop, while an intact earlier step sits next to it. So
`restore_newest` tries the steps from the newest down; one that fails is reported with its step,
path and reason, and moved aside (never deleted) to `<checkpoints>.unrestorable/`, out of
orbax's way; the run resumes from the step before and redoes the rest (a run is a function of
config and seed, so it ends as if nothing happened). Only when no step restores does the run
stop, with one message.

A checkpoint of another model (other shapes) is not corrupt: that is refused before restoring,
naming the array and both shapes, and nothing is moved. Nor is one that GCS will not serve
(permission denied, down past config.storage.retry_deadline_s): the run stops in one line and
the checkpoint stays.
"""
from __future__ import annotations

import datetime
import sys

import jax
from absl import logging
from etils import epath

from jaxprefix import distributed, storage
from jaxprefix.errors import CheckpointError
from jaxprefix.storage.faults import StorageError, StorageUnavailable

ASIDE_SUFFIX = ".unrestorable"


def restore_newest(ckpt, like, *, move_aside: bool = True):
    """(step, arrays, meta) of the newest checkpoint of `ckpt` that restores onto `like`, or
    None when there is no checkpoint. With `move_aside=False` (readers such as the eval job,
    which must not rearrange a workdir a run may own) failing steps are only skipped."""
    _quiet_orphaned_callbacks()
    failed = []
    for step in sorted(ckpt.all_steps(), reverse=True):
        path = storage.join(ckpt.directory, str(step))
        check_fits(path, like)
        try:
            arrays, meta = ckpt.restore(like, step)
        except (StorageError, StorageUnavailable):
            raise  # GCS refusing or down: the checkpoint may be fine, so it stays where it is
        except Exception as e:  # noqa: BLE001  (tensorstore, orbax and JSON errors alike)
            reason = _first_line(e)
            where = _move_aside(ckpt, step) if move_aside else None
            logging.error("checkpoint step %d at %s does not restore (%s)%s; trying the one "
                          "before", step, path, reason, f"; moved aside to {where}" if where else "")
            failed.append(f"step {step} ({reason})")
            continue
        if failed:
            logging.warning("resuming from step %d instead of %s", step, failed[0].split(" (")[0])
        return step, arrays, meta
    if failed:
        aside = ckpt.directory.rstrip("/") + ASIDE_SUFFIX
        raise CheckpointError(
            f"no checkpoint under {ckpt.directory} restores: {'; '.join(failed)}"
            + (f"; they are moved aside to {aside}" if move_aside else "")
            + "; expected at least one intact checkpoint: rerun to start again from step 0, or "
              "put a good checkpoint back by hand")
    return None


def check_fits(step_dir: str, like) -> None:
    """Raises CheckpointError when the arrays saved in `step_dir` have other names or shapes
    than `like` (the run's model changed). A checkpoint whose metadata cannot be read passes,
    and fails its restore instead."""
    import orbax.checkpoint as ocp

    try:
        saved = ocp.StandardCheckpointHandler().metadata(epath.Path(step_dir) / "arrays").tree
    except Exception:  # noqa: BLE001  (unreadable: the restore reports it)
        return
    saved_shapes = {name: tuple(x.shape) for name, x in _named_leaves(saved)}
    wanted = {name: tuple(x.shape) for name, x in _named_leaves(like)}
    for name, shape in wanted.items():
        if name in saved_shapes and saved_shapes[name] != shape:
            raise CheckpointError(
                f"{step_dir}: array {name} was saved with shape {saved_shapes[name]}, this run's "
                f"model has {shape}: the checkpoint is of another model; expected the model the "
                f"workdir was trained with (see its run.json), or another --workdir")
    missing = sorted(wanted.keys() - saved_shapes.keys())
    if missing:
        raise CheckpointError(
            f"{step_dir}: no array {missing[0]} (and {len(missing) - 1} more) of this run's state "
            f"in the checkpoint: it is of another model or optimizer; expected the setup the "
            f"workdir was trained with (see its run.json), or another --workdir")


def _named_leaves(tree):
    """('params/layers/q/value', leaf) pairs; dict keys, attributes and indices alike."""
    def token(entry):
        for attr in ("key", "name", "idx"):
            if hasattr(entry, attr):
                return str(getattr(entry, attr))
        return str(entry)
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return [("/".join(token(e) for e in path), leaf) for path, leaf in flat]


def _quiet_orphaned_callbacks() -> None:
    """A failed orbax restore leaves tensorstore futures whose callbacks reach that restore's
    closed asyncio loop, each printing a harmless 'RuntimeError: Event loop is closed' traceback
    (dozens, around the one error that matters). Those exact ones are dropped."""
    previous = sys.unraisablehook
    if getattr(previous, "drops_orphaned_callbacks", False):
        return

    def hook(unraisable):
        error = unraisable.exc_value
        if not (isinstance(error, RuntimeError) and str(error) == "Event loop is closed"):
            previous(unraisable)

    hook.drops_orphaned_callbacks = True
    sys.unraisablehook = hook


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    line = text[0] if text else type(error).__name__
    line = line.split(" See full TensorStore details")[0]  # a spec dump, no help to a reader
    return f"{type(error).__name__}: {line[:300]}{'...' if len(line) > 300 else ''}"


def _move_aside(ckpt, step: int) -> str | None:
    """Moves step `step` out of the checkpoint directory; returns where it went (process 0)."""
    source = storage.join(ckpt.directory, str(step))
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    target = storage.join(ckpt.directory.rstrip("/") + ASIDE_SUFFIX, f"{step}-{stamp}")
    if distributed.is_primary():
        _move_tree(source, target)
    if jax.process_count() > 1:  # every process must see the step gone before the next try
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(f"checkpoint {step} moved aside")
    ckpt.reload()
    return target


def _move_tree(source: str, target: str) -> None:
    if not storage.is_remote(source):
        storage.makedirs(storage.dirname(target))
        storage.rename(source, target)
        return
    for name in storage.listdir(source):  # GCS has no folders: move every object
        child = storage.join(source, name)
        if storage.isdir(child):
            _move_tree(child, storage.join(target, name))
        else:
            storage.rename(child, storage.join(target, name))
