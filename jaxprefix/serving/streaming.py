"""`stream: true`: a response as server-sent events in OpenAI's chunk format (docs/SERVING.md).

Each chunk is `data: {json}\\n\\n` and the stream ends with `data: [DONE]\\n\\n`. Completions stream
`text_completion` chunks (choices[i].text), chat `chat.completion.chunk`s (choices[i].delta: the
role first, then the content); each choice ends with a chunk of its finish_reason, and
`stream_options.include_usage` adds a last chunk of no choices and the usage.

The batcher returns whole samples (a sampler call is one in-graph decode loop), so a stream is a
finished sample split into one chunk per token, each with that token's log-probabilities and id
where the request asks for them: the first chunk comes when the whole sample is drawn. The
chunks' text joins to exactly the text of the same request without `stream`.

`EventStream` answers the client itself: its headers go out with the first chunk, so a sampler
failure before it is still a 500 with OpenAI's error object. A client that disconnects cancels
the stream (gate.py), and with it a request still waiting for its sampler call.
"""
from __future__ import annotations

import json
from typing import AsyncIterator, Callable, Iterator

from starlette.responses import Response


class EventStream(Response):
    """The chunks of `events` as server-sent events, then [DONE].
    `failed(exception)` is the response to a failure before the first chunk."""

    def __init__(self, events: AsyncIterator[dict], failed: Callable[[Exception], Response]):
        # Not Response.__init__: it would write a content-length of the empty body.
        self.status_code, self.background = 200, None
        self.raw_headers = [(b"content-type", b"text/event-stream; charset=utf-8"),
                            (b"cache-control", b"no-cache")]
        self.events, self.failed = events, failed

    async def __call__(self, scope, receive, send) -> None:
        started, events = False, aiter(self.events)
        while True:
            try:
                chunk = await anext(events)
            except StopAsyncIteration:
                break
            except Exception as e:  # noqa: BLE001  (the sampler's failure: reported, not raised)
                if not started:
                    await self.failed(e)(scope, receive, send)
                    return
                chunk = json.loads(self.failed(e).body)
            if not started:
                await send({"type": "http.response.start", "status": 200,
                            "headers": self.raw_headers})
                started = True
            await send({"type": "http.response.body", "body": _event(chunk), "more_body": True})
            if "error" in chunk:
                break
        if not started:  # no chunk at all (every choice ends with one: not expected)
            await send({"type": "http.response.start", "status": 200,
                        "headers": self.raw_headers})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n",
                    "more_body": False})


def _event(chunk: dict) -> bytes:
    return b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"


def text_pieces(decode: Callable[[list[int]], str], token_ids: list[int],
                text: str) -> list[str]:
    """One piece of `text` per token, joining to `text` exactly: token i's piece is what the
    first i + 1 tokens' decoded text adds, held back while it ends in an incomplete character
    (U+FFFD) or leaves `text` (a stop string cut it); the last token takes what is left."""
    pieces, emitted = [], 0
    for i in range(len(token_ids)):
        upto = len(text)
        if i < len(token_ids) - 1:
            prefix = decode(token_ids[:i + 1])
            end = min(len(prefix), len(text))
            agrees = not prefix.endswith("\ufffd") and text[:end] == prefix[:end]
            upto = max(emitted, end) if agrees else emitted
        pieces.append(text[emitted:upto])
        emitted = upto
    return pieces


def with_usage(chunks: Iterator[dict], head: dict, usage: dict | None) -> Iterator[dict]:
    """The chunks, then (include_usage: `usage` given) the usage chunk, every chunk with
    `usage: null` before it as OpenAI's."""
    for chunk in chunks:
        yield chunk if usage is None else chunk | {"usage": None}
    if usage is not None:
        yield head | {"choices": [], "usage": usage}


def completion_chunks(head: dict, index: int, pieces: list[str], reason: str,
                      logprobs: dict | None, token_ids: list[int] | None,
                      prompt_token_ids: list[int] | None) -> Iterator[dict]:
    """One choice's text_completion chunks: a piece of text per token (its logprobs and id
    where asked for; the prompt's ids on the first), then its finish_reason."""
    for i, piece in enumerate(pieces):
        choice = {"index": index, "text": piece, "finish_reason": None,
                  "logprobs": None if logprobs is None else
                  {k: None if v is None else v[i:i + 1] for k, v in logprobs.items()}}
        if token_ids is not None:
            choice["token_ids"] = token_ids[i:i + 1]
            if i == 0:
                choice["prompt_token_ids"] = prompt_token_ids
        yield head | {"choices": [choice]}
    yield head | {"choices": [{"index": index, "text": "", "finish_reason": reason,
                               "logprobs": None}]}


def chat_chunks(head: dict, index: int, pieces: list[str], message: dict, reason: str,
                logprobs: dict | None, token_ids: list[int] | None,
                prompt_token_ids: list[int] | None) -> Iterator[dict]:
    """One choice's chat.completion.chunks: the role (with the prompt's ids where asked for),
    a content delta per token (its logprobs and id where asked for), then its finish_reason.
    A message of tool calls comes whole: its content and calls in one delta, with every
    token's logprobs and ids."""
    def chunk(delta, finish=None, start=0, end=0):
        choice = {"index": index, "delta": delta, "finish_reason": finish,
                  "logprobs": None if logprobs is None else
                  {"content": logprobs["content"][start:end]}}
        if token_ids is not None:
            choice["token_ids"] = token_ids[start:end]
        return head | {"choices": [choice]}
    first = chunk({"role": "assistant", "content": ""})
    yield first if prompt_token_ids is None else first | {"prompt_token_ids": prompt_token_ids}
    if "tool_calls" in message:
        calls = [dict(call, index=i) for i, call in enumerate(message["tool_calls"])]
        yield chunk({"content": message["content"], "tool_calls": calls}, None, 0,
                    len(pieces))
    else:
        for i, piece in enumerate(pieces):
            yield chunk({"content": piece}, None, i, i + 1)
    yield chunk({}, reason)
