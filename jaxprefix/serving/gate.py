"""The server's gate: what a request must pass before any endpoint reads it (docs/SERVING.md).

An ASGI middleware around the endpoints (http_api.make_app), each refusal in OpenAI's error form:
  - with `serve.api_key` set, every request but /health must carry `Authorization: Bearer
    <key>`, else a 401;
  - a body over `serve.max_body_bytes` is a 413, refused by its Content-Length before it is
    read, or when the bytes read pass the limit (a chunked body); the body is read here once
    and handed on;
  - beyond `serve.max_in_flight` requests at once (a stream counts until its last chunk) a
    429 with Retry-After, so a flood waits at its clients instead of in this process's memory.
A request whose client leaves before its answer is complete is cancelled: the endpoint stops
where it awaits, and a request still waiting for its sampler call is dropped there (batcher.py).
The gate reads the body and watches for the client leaving itself, since only one reader can
take the connection's messages. `Load` counts the requests in flight, the refusals and the
requests cancelled so; /stats reports it.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import hmac
import json

OPEN_PATHS = ("/health",)           # a liveness probe needs no key
UNCOUNTED_PATHS = ("/health", "/stats")  # cheap: never refused for the load


@dataclasses.dataclass
class Load:
    in_flight: int = 0
    refused: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    client_left: int = 0  # requests cancelled because their client disconnected


class Gate:
    def __init__(self, app, *, api_key: str, max_body_bytes: int, max_in_flight: int,
                 load: Load):
        self.app, self.api_key, self.load = app, api_key, load
        self.max_body_bytes, self.max_in_flight = max_body_bytes, max_in_flight

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        if self.api_key and not self._authorized(scope):
            return await self.refuse(send, 401, "Incorrect or missing API key: expected the "
                                                "header 'Authorization: Bearer <key>' with the "
                                                "server's key", "invalid_api_key")
        counted = scope["path"] not in UNCOUNTED_PATHS
        if counted and self.max_in_flight and self.load.in_flight >= self.max_in_flight:
            return await self.refuse(
                send, 429, f"{self.load.in_flight} requests in flight, this server's most "
                           f"(serve.max_in_flight); expected a retry later",
                "rate_limit_exceeded", "requests", headers=[(b"retry-after", b"1")])
        self.load.in_flight += counted
        try:
            await self._pass(scope, receive, send)
        finally:
            self.load.in_flight -= counted

    async def _pass(self, scope, receive, send) -> None:
        """The request to the endpoints with its body read here, unless the body is too big."""
        declared = dict(scope["headers"]).get(b"content-length", b"0")
        if not declared.isdigit() or int(declared) > self.max_body_bytes:
            return await self._too_large(send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left: no one to answer
            size += len(message.get("body", b""))
            if size > self.max_body_bytes:
                return await self._too_large(send)
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        await self._answer(scope, receive, send, b"".join(chunks))

    async def _answer(self, scope, receive, send, body: bytes) -> None:
        """The endpoints' answer to the request, cancelled if the client leaves before it is
        complete."""
        whole, complete = {"type": "http.request", "body": body, "more_body": False}, False

        async def replay():  # the body once; the client's leaving is the gate's to hear
            nonlocal whole
            if whole is None:
                await asyncio.Future()  # never: the endpoint is cancelled instead
            message, whole = whole, None
            return message

        async def sending(message):
            nonlocal complete
            await send(message)
            complete = complete or (message["type"] == "http.response.body"
                                    and not message.get("more_body"))
        answer = asyncio.ensure_future(self.app(scope, replay, sending))
        left = asyncio.Event()

        async def watch():
            while (await receive())["type"] != "http.disconnect":
                pass
            if not complete:  # uvicorn also says "disconnect" once the answer is sent
                left.set()
                self.load.client_left += 1
                answer.cancel()
        watcher = asyncio.ensure_future(watch())
        try:
            await answer
        except asyncio.CancelledError:
            if not left.is_set():  # the server's own cancellation, not the client's
                raise
        except OSError:  # the client left while the answer was sent
            pass
        finally:
            watcher.cancel()

    def _authorized(self, scope) -> bool:
        given = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, key = given.partition(b" ")
        # compare_digest: the time taken says nothing of how much of a guess was right.
        return scheme.lower() == b"bearer" and hmac.compare_digest(key.strip(),
                                                                   self.api_key.encode())

    async def _too_large(self, send) -> None:
        await self.refuse(send, 413, f"the request body is over this server's "
                                     f"{self.max_body_bytes} bytes (serve.max_body_bytes); "
                                     f"expected a smaller one", "request_too_large")

    async def refuse(self, send, status: int, message: str, code: str,
                     kind: str = "invalid_request_error", headers=()) -> None:
        """A response in OpenAI's error form, sent before any endpoint ran."""
        self.load.refused[status] += 1
        body = json.dumps({"error": {"message": message, "type": kind, "param": None,
                                     "code": code}}).encode()
        await send({"type": "http.response.start", "status": status, "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()), *headers]})
        await send({"type": "http.response.body", "body": body})
