"""Every file a run reads or writes, local or on gs://, goes through these functions
(`from jaxprefix import storage`; storage/__init__.py exports them).

Paths are plain strings. A local path ('runs/x', '/tmp/x') behaves as with os and open; a remote
one ('gs://bucket/run') goes through etils.epath, which orbax uses too, backed by gcsfs. Nothing
else in jaxprefix calls open, os.path or pathlib on a path that may be remote.

What differs on GCS, and how this module hides it:
- No directories: `makedirs` is a no-op there (an object's name creates its "folder").
- No append and no rename: `write_atomic` (and `open_atomic`, for a file written in pieces)
  writes a whole object in one upload, which GCS makes visible all at once or not at all; locally
  it writes a temporary file and renames it, so a reader never sees half a file, a killed writer
  leaves the old one, and a process that maps the old file (safetensors) keeps it intact while
  another replaces it. Files that grow (metrics) are rewritten whole, in bounded segments
  (rl/metrics.py). `rename` on GCS is a server-side copy then a delete (not atomic);
  `create_exclusive` (write only if absent) is atomic on both, for lock files.
- No memory map: `local_copy` downloads a remote file once into the cache directory
  (`$JAXPREFIX_CACHE`, default ~/.cache/jaxprefix), keyed by path, size and modification time,
  for readers that need a real file (GGUF, safetensors). Local paths are returned unchanged.
- A missing client library or bucket: `require_backend` fails with one line naming the path and
  what to install, before any work starts.
- Transient failures (429, 5xx, dropped connections, slow answers): every remote call here is
  retried with backoff until config.storage.retry_deadline_s; a permanent one (403, a missing
  bucket) or the deadline passed is one line naming the operation and the path
  (storage/faults.py, which also says where each client's own retries are set).

Orbax writes checkpoint arrays with tensorstore's own GCS client; it takes the same gs:// paths.
"""
from __future__ import annotations

import builtins
import contextlib
import hashlib
import io
import json
import os
import shutil
import uuid

from etils import epath

from jaxprefix.storage.faults import retrying

CACHE_ENV = "JAXPREFIX_CACHE"
# scheme -> the package epath needs for it (through fsspec)
BACKENDS = {"gs": "gcsfs"}


def is_remote(path) -> bool:
    """True for a URL path ('gs://bucket/x'), False for a local one."""
    return "://" in str(path)


# The bucket names the configs and docs print for "your bucket": a path in one is a
# placeholder, refused in one line by a job that must read it (run_setup/preflight.py), never tried.
PLACEHOLDER_BUCKETS = ("YOUR_BUCKET", "MY_BUCKET", "BUCKET")


def is_placeholder(path) -> bool:
    """True for 'gs://YOUR_BUCKET/...' and the like: a path still to be filled in."""
    return is_remote(path) and str(path).split("://", 1)[1].split("/", 1)[0] in \
        PLACEHOLDER_BUCKETS


def _scheme(path) -> str:
    return str(path).split("://", 1)[0]


def join(path, *parts: str) -> str:
    """os.path.join for local paths; '/'-joined for remote ones."""
    path = str(path)
    if not is_remote(path):
        return os.path.join(path, *parts)
    for part in parts:
        path = path.rstrip("/") + "/" + part.lstrip("/")
    return path


def dirname(path) -> str:
    """The folder of `path` ('gs://b/run' for 'gs://b/run/x.json')."""
    path = str(path).rstrip("/")
    if not is_remote(path):
        return os.path.dirname(path)
    head, _, _ = path.rpartition("/")
    return head if "://" in head and not head.endswith(":/") else path


def basename(path) -> str:
    return str(path).rstrip("/").rpartition("/")[2] if is_remote(path) else os.path.basename(path)


def _epath(path) -> epath.Path:
    return epath.Path(str(path))


def _remote(operation: str, path, call, *, writes: bool = False):
    """`call()` on remote `path`, retried while GCS fails transiently (faults.py)."""
    return retrying(operation, str(path), call, writes=writes)


# --- questions -------------------------------------------------------------------------------

def exists(path) -> bool:
    if not is_remote(path):
        return os.path.exists(path)
    return _remote("checking", path, lambda: _epath(path).exists())


def isdir(path) -> bool:
    """A local directory, or a remote prefix with at least one object under it."""
    if not is_remote(path):
        return os.path.isdir(path)
    return _remote("checking", path, lambda: _epath(path).is_dir())


