"""ServeSettings: the config's `serve` block parsed and checked once (jobs/serve.py takes it)."""
from __future__ import annotations

import dataclasses
import ipaddress
import os

from jaxprefix.errors import need

API_KEY_VARIABLE = "JAXPREFIX_API_KEY"  # the key when serve.api_key is empty


@dataclasses.dataclass(frozen=True)
class ServeSettings:
    host: str = "127.0.0.1"
    port: int = 8000
    model_name: str = ""
    max_batch_rows: int = 64
    batch_window_ms: float = 10.0
    max_context: int = 0        # 0: the model's context
    max_tokens: int = 1024
    max_top_logprobs: int = 20
    api_key: str = dataclasses.field(default="", repr=False)  # "": no key asked for
    max_body_bytes: int = 8 * 2**20
    max_in_flight: int = 256    # 0: no cap
    stream_chunk_tokens: int = 16

    def __post_init__(self):
        def check(ok, field, expected):
            need(ok, f"config.serve.{field}", getattr(self, field), expected)
        check(bool(self.host), "host", "an address to listen on (e.g. 127.0.0.1)")
        check(0 < self.port < 65536, "port", "a TCP port in [1, 65535]")
        check(self.max_batch_rows >= 1, "max_batch_rows", ">= 1")
        check(self.batch_window_ms >= 0, "batch_window_ms", ">= 0 milliseconds")
        check(self.max_context >= 0, "max_context", ">= 0 (0: the model's context)")
        check(self.max_tokens >= 1, "max_tokens", ">= 1")
        check(self.max_top_logprobs >= 0, "max_top_logprobs", ">= 0")
        check(self.max_body_bytes >= 1024, "max_body_bytes", ">= 1024 bytes")
        check(self.max_in_flight >= 0, "max_in_flight", ">= 0 (0: no cap)")
        check(self.stream_chunk_tokens >= 1, "stream_chunk_tokens", ">= 1")
        # Anyone who can reach a server off the loopback can sample it: not without a key.
        check(bool(self.api_key) or is_loopback(self.host), "api_key",
              f"a key clients must send (or {API_KEY_VARIABLE} set) when serve.host="
              f"{self.host!r} is not a loopback address")

    @classmethod
    def from_config(cls, config) -> ServeSettings:
        values = {f.name: config.serve[f.name] for f in dataclasses.fields(cls)}
        if not values["model_name"]:  # the file name a client would call the model by
            path = config.model.get("path", "") or config.model.source
            values["model_name"] = os.path.splitext(os.path.basename(path.rstrip("/")))[0]
        values["api_key"] = values["api_key"] or os.environ.get(API_KEY_VARIABLE, "")
        return cls(**values)

    def context_limit(self, model_context: int) -> int:
        """Prompt plus new tokens a request may reach."""
        return min(self.max_context or model_context, model_context)


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 or localhost: reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # another host name
        return False
