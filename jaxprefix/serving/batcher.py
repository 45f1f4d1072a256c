"""The batcher: requests that arrive together become one sampler call, their rows in flight
together, on one thread that does all the device work.

The HTTP layer submits a `SampleRequest` (n samples of one prompt) and awaits its future. The
batcher's thread takes the first waiting request, gathers those that arrive within the batch
window (or arrived while the previous call ran) up to `max_batch_rows` rows, and samples them
in one call of generate()'s programs per distinct (temperature, top_p, top_k): every sample a
row of its own (n = 1; the static decode still prefills equal prompts once), max_new_tokens the
largest asked for, each row cut back to its own request's max_tokens afterwards. A call runs
through sampling/chunked.py (generate()'s rollouts): in one chunk, or, with a request that has
a `progress` (a stream), in chunks of `chunk_steps` steps, handing each such request its tokens
so far after every chunk; either way the same programs, compiled once a shape.

A request whose future was cancelled (its client left) before its call starts is dropped, its
rows never sampled; one already in a call decodes on with the others. In a chunked call the
rows of a request that has left, or that have drawn their request's max_tokens, stop at the
next chunk in the static decode (the call ends when the others do), and a call that every
request has left stops there (`Abandoned`). Sample j of a request with seed s draws from the
sampler's stream (s, j) (`stream_of`), so a seeded request gets the same samples whatever else
shares its call.
"""
from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import queue
import random
import threading
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from flax import nnx

from jaxprefix.sampling.chunked import Progress, generate_in_chunks
from jaxprefix.sampling.layout import MIN_CONTEXT_BUCKET, bucket

MAX_N = 256          # samples of one request: j is the low 8 bits of a row's stream
SEED_LIMIT = 2**23   # a request's seed is taken modulo this (the stream's other 23 bits)
RECENT_CALLS = 1000  # sampler calls kept for /stats
WHOLE = 2**30        # decode steps of a chunk: the whole call


@dataclasses.dataclass(frozen=True)
class SampleRequest:
    """n samples of one prompt, as the HTTP layer validated them."""
    prompt: tuple[int, ...]
    n: int
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None   # None: a fresh one
    top_logprobs: int = 0     # alternatives listed at each token (0: none)
    echo: bool = False        # the prompt's tokens scored too (OpenAI's echo: lm-eval's
    #                           log-likelihoods), from one teacher-forced forward of the row
    # Called on the batcher's thread after each chunk of its call with each sample's
    # (token ids, log-probs) so far (a stream's), its call then decoding in chunks.
    progress: Callable[[list[tuple[list[int], list[float]]]], None] | None = \
        dataclasses.field(default=None, compare=False)
    # Whether its client still waits for the rest, asked between chunks (None: always).
    waited: Callable[[], bool] | None = dataclasses.field(default=None, compare=False)

    @property
    def call_key(self) -> tuple:
        """Requests with equal keys share a sampler call (greedy ignores top_p and top_k)."""
        return (0.0, 1.0, 0) if self.temperature == 0 else (
            self.temperature, self.top_p, self.top_k)


@dataclasses.dataclass(frozen=True)
class Sample:
    token_ids: list[int]      # the completion, its stop token included
    logprobs: list[float]     # of each token under the tempered model (greedy: temperature 1)
    stopped: bool             # ended on a stop token (False: max_tokens reached)
    top_logprobs: list[list[tuple[int, float]]] | None = None  # per token, best first
    # With echo: the prompt's tokens after its first, each one's log-probability and (with
    # top_logprobs) its alternatives, under the same tempered model.
    prompt_logprobs: list[float] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None


def stream_of(seed: int, j: int) -> int:
    """The sampler's stream of sample j of a request seeded `seed` (fits int32)."""
    return (seed % SEED_LIMIT) * MAX_N + j