def isfile(path) -> bool:
    if not is_remote(path):
        return os.path.isfile(path)
    return _remote("checking", path, lambda: _epath(path).is_file())


def listdir(path) -> list[str]:
    """Sorted names (not paths) directly under `path`."""
    if not is_remote(path):
        return sorted(os.listdir(path))
    return _remote("listing", path, lambda: sorted(p.name for p in _epath(path).iterdir()))


def glob(directory, pattern: str) -> list[str]:
    """Sorted paths under `directory` whose names match `pattern` ('*.safetensors')."""
    if not is_remote(directory):
        return sorted(str(p) for p in epath.Path(directory).glob(pattern))
    return _remote("listing", directory,
                   lambda: sorted(str(p) for p in _epath(directory).glob(pattern)))


def size(path) -> int:
    if not is_remote(path):
        return os.path.getsize(path)
    return _remote("checking", path, lambda: _epath(path).stat().length)


def modified_ns(path) -> int:
    """The file's last modification time, in nanoseconds."""
    if not is_remote(path):
        return os.stat(path).st_mtime_ns
    return _remote("checking", path, lambda: int(_epath(path).stat().mtime * 1e9))


# --- reading and writing ---------------------------------------------------------------------

def open(path, mode: str = "r"):  # noqa: A001  (the builtin's name, on purpose)
    """A file object for `path`. A remote file opened for writing becomes visible as a whole
    when it is closed; prefer `write_atomic` for a local file that others read back. (Opening is
    retried; the reads and the upload after it ride on gcsfs's own retries.)"""
    if not is_remote(path):
        if any(m in mode for m in "wax"):
            makedirs(dirname(path) or ".")
        return builtins.open(path, mode, **({} if "b" in mode else {"encoding": "utf-8"}))
    return _remote("opening", path, lambda: _epath(path).open(mode))


def read_bytes(path) -> bytes:
    if is_remote(path):
        return _remote("reading", path, lambda: _epath(path).read_bytes())
    with open(path, "rb") as f:
        return f.read()


def read_text(path) -> str:
    return read_bytes(path).decode("utf-8")


def read_json(path):
    """The JSON value of `path`; invalid JSON is an error naming the file."""
    try:
        return json.loads(read_text(path))
    except ValueError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None


@contextlib.contextmanager
def open_atomic(path):
    """A binary file object whose content replaces `path` as a whole when the block ends
    without an error: readers (a memory map of the old file included) see the old or the new
    content, never part. Local: a temporary file in the same folder, fsynced, then renamed over
    `path` (an error removes it). Remote: one object upload, which GCS publishes only once it
    completes."""
    if is_remote(path):
        with open(path, "wb") as f:
            yield f
        return
    makedirs(dirname(path) or ".")
    tmp = f"{path}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        with builtins.open(tmp, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def remove_orphaned_temporaries(folder: str, pid: int) -> list[str]:
    """Removes the temporary files `open_atomic` of process `pid` (dead, on this host) left under
    a local `folder`: a SIGKILL between its write and its rename leaves one, which no later
    write of the same path replaces (each writer names its own). Returns their paths."""
    marker = f".tmp-{int(pid)}-"
    removed = []
    for parent, _, names in os.walk(folder):
        for name in names:
            if marker in name:
                os.remove(os.path.join(parent, name))
                removed.append(os.path.join(parent, name))
    return removed


def write_atomic(path, data: bytes | str) -> None:
    """Replaces `path` with `data` so that readers see the old or the new content, never part
    (`open_atomic`)."""
    data = data.encode("utf-8") if isinstance(data, str) else bytes(data)
    if is_remote(path):
        _remote("writing", path, lambda: _epath(path).write_bytes(data), writes=True)
        return
    with open_atomic(path) as f:
        f.write(data)


def create_exclusive(path, data: bytes | str) -> bool:
    """Writes `path` only if it does not exist yet; False (nothing written) if it does. Atomic
    against a concurrent creator: O_EXCL locally, a generation-0 precondition on GCS (one of two
    machines racing wins) — the building block of a lock file."""
    data = data.encode("utf-8") if isinstance(data, str) else bytes(data)
    try:
        if is_remote(path):
            import fsspec  # epath has no exclusive mode; fsspec's pipe_file has (gcsfs sends
            # ifGenerationMatch=0 with the upload and raises FileExistsError on 412)

            filesystem, _ = fsspec.core.url_to_fs(str(path))
            filesystem.pipe_file(str(path), data, mode="create")
        else:
            makedirs(dirname(path) or ".")
            with builtins.open(path, "xb") as f:
                f.write(data)
    except FileExistsError:
        return False
    return True


