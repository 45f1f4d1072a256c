"""The server's gate: what a request must pass before any endpoint reads it (docs/SERVING.md).

An ASGI middleware around the endpoints (http_api.make_app): with `serve.api_key` set, every
request but /health must carry `Authorization: Bearer <key>`, else a 401 in OpenAI's error form.
"""
from __future__ import annotations

import hmac
import json

OPEN_PATHS = ("/health",)  # a liveness probe needs no key


class Gate:
    def __init__(self, app, *, api_key: str):
        self.app, self.api_key = app, api_key

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        if self.api_key and not self._authorized(scope):
            return await refuse(send, 401, "Incorrect or missing API key: expected the "
                                           "header 'Authorization: Bearer <key>' with the "
                                           "server's key", "invalid_api_key")
        await self.app(scope, receive, send)

    def _authorized(self, scope) -> bool:
        given = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, key = given.partition(b" ")
        # compare_digest: the time taken says nothing of how much of a guess was right.
        return scheme.lower() == b"bearer" and hmac.compare_digest(key.strip(),
                                                                   self.api_key.encode())


async def refuse(send, status: int, message: str, code: str,
                 kind: str = "invalid_request_error", headers=()) -> None:
    """A response in OpenAI's error form, sent before any endpoint ran."""
    body = json.dumps({"error": {"message": message, "type": kind, "param": None,
                                 "code": code}}).encode()
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
        *headers]})
    await send({"type": "http.response.body", "body": body})
