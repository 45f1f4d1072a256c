"""GCS misbehaving: transient failures are ridden out, permanent ones stop the run in one line,
and nothing is lost (jaxprefix/storage/faults.py).

Runs go through tests/gcs_fault_proxy.py, a proxy on 127.0.0.1 in front of the emulator that
answers 429 / 500 / 503 itself, drops connections before or after relaying, answers late, or
refuses every write with 403 (a revoked permission).
"""
import os
import re
import subprocess
import sys
import time

import pytest

from jaxprefix import storage
from jaxprefix.storage import workdir_lock
from jaxprefix.rl.metrics import read_metrics
from tests.gcs_fault_proxy import FaultProxy
from tests.test_gcs_run import command, compared, finish, run_inputs, start

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 8  # room to revoke the permission after the first checkpoint and before the end


def run_command(root: str, workdir: str) -> list[str]:
    return command(root, workdir) + [f"--config.train.total_steps={STEPS}"]


def test_failures_are_told_apart_for_every_client():
    import aiohttp
    from gcsfs.retry import HttpError
    from google.api_core import exceptions as api

    def kind(error):
        failure = storage.faults.classify(error)
        return None if failure is None else ("transient" if failure.transient else "permanent")

    assert kind(HttpError({"code": 503, "message": "backend error"})) == "transient"
    assert kind(HttpError({"code": 429, "message": "rate"})) == "transient"
    assert kind(HttpError({"code": 400, "message": "bad"})) == "permanent"
    assert kind(OSError("Forbidden: http://x/o?name=a\nno access")) == "permanent"  # gcsfs 403
    assert kind(aiohttp.ServerDisconnectedError()) == "transient"
    assert kind(ConnectionResetError(104, "reset")) == "transient"
    assert kind(api.ServiceUnavailable("down")) == "transient"
    assert kind(api.Forbidden("no")) == "permanent"
    assert kind(api.NotFound("no such object")) is None  # an answer, not a failure
    assert kind(api.NotFound("The specified bucket does not exist.")) == "permanent"
    assert kind(api.PreconditionFailed("generation")) is None  # the lock's answer
    assert kind(FileNotFoundError("gs://b/x")) is None
    # tensorstore (orbax's arrays): its status word and the HTTP code it quotes
    denied = ValueError("PERMISSION_DENIED: Error writing gs://b/run/checkpoints/1/arrays/x: "
                        "no access [http_response_code='403'] [http_response_body='{}']")
    failure = storage.faults.classify(denied)
    assert not failure.transient and failure.path == "gs://b/run/checkpoints/1/arrays/x"
    assert kind(ValueError("UNAVAILABLE: Error reading gs://b/x: timed out")) == "transient"
    # a damaged checkpoint is recovery's business (moved aside), not a storage failure
    assert kind(ValueError("NOT_FOUND: Error reading local file /w/checkpoints/3/x")) is None
    assert kind(ValueError("DATA_LOSS: Error reading gs://b/x: checksum mismatch")) is None
    try:
        try:
            raise denied
        except ValueError as e:
            raise RuntimeError("orbax: save failed") from e
    except RuntimeError as wrapped:
        assert kind(wrapped) == "permanent"  # found down the chain
    error = storage.faults.StorageError("writing", "gs://b/m.jsonl", failure)
    assert str(error).startswith("writing gs://b/run/checkpoints/1/arrays/x failed: permission "
                                 "denied (HTTP 403)") and "\n" not in str(error)


def test_a_lock_write_whose_answer_was_lost_is_still_ours(gcs, monkeypatch):
    # The lock object is created, then the connection drops before the answer: the client
    # retries, GCS answers 412 (it exists), and the lock must see its own token there.
    with FaultProxy(gcs.url, drop_after_rate=1.0, max_faults=1, only="ifGenerationMatch=0") as proxy:
        for name, value in proxy.env.items():
            monkeypatch.setenv(name, value)
        lock = workdir_lock._GcsLock(f"gs://bucket/lost-answer-{os.getpid()}", 60)
        lock.acquire(stale_minutes=10)
        lock.release()
        assert proxy.counts["drop_after"] == 1


# ---- whole runs through the proxy -------------------------------------------------------------

def _start_via(proxy, args, local):
    """tests/test_gcs_run.start, with every client pointed at the proxy."""
    saved = {k: os.environ.get(k) for k in proxy.env}
    os.environ.update(proxy.env)
    try:
        return start(args, local)
    finally:
        for k, v in saved.items():
            os.environ[k] = v


