"""ServeSettings: the config's `serve` block parsed and checked once (jobs/serve.py takes it)."""
from __future__ import annotations

import dataclasses
import os

from jaxprefix.errors import need


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

    @classmethod
    def from_config(cls, config) -> ServeSettings:
        values = {f.name: config.serve[f.name] for f in dataclasses.fields(cls)}
        if not values["model_name"]:  # the file name a client would call the model by
            path = config.model.get("path", "") or config.model.source
            values["model_name"] = os.path.splitext(os.path.basename(path.rstrip("/")))[0]
        return cls(**values)

    def context_limit(self, model_context: int) -> int:
        """Prompt plus new tokens a request may reach."""
        return min(self.max_context or model_context, model_context)
