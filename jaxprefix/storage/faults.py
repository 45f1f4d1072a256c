"""What a failed storage call means, and what a run does about it: retry it, or stop in one line.

A failure is transient (HTTP 408, 429, 5xx, a dropped or refused connection, an answer that did
not come in time) or permanent (403 permission denied or quota, 401, 400, a missing bucket);
`classify` tells them apart for every client a run uses, from the error or anything it was
raised from. Each client retries transient failures itself, under its own policy:
- gcsfs, behind etils.epath (our reads and writes, orbax's metadata and commit files): 6 tries,
  1 to 32 s apart (about 30 s), fixed by gcsfs.retry.retry_request when gcsfs is imported.
- google-cloud-storage (the gs:// workdir lock): the Retry object passed with each call;
  `gcs_retry()` makes it retry until the run's deadline.
- tensorstore (orbax's checkpoint arrays): its `gcs_request_retries` context resource, 32 tries
  1 to 32 s apart (about 15 minutes); orbax builds that context itself
  (tensorstore_utils.get_ts_context) and offers no hook, so tensorstore's own policy holds.
On top of gcsfs, `retrying` repeats a whole call of storage.py (every read, write and listing of
a run) with backoff (1 s, doubling to 32 s) while it fails transiently, until `deadline_s`
(config.storage.retry_deadline_s, set by main) has passed since its first try. A failed
checkpoint save is survived the same way, up to the same deadline (checkpoints/train_state.py).

What cannot be retried ends the run with one line (main prints it): `StorageError` (permanent;
exit 1) or `StorageUnavailable` (transient past the deadline; exit 75, EX_TEMPFAIL, so that a
supervisor such as `launch/tpu.sh watch` relaunches). Each names the operation and the gs://
path. Nothing is lost: files are replaced whole or not at all (storage.write_atomic), a
checkpoint counts only once complete, and the same command resumes from the last complete one.
"""
from __future__ import annotations

import contextlib
import dataclasses
import re
import time

from absl import logging

from jaxprefix.errors import UserError

DEFAULT_DEADLINE_S = 600.0  # a GCS outage shorter than this is ridden out, not reported
FIRST_DELAY_S, MAX_DELAY_S = 1.0, 32.0
_deadline_s = DEFAULT_DEADLINE_S