@pytest.fixture(scope="module")
def faulted(gcs, tmp_path_factory):
    """gs:// inputs, local folders, and `reference()`: the metrics of one clean run, which runs
    beside the faulted ones (they wait on GCS more than they compute)."""
    root, local = run_inputs(f"gs://bucket/faults-{os.getpid()}", tmp_path_factory)
    clean = start(run_command(root, f"{root}/clean"), local)
    rows = []

    def reference():
        if not rows:
            finish(clean, timeout=900)
            rows.extend(read_metrics(f"{root}/clean"))
            assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
        return rows

    yield root, local, reference
    if clean.poll() is None:
        clean.kill()
        clean.wait()


@pytest.mark.slow
def test_a_write_outlasting_gcsfs_retries_is_retried_until_the_deadline(gcs, tmp_path):
    # gcsfs gives up after 6 tries (~30 s); 8 failing answers in a row outlast it, and only the
    # run's own retries (storage.retry_deadline_s) carry the write through.
    script = ("import sys, time; from jaxprefix import storage\n"
              "storage.faults.set_deadline(float(sys.argv[1])); start = time.monotonic()\n"
              "try:\n    storage.write_atomic(sys.argv[2], 'x'); print('ok')\n"
              "except storage.faults.StorageUnavailable as e:\n    print('error:', e)\n"
              "print(round(time.monotonic() - start))\n")
    outcomes = []
    for deadline in (120, 0):
        with FaultProxy(gcs.url, error_rate=1.0, max_faults=8) as proxy:
            env = dict(os.environ, PYTHONPATH=ROOT, **proxy.env)
            path = f"gs://bucket/deadline-{deadline}-{os.getpid()}.txt"
            out = subprocess.run([sys.executable, "-c", script, str(deadline), path], env=env,
                                 capture_output=True, text=True, timeout=300)
            assert out.returncode == 0, out.stderr[-3000:]
            outcomes.append((out.stdout.splitlines(), proxy.counts["error"]))
    (ok, seconds), faults = outcomes[0]
    assert ok == "ok" and faults == 8
    (error, _), _ = outcomes[1]
    assert error.startswith(f"error: writing gs://bucket/deadline-0-{os.getpid()}.txt failed: ")
    assert "config.storage.retry_deadline_s=0" in error


@pytest.mark.slow
def test_a_smoke_run_through_injected_faults_equals_the_clean_run(faulted, gcs):
    root, local, reference = faulted
    with FaultProxy(gcs.url, seed=7, error_rate=0.05, drop_rate=0.02,
                    drop_after_rate=0.02, slow_rate=0.01, slow_s=1.0, max_faults=400) as proxy:
        finish(_start_via(proxy, run_command(root, f"{root}/faulted"), local), timeout=900)
    print(f"faults injected: {proxy.counts}")
    assert proxy.counts["error"] >= 10 and proxy.counts["drop"] + proxy.counts["drop_after"] >= 5
    assert compared(read_metrics(f"{root}/faulted")) == compared(reference())


@pytest.mark.slow
def test_a_revoked_write_permission_stops_in_one_line_and_the_resume_equals_the_clean_run(
        faulted, gcs):
    root, local, reference = faulted
    workdir = f"{root}/revoked"
    args = run_command(root, workdir)
    with FaultProxy(gcs.url) as proxy:
        run = _start_via(proxy, args, local)
        deadline = time.time() + 600
        # Once 3 rows are logged checkpoint 1 is complete (saving 2 waited for it).
        while not (storage.exists(f"{workdir}/metrics.jsonl")
                   and len(read_metrics(workdir)) >= 3):
            assert run.poll() is None and time.time() < deadline, run.communicate()[1][-3000:]
            time.sleep(0.2)
        proxy.deny_writes = True
        _, stderr = run.communicate(timeout=300)
    lines = stderr.strip().splitlines()
    assert run.returncode == 1, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-5000:]
    errors = [line for line in lines if line.startswith("error:")]
    assert errors == [lines[-1]], lines[-10:]
    # Whichever write met the 403 first (metrics.jsonl, a checkpoint, the lock), it is named.
    assert re.match(rf"error: (writing|saving checkpoint \d+ to) {workdir}/\S+ failed: permission "
                    rf"denied \(HTTP 403\)", errors[0]), errors[0]
    assert "rerun the same command" in errors[0]
    stopped_at = len(read_metrics(workdir))  # what the run had logged stays readable
    assert 3 <= stopped_at < STEPS
    assert compared(read_metrics(workdir)) == compared(reference()[:stopped_at])

    finish(start(args, local))  # the permission back: the same command, straight to the emulator
    assert compared(read_metrics(workdir)) == compared(reference())
