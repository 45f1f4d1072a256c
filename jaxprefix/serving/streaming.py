"""`stream: true`: a response as server-sent events in OpenAI's chunk format (docs/SERVING.md).

Each chunk is `data: {json}\\n\\n` and the stream ends with `data: [DONE]\\n\\n`. Completions stream
`text_completion` chunks (choices[i].text), chat `chat.completion.chunk`s (choices[i].delta: the
role first, then the content); each choice ends with a chunk of its finish_reason, and
`stream_options.include_usage` adds a last chunk of no choices and the usage.

A chunk per token, with that token's log-probabilities and id where the request asks for them:
`Increments` hands a choice's tokens out as its call draws them (streamed.py), each with the
text the finished choice is sure to begin with, and `text_pieces` splits what is left of the
finished choice, so the chunks' text joins to exactly the text of the request without `stream`.

`EventStream` answers the client itself: its headers go out with the first chunk, so a sampler
failure before it is still a 500 with OpenAI's error object. A client that disconnects cancels
the stream (gate.py), and with it a request still waiting for its sampler call.
"""
from __future__ import annotations

import json
from typing import AsyncIterator, Callable

from absl import logging
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


def text_pieces(decode: Callable[[list[int]], str], token_ids: list[int], text: str,
                start: int = 0, sent: str = "") -> list[tuple[int | None, str]]:
    """(token index, piece) for tokens start.. of a finished choice whose text is `text`, the
    pieces joining to what follows `sent` (the text handed out with the first `start` tokens):
    token i's piece is what the first i + 1 tokens' decoded text adds, held back while it ends
    in an incomplete character (U+FFFD) or leaves `text` (a stop string cut it); the last token
    takes what is left; (None, rest) when no token is left but text is."""
    pieces, emitted = [], len(sent)
    for i in range(start, len(token_ids)):
        upto = len(text)
        if i < len(token_ids) - 1:
            prefix = decode(token_ids[:i + 1])
            end = min(len(prefix), len(text))
            agrees = not prefix.endswith("\ufffd") and text[:end] == prefix[:end]
            upto = max(emitted, end) if agrees else emitted
        pieces.append((i, text[emitted:upto]))
        emitted = upto
    if emitted < len(text):
        pieces.append((None, text[emitted:]))
    return pieces


class Increments:
    """One choice's tokens handed out as they are drawn, each with the piece of text the
    finished choice is sure to begin with: before any stop string (the last characters that
    could begin one held back), never an incomplete character, and no token from a stop token
    on or past max_tokens. Then `rest` gives the finished choice's other tokens and text."""

    def __init__(self, decode: Callable[[list[int]], str], stop: list[str], stop_ids,
                 max_tokens: int):
        self.decode, self.stop, self.stop_ids = decode, [s for s in stop if s], set(stop_ids)
        self.max_tokens = max_tokens
        self.hold = max(map(len, self.stop), default=1) - 1
        self.tokens, self.text = 0, ""  # handed out
        self.open = True  # False once the rest waits for the finished choice

    def more(self, token_ids: list[int]) -> list[tuple[int, str]]:
        """(token index, piece) of the tokens drawn since the last call that can go out."""
        out = []
        for i in range(self.tokens, min(len(token_ids), self.max_tokens) if self.open else 0):
            if token_ids[i] in self.stop_ids:
                self.open = False
                break
            text = self.decode(token_ids[:i + 1])
            if any(s in text for s in self.stop):
                self.open = False
                break
            if text.endswith("\ufffd"):  # goes out with the token that completes it
                continue
            safe = text[:len(text) - self.hold]
            if not safe.startswith(self.text):  # a tokenizer whose text is not prefix-stable
                self.open = False
                break
            out += [(k, "") for k in range(self.tokens, i)] + [(i, safe[len(self.text):])]
            self.tokens, self.text = i + 1, safe
        return out

    def rest(self, token_ids: list[int], text: str) -> list[tuple[int | None, str]]:
        """The finished choice's (token ids, text: cut at its stops) after what went out."""
        if not text.startswith(self.text):
            logging.warning("a stream handed out %r, which the finished text %r does not begin "
                            "with", self.text, text)
        return text_pieces(self.decode, token_ids, text, self.tokens, self.text)


def stops(stop) -> list[str]:
    """A request's `stop`: a string, a list of them, or None."""
    return [] if stop is None else [stop] if isinstance(stop, str) else list(stop)


def usage(prompt_tokens: int, samples) -> dict:
    """A response's usage: the prompt's tokens and the samples'."""
    completion = sum(len(s.token_ids) for s in samples)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion}


def include_usage(body) -> bool:
    return body.stream_options is not None and body.stream_options.include_usage


def completion_chunk(head: dict, index: int, text: str, finish: str | None = None,
                     logprobs: dict | None = None, **vllm) -> dict:
    """A text_completion chunk of one choice; `vllm`: token_ids, prompt_token_ids."""
    return head | {"choices": [{"index": index, "text": text, "finish_reason": finish,
                                "logprobs": logprobs, **vllm}]}


def chat_chunk(head: dict, index: int, delta: dict, finish: str | None = None,
               logprobs: list | None = None, **vllm) -> dict:
    """A chat.completion.chunk of one choice; logprobs: its content entries."""
    return head | {"choices": [{"index": index, "delta": delta, "finish_reason": finish,
                                "logprobs": None if logprobs is None else
                                {"content": logprobs}, **vllm}]}
