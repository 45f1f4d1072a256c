"""A streamed request's chunks, as its tokens are drawn (docs/SERVING.md, "Streaming").

Its SampleRequests carry a `progress` (batcher.py): their sampler call decodes in chunks of
`serve.stream_chunk_tokens` steps and hands each its samples so far after every chunk; each
choice sends a chunk per new token with the text its finished answer is sure to begin with
(streaming.Increments), then, once the call is done, the rest of its tokens and text as the
request without `stream` would have them (api.finish) and its finish_reason. So the chunks of
a choice join to exactly that answer. A request that asks for alternatives at each token
(completions' `logprobs` > 0, chat's `top_logprobs`) or offers tools waits for the finished
sample: the alternatives are computed after the call, the tool calls parsed from the whole.

`api` is http_api.Api (not imported: it imports this).
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
from typing import AsyncIterator

from jaxprefix.serving import streaming
from jaxprefix.serving.batcher import Sample, SampleRequest


async def drawn(api, requests: list[SampleRequest], incremental: bool) -> AsyncIterator:
    """(k, each sample of request k so far) after each chunk of their call (with
    `incremental`), then (None, every request's finished Samples). Closing it (the client
    left) cancels the requests: one still waiting for its call is dropped, and a call whose
    every request has left stops at its next chunk."""
    loop, updates, listening = asyncio.get_running_loop(), asyncio.Queue(), [True]

    def progress(k, samples):  # on the batcher's thread
        if listening[0]:
            loop.call_soon_threadsafe(updates.put_nowait, (k, samples))
    if incremental:
        requests = [dataclasses.replace(r, progress=lambda s, k=k: progress(k, s),
                                        waited=lambda: listening[0])
                    for k, r in enumerate(requests)]
    result = asyncio.ensure_future(api.sample(requests))
    try:
        while not result.done():
            update = asyncio.ensure_future(updates.get())
            await asyncio.wait({update, result}, return_when=asyncio.FIRST_COMPLETED)
            if update.done():
                yield update.result()
            else:
                update.cancel()
        while not updates.empty():
            yield updates.get_nowait()
        yield None, result.result()
    finally:
        listening[0] = False
        result.cancel()


def _usage_head(head: dict, body) -> dict:
    """With stream_options.include_usage every chunk carries `usage: null`, as OpenAI's, and a
    last chunk of no choices the usage."""
    return head | {"usage": None} if streaming.include_usage(body) else head


def _decoder(api):
    return lambda ids: api.tokenizer.decode(ids, skip_special_tokens=True)


def _increments(api, body, max_tokens: int) -> streaming.Increments:
    return streaming.Increments(_decoder(api), streaming.stops(body.stop),
                                body.stop_token_ids or (), max_tokens)


async def completion_events(api, body, prompts: list[list[int]],
                            requests: list[SampleRequest], head: dict) -> AsyncIterator[dict]:
    """The text_completion chunks of a streamed /v1/completions request."""
    head = _usage_head(head, body)
    as_ids, wants = body.return_tokens_as_token_ids, body.logprobs is not None
    incremental = not body.logprobs  # alternatives at each token: only after the call
    choices = {p * body.n + j: _increments(api, body, requests[p].max_tokens)
               for p in range(len(prompts)) for j in range(body.n)}
    started = set()

    def chunks(index, prompt, sample, entries):
        """A chunk per (token index or None, piece), its logprobs and ids where asked for."""
        logprobs = api.completion_logprobs(sample, as_ids) if wants else None
        for i, piece in entries:
            at = slice(0, 0) if i is None else slice(i, i + 1)
            vllm = {}
            if body.return_token_ids:
                vllm["token_ids"] = sample.token_ids[at]
                if index not in started:
                    vllm["prompt_token_ids"] = prompt
            started.add(index)
            yield streaming.completion_chunk(
                head, index, piece, logprobs=None if logprobs is None else
                {k: None if v is None else v[at] for k, v in logprobs.items()}, **vllm)

    samples = []
    async for k, update in drawn(api, requests, incremental):
        if k is not None:
            for j, (ids, lps) in enumerate(update):
                entries = choices[k * body.n + j].more(ids)
                for chunk in chunks(k * body.n + j, prompts[k], Sample(ids, lps, False),
                                    entries):
                    yield chunk
            continue
        for p, result in enumerate(update):
            for j, raw in enumerate(result):
                index = p * body.n + j
                sample, text, reason = api.finish(raw, body)
                samples.append(sample)
                for chunk in chunks(index, prompts[p], sample,
                                    choices[index].rest(sample.token_ids, text)):
                    yield chunk
                yield streaming.completion_chunk(head, index, "", reason)
    if streaming.include_usage(body):
        yield head | {"choices": [], "usage": streaming.usage(sum(map(len, prompts)), samples)}


async def chat_events(api, body, prompt: list[int], request: SampleRequest, head: dict,
                      call_format: str | None, message_of) -> AsyncIterator[dict]:
    """The chat.completion.chunks of a streamed /v1/chat/completions request: each choice's
    role first, its content as it comes, its finish_reason last. `message_of(sample, text)`:
    the finished choice's message (with tool calls where the template's format finds them)."""
    head = _usage_head(head, body)
    as_ids, wants = body.return_tokens_as_token_ids, body.logprobs
    incremental = not (body.top_logprobs and body.logprobs) and call_format is None
    choices = [_increments(api, body, request.max_tokens) for _ in range(body.n)]
    started = set()

    def chunks(j, sample, entries):
        logprobs = api.chat_logprobs(sample, as_ids)["content"] if wants else None
        for i, piece in entries:
            at = slice(0, 0) if i is None else slice(i, i + 1)
            vllm = {"token_ids": sample.token_ids[at]} if body.return_token_ids else {}
            yield streaming.chat_chunk(head, j, {"content": piece},
                                       logprobs=None if logprobs is None else logprobs[at],
                                       **vllm)

    def role(j):
        if j in started:
            return
        started.add(j)
        first = streaming.chat_chunk(head, j, {"role": "assistant", "content": ""})
        yield first | ({"prompt_token_ids": prompt} if body.return_token_ids else {})

    samples = []
    async for k, update in drawn(api, [request], incremental):
        if k is not None:
            for j, (ids, lps) in enumerate(update):
                entries = choices[j].more(ids)
                if entries:
                    for chunk in itertools.chain(role(j), chunks(j, Sample(ids, lps, False),
                                                                 entries)):
                        yield chunk
            continue
        for j, drawn_sample in enumerate(update[0]):
            sample, text, reason = api.finish(drawn_sample, body)
            samples.append(sample)
            message = message_of(sample, text)
            for chunk in role(j):
                yield chunk
            if "tool_calls" in message:  # whole: nothing went out before (not incremental)
                calls = [dict(call, index=i) for i, call in enumerate(message["tool_calls"])]
                vllm = {"token_ids": sample.token_ids} if body.return_token_ids else {}
                yield streaming.chat_chunk(
                    head, j, {"content": message["content"], "tool_calls": calls},
                    logprobs=api.chat_logprobs(sample, as_ids)["content"] if wants else None,
                    **vllm)
                reason = "tool_calls"
            else:
                for chunk in chunks(j, sample, choices[j].rest(sample.token_ids, text)):
                    yield chunk
            yield streaming.chat_chunk(head, j, {}, reason)
    if streaming.include_usage(body):
        yield head | {"choices": [], "usage": streaming.usage(len(prompt), samples)}