_TRANSIENT_HTTP = {408, 429} | set(range(500, 600))
# tensorstore's status codes (absl::Status, the first word of its errors) that say the service,
# not the data: others (NOT_FOUND, DATA_LOSS, FAILED_PRECONDITION) mean a damaged or foreign
# checkpoint, which checkpoints/recovery.py handles.
_TRANSIENT_STATUS = ("UNAVAILABLE", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED")
_PERMANENT_STATUS = ("PERMISSION_DENIED", "UNAUTHENTICATED")
_EXPECTED = ("expected the run's credentials to be allowed to do it (check the bucket and its "
             "permissions), then rerun the same command: it resumes from the last complete "
             "checkpoint")


@dataclasses.dataclass(frozen=True)
class Failure:
    transient: bool
    reason: str          # 'permission denied (HTTP 403): ...', 'HTTP 503', 'connection dropped'
    path: str = ""       # the gs:// object the error names, when it names one


class StorageError(UserError):
    """A storage call failed for good (permission, quota, a missing bucket): one line."""

    def __init__(self, operation: str, path: str, failure: Failure):
        super().__init__(f"{operation} {failure.path or path} failed: {failure.reason}; "
                         f"{_EXPECTED}")


class StorageUnavailable(UserError):
    """GCS kept failing transiently past the deadline: one line; the same command resumes."""
    exit_status = 75  # EX_TEMPFAIL: try again later

    def __init__(self, operation: str, path: str, failure: Failure, waited_s: float):
        super().__init__(
            f"{operation} {failure.path or path} failed: {failure.reason}, retried for "
            f"{waited_s:.0f} s (config.storage.retry_deadline_s={_deadline_s:g}); expected GCS "
            f"to answer within that: rerun the same command once it does, it resumes from the "
            f"last complete checkpoint")


def set_deadline(seconds: float) -> None:
    """How long a transient failure is retried (config.storage.retry_deadline_s; 0: no retries
    of ours, the clients' own only)."""
    global _deadline_s
    if not float(seconds) >= 0:
        raise ValueError(f"config.storage.retry_deadline_s={seconds!r}: expected >= 0 seconds")
    _deadline_s = float(seconds)


def deadline_s() -> float:
    return _deadline_s


def gcs_retry():
    """google-cloud-storage's Retry, retrying transient failures until the run's deadline."""
    from google.cloud.storage.retry import DEFAULT_RETRY

    return DEFAULT_RETRY.with_timeout(max(_deadline_s, 1.0))


def _is(error: BaseException, module: str, *names: str) -> bool:
    """`error` is an instance of a class called one of `names` from package `module` (checked
    by name: the client packages need not be installed)."""
    return any(c.__module__.startswith(module) and c.__name__ in names for c in type(error).__mro__)


def _first_line(text: str, limit: int = 300) -> str:
    line = next((l.strip() for l in str(text).splitlines() if l.strip()), "").rstrip(".")
    return line if len(line) <= limit else line[:limit] + "..."


def _http(code: int, message: str) -> Failure | None:
    if code == 412 or (code == 404 and "bucket" not in message.lower()):
        return None  # answers for the caller: a precondition not met, a missing object
    label = {401: "not authenticated", 403: "permission denied", 404: "not found",
             429: "too many requests"}.get(code, "")
    reason = f"{label} (HTTP {code})" if label else f"HTTP {code}"
    message = _first_line(message)
    return Failure(code in _TRANSIENT_HTTP, f"{reason}: {message}" if message else reason)


def _classify_one(error: BaseException) -> Failure | None:
    text = str(error)
    if _is(error, "gcsfs", "HttpError") and getattr(error, "code", None):
        return _http(int(error.code), getattr(error, "message", text))
    if _is(error, "google.api_core", "GoogleAPICallError") and getattr(error, "code", None):
        return _http(int(error.code), getattr(error, "message", text))
    if isinstance(error, OSError) and text.startswith("Forbidden: "):  # gcsfs's 403
        url, _, message = text[len("Forbidden: "):].partition("\n")
        return Failure(False, f"permission denied (HTTP 403): {_first_line(message)}")
    status = re.match(r"([A-Z_]+): ", text)
    if status and ("gs://" in text or "http_response_code" in text):  # tensorstore, via orbax
        code = re.search(r"http_response_code='(\d+)'", text)
        path = re.search(r"gs://[^\s:'\"]+", text)
        message = re.sub(r" \[(http_response_body|tensorstore_spec)=.*", "", text)
        if code:
            failure = _http(int(code.group(1)), message.split(": ", 1)[1])
        elif status.group(1) in _TRANSIENT_STATUS + _PERMANENT_STATUS:
            failure = Failure(status.group(1) in _TRANSIENT_STATUS, _first_line(message))
        else:
            failure = None
        return failure and dataclasses.replace(failure, path=path.group(0) if path else "")
    if (_is(error, "requests", "ConnectionError", "Timeout", "ChunkedEncodingError")
            or _is(error, "aiohttp", "ClientError") or _is(error, "google.auth", "RefreshError")
            or isinstance(error, (ConnectionError, TimeoutError))):
        return Failure(True, f"{type(error).__name__}: {_first_line(text) or 'connection dropped'}")
    return None


def classify(error: BaseException) -> Failure | None:
    """The storage failure `error` is (or was raised from), or None if it is not one."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        failure = _classify_one(error)
        if failure is not None:
            return failure
        error = error.__cause__ or error.__context__
    return None


def retrying(operation: str, path: str, call, *, writes: bool = False):
    """`call()`, repeated with backoff while it fails transiently, until the deadline.

    operation: what it does, for the message ('writing', 'listing'); path: the gs:// path.
    writes: a missing file here means a missing bucket (a permanent failure), not an answer."""
    start, delay = time.monotonic(), FIRST_DELAY_S
    while True:
        try:
            return call()
        except Exception as e:  # noqa: BLE001  (classified; anything else is re-raised)
            failure = classify(e)
            if failure is None and writes and isinstance(e, FileNotFoundError):
                failure = Failure(False, "not found (HTTP 404): does the bucket exist?")
            if failure is None:
                raise
            if not failure.transient:
                raise StorageError(operation, path, failure) from e
            waited = time.monotonic() - start
            if waited + delay > _deadline_s:
                raise StorageUnavailable(operation, path, failure, waited) from e
            logging.warning("%s %s: %s; retrying in %.0f s", operation, path, failure.reason, delay)
            time.sleep(delay)
            delay = min(2 * delay, MAX_DELAY_S)


@contextlib.contextmanager
def reported(operation: str, path: str, *, started: float | None = None):
    """Turns a storage failure raised in the block (by a client past its own retries) into
    StorageError or StorageUnavailable naming `operation` and `path`; other errors pass."""
    try:
        yield
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001
        failure = classify(e)
        if failure is None:
            raise
        if not failure.transient:
            raise StorageError(operation, path, failure) from e
        waited = time.monotonic() - (started if started is not None else time.monotonic())
        raise StorageUnavailable(operation, path, failure, waited) from e