class Batcher:
    """Owns the model after start-up: only its thread calls the sampler."""

    def __init__(self, model, *, stop_ids, sampler_keywords: dict, max_batch_rows: int,
                 window_s: float, max_top_logprobs: int, seed: int = 0, chunk_steps: int = 16):
        self.model = model
        self.chunk_steps = chunk_steps  # decode steps between a streamed call's progress
        self.stop_ids = tuple(stop_ids)
        self.sampler_keywords = sampler_keywords  # rows in flight, KV budget, pages
        self.max_batch_rows = max_batch_rows
        self.window_s = window_s
        self.max_top_logprobs = max_top_logprobs
        self.calls = collections.deque(maxlen=RECENT_CALLS)  # one dict per sampler call
        self.dropped = 0  # requests cancelled before their call: never sampled
        self.abandoned = 0  # calls stopped at a chunk: every client of theirs had left
        self._chunks = 1  # the chunks of the call the thread runs (1: not streamed)
        self._seeds = random.Random(seed)
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="batcher", daemon=True)
        self._thread.start()

    def submit(self, request: SampleRequest) -> concurrent.futures.Future:
        """A future of the request's n Samples."""
        future = concurrent.futures.Future()
        self._queue.put((request, future))
        return future

    def close(self, timeout_s: float = 30.0) -> bool:
        """Stops the thread after the call in flight; whether it stopped within timeout_s."""
        self._queue.put(None)
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def _run(self) -> None:
        held = None  # a request that did not fit the previous batch: first of the next
        while True:
            first = held if held is not None else self._queue.get()
            held = None
            if first is None:
                return
            batch, rows = [first], first[0].n
            deadline = time.monotonic() + self.window_s
            while rows < self.max_batch_rows:
                try:
                    item = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    break
                if item is not None and item[1].cancelled():
                    self.dropped += 1
                    continue
                if item is None or rows + item[0].n > self.max_batch_rows:
                    held = item
                    break
                batch.append(item)
                rows += item[0].n
            groups = collections.defaultdict(list)
            for item in batch:
                groups[item[0].call_key].append(item)
            for group in groups.values():
                self._call(group)

    def _call(self, group: list) -> None:
        """One sampler call for requests of equal sampling settings; fulfils their futures.
        Those cancelled by now are dropped; the others can no longer be cancelled."""
        kept = [item for item in group if item[1].set_running_or_notify_cancel()]
        self.dropped += len(group) - len(kept)
        if not kept:
            return
        group, requests = kept, [r for r, _ in kept]
        try:
            started = time.monotonic()
            samples = self._sample(requests)
            seconds = time.monotonic() - started
        except Abandoned:
            self.abandoned += 1
            for _, future in group:
                future.set_exception(concurrent.futures.CancelledError())
            return
        except Exception as e:  # noqa: BLE001  (the requests fail; the server goes on)
            logging.exception("sampler call of %d requests failed", len(group))
            for _, future in group:
                future.set_exception(e)
            return
        rows = sum(r.n for r in requests)
        self.calls.append(dict(requests=len(requests), rows=rows, seconds=round(seconds, 3),
                               max_tokens=max(r.max_tokens for r in requests),
                               chunks=self._chunks))
        logging.info("sampler call: %d requests, %d rows, %.2f s", len(requests), rows, seconds)
        for (_, future), result in zip(group, samples):
            future.set_result(result)

    def _sample(self, requests: list[SampleRequest]) -> list[list[Sample]]:
        first = requests[0]
        contexts, streams = [], []
        for r in requests:
            seed = self._seeds.randrange(SEED_LIMIT) if r.seed is None else r.seed
            for j in range(r.n):
                contexts.append(list(r.prompt))
                streams.append((stream_of(seed, j), 0))
        keywords = dict(n=1, max_new_tokens=max(r.max_tokens for r in requests),
                        temperature=first.temperature, top_p=first.top_p, top_k=first.top_k,
                        stop_ids=self.stop_ids, seed=0, streams=streams, **self.sampler_keywords)
        # generate()'s rollouts, in chunks when a stream waits for its tokens; in one chunk
        # otherwise, so that streamed and whole requests run the same programs (one compile
        # of each shape, not one for each way).
        streamed = any(r.progress for r in requests)
        last = []
        for self._chunks, drawn in enumerate(generate_in_chunks(
                self.model, contexts, chunk_steps=self.chunk_steps if streamed else WHOLE,
                unwanted=lambda: _unwanted(requests, last[-1]), **keywords), 1):
            last.append(drawn)
            _report(requests, drawn)
            if not any(_waited(r) for r in requests):
                raise Abandoned(f"{len(requests)} requests, at chunk {self._chunks}")
        rollouts = drawn.rollouts
        out, row = [], 0
        for r in requests:
            samples = []
            for _ in range(r.n):
                start = int(rollouts.context_lengths[row])
                length = min(int(rollouts.lengths[row]), r.max_tokens)
                tokens = rollouts.tokens[row, :start + length]
                top = prompt_logprobs = prompt_top = None
                if r.top_logprobs or r.echo:
                    lps, tops = self._teacher_forced(tokens, 1 if r.echo else start,
                                                     r.temperature or 1.0, r.top_logprobs)
                    at = start - 1 if r.echo else 0  # where the completion's entries begin
                    if r.echo:
                        prompt_logprobs = lps[:at]
                        prompt_top = tops[:at] if r.top_logprobs else None
                    top = tops[at:] if r.top_logprobs else None
                samples.append(Sample(
                    token_ids=tokens[start:].tolist(),
                    logprobs=rollouts.logprobs[row, start:start + length].tolist(),
                    stopped=bool(rollouts.stopped[row]) and length == rollouts.lengths[row],
                    top_logprobs=top, prompt_logprobs=prompt_logprobs,
                    prompt_top_logprobs=prompt_top))
                row += 1
            out.append(samples)
        return out

    def _teacher_forced(self, tokens: np.ndarray, start: int, temperature: float, k: int
                        ) -> tuple[list[float], list[list[tuple[int, float]]]]:
        """Each token from `start` on: its log-probability and the k most likely tokens at its
        position (best first), under the tempered model: one teacher-forced forward of the row."""
        width = bucket(len(tokens), MIN_CONTEXT_BUCKET)
        padded = np.zeros((1, width), np.int32)
        padded[0, :len(tokens)] = tokens
        mask = np.arange(width)[None] < len(tokens)
        graphdef, params = nnx.split(self.model)
        values, ids, chosen = jax.device_get(_scored(graphdef, params, padded, mask,
                                                     np.float32(temperature),
                                                     k=self.max_top_logprobs))
        # The logits at t - 1 predict token t.
        return ([float(chosen[0, t - 1]) for t in range(start, len(tokens))],
                [list(zip(ids[0, t - 1, :k].tolist(), values[0, t - 1, :k].tolist()))
                 for t in range(start, len(tokens))])


