"""The policy served in this process, on 127.0.0.1 and a free port, for as long as a with-block:
the serve job's batcher and endpoints (batcher.py, http_api.py) over weights the caller holds,
for an external environment to run its episodes against (external.py).

    with LiveServer(model, tokenizer, stop_ids=..., sampler_keywords=..., max_tokens=...) as s:
        client = openai.AsyncOpenAI(base_url=s.base_url, api_key="none")

The listening socket is bound here (port 0: the system picks a free one) and handed to uvicorn,
so no other process can take the port in between; uvicorn runs on its own thread and event loop
(signals stay the main thread's). Leaving the block stops the server, then the batcher.
"""
from __future__ import annotations

import asyncio
import socket
import threading
import time

from jaxprefix.serving.batcher import Batcher
from jaxprefix.serving.http_api import Api, make_app
from jaxprefix.serving.settings import ServeSettings

HOST = "127.0.0.1"


class LiveServer:
    """`model` behind the OpenAI-compatible API on HOST while the with-block runs.

    sampler_keywords: RolloutSpec.sampler_keywords() less each request's own (max_new_tokens,
      temperature, top_p, top_k); max_tokens: the most new tokens a request may ask for;
      context_length: the model's (prompt plus new tokens a request may reach); sampling
      (temperature, top_p, top_k): what every request must ask for (http_api.Api), or None;
      serve: other ServeSettings fields (a key, the gate's limits).
    """

    def __init__(self, model, tokenizer, *, stop_ids, sampler_keywords: dict, max_tokens: int,
                 context_length: int, model_name: str = "policy", max_batch_rows: int = 64,
                 batch_window_ms: float = 10.0, seed: int = 0, start_timeout_s: float = 60.0,
                 sampling: dict | None = None, **serve):
        self.model, self.tokenizer = model, tokenizer
        self.stop_ids, self.sampler_keywords = tuple(stop_ids), dict(sampler_keywords)
        self.context_length, self.seed = context_length, seed
        self.start_timeout_s, self.sampling = start_timeout_s, sampling
        self.settings = ServeSettings(host=HOST, port=1, model_name=model_name,
                                      max_batch_rows=max_batch_rows,
                                      batch_window_ms=batch_window_ms, max_tokens=max_tokens,
                                      **{"max_in_flight": 0} | serve)  # the run's own client
        self.batcher = self._server = self._thread = None
        self.port: int | None = None
        self.failure: BaseException | None = None

    @property
    def base_url(self) -> str:
        return f"http://{HOST}:{self.port}/v1"

    @property
    def model_name(self) -> str:
        return self.settings.model_name

    def __enter__(self) -> LiveServer:
        import uvicorn

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((HOST, 0))
        self.port = sock.getsockname()[1]
        self.batcher = Batcher(self.model, stop_ids=self.stop_ids,
                               sampler_keywords=self.sampler_keywords,
                               max_batch_rows=self.settings.max_batch_rows,
                               window_s=self.settings.batch_window_ms / 1000,
                               max_top_logprobs=self.settings.max_top_logprobs, seed=self.seed,
                               chunk_steps=self.settings.stream_chunk_tokens)
        app = make_app(Api(self.batcher, self.tokenizer, self.settings, self.context_length,
                           self.sampling))
        self._server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off",
                                                     timeout_graceful_shutdown=5))

        def serve():
            try:
                asyncio.run(self._server.serve(sockets=[sock]))
            except BaseException as e:  # noqa: BLE001  (reported by __enter__ or __exit__)
                self.failure = e
            finally:
                sock.close()
        self._thread = threading.Thread(target=serve, name="live-server", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + self.start_timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.__exit__(None, None, None)
                raise RuntimeError(f"the live server on {HOST}:{self.port} did not start: "
                                   f"{self.failure!r}")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> bool:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(30)
        if self.batcher is not None:
            self.batcher.close(timeout_s=30)
        return False
