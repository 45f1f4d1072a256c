"""An HTTP proxy on 127.0.0.1 in front of the GCS emulator that misbehaves on purpose.

    with GcsEmulator() as gcs, FaultProxy(gcs.url, seed=0, error_rate=0.05) as proxy:
        subprocess.run([...], env=dict(os.environ, **proxy.env))   # the run talks to the proxy
        proxy.deny_writes = True                                  # the bucket turns read-only

Every client of a run (gcsfs, google-cloud-storage, tensorstore) is pointed at the proxy by
`proxy.env`, and the proxy relays each request to the emulator, except that, drawn from a seeded
generator per request, it may answer 429 / 500 / 503 itself (`error_rate`), close the connection
without an answer before relaying (`drop_rate`) or after the emulator carried the request out
(`drop_after_rate`: the write happened, the client does not know), or answer late (`slow_rate`,
`slow_s`); `only` limits the faults to requests whose decoded URL contains it. `deny_writes` answers every write (POST, PUT, PATCH, DELETE) with GCS's 403, as a
revoked permission does; reads go on (a string instead of True denies only the writes whose
decoded URL contains it, e.g. "/checkpoints/"). `counts` says what it did.

Bounded: at most `max_faults` faults in all, and the server shuts itself down after
`lifetime_s` even if a test forgets it.
"""
from __future__ import annotations

import http.client
import http.server
import json
import random
import socket
import threading
import time
import urllib.parse

HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
              "trailers", "transfer-encoding", "upgrade", "content-length"}
WRITES = {"POST", "PUT", "PATCH", "DELETE"}
FORBIDDEN = {"error": {"code": 403, "message": (
    "emulator@test.iam.gserviceaccount.com does not have storage.objects.create access to the "
    "Google Cloud Storage object. Permission 'storage.objects.create' denied on resource (or it "
    "may not exist)."), "errors": [{"reason": "forbidden", "domain": "global"}]}}


class FaultProxy:
    def __init__(self, upstream: str, *, seed: int = 0, error_rate: float = 0.0,
                 drop_rate: float = 0.0, drop_after_rate: float = 0.0, slow_rate: float = 0.0,
                 slow_s: float = 2.0, max_faults: int = 1000, lifetime_s: float = 1800.0,
                 only: str = ""):
        self.upstream = urllib.parse.urlsplit(upstream)
        self.rates = {"error": error_rate, "drop": drop_rate, "drop_after": drop_after_rate,
                      "slow": slow_rate}
        self.slow_s, self.max_faults, self.lifetime_s = slow_s, max_faults, lifetime_s
        self.only = only
        self.deny_writes = False
        self.counts = {"requests": 0, "error": 0, "drop": 0, "drop_after": 0, "slow": 0,
                       "denied": 0}
        self._random = random.Random(seed)
        self._lock = threading.Lock()
        self._server = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    @property
    def env(self) -> dict:
        """What points gcsfs, google-cloud-storage and tensorstore at the proxy."""
        return {"STORAGE_EMULATOR_HOST": self.url, "TENSORSTORE_GCS_HTTP_URL": self.url}

    @property
    def faults(self) -> int:
        return sum(v for k, v in self.counts.items() if k not in ("requests", "denied"))

    def _denied(self, method: str, url: str) -> bool:
        if not self.deny_writes or method not in WRITES:
            return False
        return self.deny_writes is True or self.deny_writes in urllib.parse.unquote(url)

    def _fault(self, method: str, url: str) -> tuple[str | None, int]:
        """What to do to this request: (None, 0) relays it; else a fault and its HTTP status."""
        with self._lock:
            self.counts["requests"] += 1
            if self._denied(method, url):
                self.counts["denied"] += 1
                return "denied", 403
            if self.faults >= self.max_faults or self.only not in urllib.parse.unquote(url):
                return None, 0
            draw = self._random.random()
            for kind, rate in self.rates.items():
                if kind == "drop_after" and "upload_id=" in url:
                    # A resumable upload's chunk: GCS answers a repeated final chunk of a
                    # finished session with 200, fake-gcs-server with 404 (gcsfs then fails
                    # where it would not on GCS), so it is not dropped after the fact.
                    continue
                if draw < rate:
                    self.counts[kind] += 1
                    return kind, self._random.choice((429, 500, 503))
                draw -= rate
        return None, 0

    def start(self) -> FaultProxy:
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    chunks = []
                    while True:
                        size = int(self.rfile.readline().split(b";")[0], 16)
                        chunk = self.rfile.read(size)
                        self.rfile.readline()
                        if not size:
                            return b"".join(chunks)
                        chunks.append(chunk)
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def _answer(self, status: int, headers, body: bytes) -> None:
                self.send_response(status)
                for name, value in headers:
                    if name.lower() not in HOP_BY_HOP:
                        self.send_header(name, value)
                if self.command == "HEAD":  # the size of what a GET would send, and no body
                    length = dict((k.lower(), v) for k, v in headers).get("content-length", "0")
                    self.send_header("Content-Length", length)
                    self.end_headers()
                    return
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _drop(self) -> None:
                self.close_connection = True
                try:
                    self.connection.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

            def _relay(self):
                body = self._body()
                fault, status = proxy._fault(self.command, self.path)
                if fault == "denied":
                    return self._answer(403, [("Content-Type", "application/json")],
                                        json.dumps(FORBIDDEN).encode())
                if fault == "error":
                    return self._answer(status, [("Content-Type", "application/json")], json.dumps(
                        {"error": {"code": status, "message": "injected by the fault proxy"}}
                    ).encode())
                if fault == "drop":
                    return self._drop()
                if fault == "slow":
                    time.sleep(proxy.slow_s)
                upstream = http.client.HTTPConnection(proxy.upstream.hostname,
                                                      proxy.upstream.port, timeout=120)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP}
                headers["Content-Length"] = str(len(body))
                try:
                    upstream.request(self.command, self.path, body=body, headers=headers)
                    response = upstream.getresponse()
                    content = response.read()
                    answer = [(k, v.replace(proxy.upstream.geturl().rstrip("/"), proxy.url))
                              for k, v in response.getheaders()]  # resumable upload URLs
                finally:
                    upstream.close()
                if fault == "drop_after":
                    return self._drop()
                self._answer(response.status, answer, content)

            do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = _relay

        class Server(http.server.ThreadingHTTPServer):
            daemon_threads = True

            def handle_error(self, request, client_address):
                pass  # a client that hung up on a dropped or slow answer: expected here

        self._server = Server(("127.0.0.1", 0), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True,
                         name="gcs-fault-proxy").start()
        self._timer = threading.Timer(self.lifetime_s, self.stop)  # bounded, whatever happens
        self._timer.daemon = True
        self._timer.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._timer.cancel()
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