class Abandoned(Exception):
    """Every client of a call left: it stops at the chunk (its requests are cancelled)."""


def _report(requests: list[SampleRequest], drawn: Progress) -> None:
    """Each request's samples so far (cut to its max_tokens) to its progress, if it has one."""
    row = 0
    for r in requests:
        if r.progress is not None:
            samples = [(drawn.completions[i, :min(drawn.lengths[i], r.max_tokens)].tolist(),
                        drawn.logprobs[i, :min(drawn.lengths[i], r.max_tokens)].tolist())
                       for i in range(row, row + r.n)]
            try:
                r.progress(samples)
            except Exception:  # noqa: BLE001  (a stream's failure is not the call's)
                logging.exception("a request's progress failed")
        row += r.n


def _waited(request: SampleRequest) -> bool:
    return request.waited is None or request.waited()


def _unwanted(requests: list[SampleRequest], drawn: Progress) -> list[int]:
    """The rows of requests whose client left, and the rows that have drawn their request's
    max_tokens: the rest of the call would decode them for no one."""
    rows, row = [], 0
    for r in requests:
        left = not _waited(r)
        rows += [i for i in range(row, row + r.n) if left or drawn.lengths[i] >= r.max_tokens]
        row += r.n
    return rows


@functools.partial(jax.jit, static_argnames=("graphdef", "k"))
def _scored(graphdef, params, tokens, mask, temperature, *, k: int):
    """(top-k log-probs, their ids) at each position, and the log-prob of the next token."""
    logits = nnx.merge(graphdef, params)(tokens, None, mask) / temperature
    logprobs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    following = jnp.concatenate([tokens[:, 1:], tokens[:, :1]], axis=1)  # the last: unused
    chosen = jnp.take_along_axis(logprobs, following[..., None], axis=-1)[..., 0]
    return (*jax.lax.top_k(logprobs, max(k, 1)), chosen)