def write_json(path, value, indent: int | None = 1, **dumps_options) -> None:
    """`value` as JSON (json.dumps options such as default=), written with `write_atomic`."""
    write_atomic(path, json.dumps(value, indent=indent, **dumps_options))


def write_figure(path, figure, **savefig_options) -> None:
    """A matplotlib figure as a PNG file, written with `write_atomic`."""
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", **savefig_options)
    write_atomic(path, buffer.getvalue())


def makedirs(path) -> None:
    """Creates a local folder and its parents; nothing to do on GCS, which has no folders."""
    if not is_remote(path):
        os.makedirs(path, exist_ok=True)


def remove(path) -> None:
    """Deletes one file (an error if it does not exist)."""
    if not is_remote(path):
        os.remove(path)
        return
    tries = []

    def unlink():  # gone at a retry: an earlier try deleted it and its answer was lost
        tries.append(path)
        try:
            _epath(path).unlink()
        except FileNotFoundError:
            if len(tries) == 1:
                raise
    _remote("deleting", path, unlink)


def rmtree(path) -> None:
    """Deletes a folder and everything under it; nothing if it does not exist."""
    if not is_remote(path):
        shutil.rmtree(path, ignore_errors=True)
    elif exists(path):
        _remote("deleting", path, lambda: _epath(path).rmtree())


def rename(src, dst) -> None:
    """Moves a file, replacing `dst`. Atomic locally; on GCS a server-side copy then a delete."""
    if is_remote(src) != is_remote(dst):
        raise ValueError(f"rename {src} -> {dst}: both paths must be local or both remote")
    if not is_remote(src):
        os.replace(src, dst)
        return
    _remote("copying", src, lambda: _epath(src).copy(_epath(dst), overwrite=True))
    remove(src)


# --- remote files as local ones --------------------------------------------------------------

def cache_dir() -> str:
    """The one local folder where remote files are copied (`$JAXPREFIX_CACHE`)."""
    return os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "jaxprefix")


def local_copy(path) -> str:
    """A local file with the content of `path`: `path` itself when local, else a copy in the
    cache directory, downloaded once per (path, size, modification time)."""
    if not is_remote(path):
        return str(path)
    info = _remote("checking", path, lambda: _epath(path).stat())
    key = hashlib.sha256(f"{path}|{info.length}|{info.mtime}".encode()).hexdigest()[:20]
    target = os.path.join(cache_dir(), "remote", key, basename(path))
    if os.path.isfile(target) and os.path.getsize(target) == info.length:
        return target
    os.makedirs(os.path.dirname(target), exist_ok=True)
    tmp = f"{target}.tmp-{os.getpid()}"

    def download():
        with _epath(path).open("rb") as fin, builtins.open(tmp, "wb") as fout:
            shutil.copyfileobj(fin, fout, length=64 << 20)
    _remote("downloading", path, download)
    os.replace(tmp, target)
    return target


# --- checks before a run ---------------------------------------------------------------------

def require_backend(path) -> None:
    """Raises a one-line error unless `path` can be used here: for a remote path, its client
    package is installed and its bucket exists. Local paths always pass."""
    if not path or not is_remote(path):
        return
    scheme = _scheme(path)
    package = BACKENDS.get(scheme)
    if package is None:
        raise ValueError(f"{path}: unsupported storage scheme {scheme}://; expected a local path "
                         f"or one of {', '.join(s + '://' for s in BACKENDS)}")
    try:
        __import__(package)
    except ImportError:
        raise ValueError(f"{path}: {scheme}:// paths need the {package} package, which is not "
                         f"installed: pip install {package} (or pip install 'jaxprefix[tpu]')"
                         ) from None
    bucket = str(path).split("://", 1)[1].split("/", 1)[0]
    if not bucket or not _remote("checking", f"{scheme}://{bucket}",
                                 lambda: _epath(f"{scheme}://{bucket}").exists()):
        raise ValueError(f"{path}: bucket {scheme}://{bucket} does not exist or cannot be read "
                         f"with this machine's credentials")
