"""What the tests of the OpenAI-compatible server in this process share (test_serve_clients.py,
test_serve_limits.py): a server (serving/live.py) on 127.0.0.1 over a tiny random llama with
SmolLM2's vocabulary and chat template, the `openai` client, /stats, and ways to hold the
batcher: a call held before it samples (`held`), or after its first chunk (`paused`)."""
import contextlib
import json
import threading
import time
import urllib.request

import openai
import pytest
import tiny_checkpoints
from jaxprefix import tokenizers
from jaxprefix.checkpoints.gguf import bundled_smollm2_path
from jaxprefix.sampling import RolloutSpec
from jaxprefix.serving.live import LiveServer

NAME = "tiny"
MAX_TOKENS = 12  # every request's: one shape to compile
CHUNK = 4        # decode steps between a stream's deliveries: a call in 3 chunks


@pytest.fixture(scope="module")
def tokenizer():
    return tokenizers.load(bundled_smollm2_path())


@pytest.fixture(scope="module")
def model(tokenizer):
    return tiny_checkpoints.llama_over(tokenizer, max_position_embeddings=256)


def live(model, tokenizer, **settings) -> LiveServer:
    keywords = RolloutSpec(max_new_tokens=MAX_TOKENS).sampler_keywords()
    for name in ("max_new_tokens", "temperature", "top_p", "top_k"):  # each request's own
        del keywords[name]
    return LiveServer(model, tokenizer, stop_ids=[tokenizer.eos_id], sampler_keywords=keywords,
                      max_tokens=MAX_TOKENS, context_length=256, model_name=NAME, **settings)


@pytest.fixture(scope="module")
def server(model, tokenizer):
    with live(model, tokenizer, stream_chunk_tokens=CHUNK) as served:
        yield served


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=300)


@pytest.fixture
def paused(monkeypatch):
    """A streamed call waits after its first chunk until the event given is set (a call of
    whole requests runs in one chunk and does not wait)."""
    from jaxprefix.serving import batcher

    go_on, real = threading.Event(), batcher.generate_in_chunks

    def waiting(*args, chunk_steps, **kwargs):
        for i, progress in enumerate(real(*args, chunk_steps=chunk_steps, **kwargs)):
            yield progress
            if i == 0 and chunk_steps < batcher.WHOLE:
                assert go_on.wait(120), "not released"
    monkeypatch.setattr(batcher, "generate_in_chunks", waiting)
    yield go_on
    go_on.set()


@contextlib.contextmanager
def held(batcher):
    """The batcher's sampler calls wait, within the block, until the event it gives is set
    (`entered`: one has begun): their requests stay in flight."""
    release, real = threading.Event(), batcher._sample
    release.entered = threading.Event()

    def waiting(requests):
        release.entered.set()
        release.wait(120)
        return real(requests)
    batcher._sample = waiting
    try:
        yield release
    finally:
        release.set()
        batcher._sample = real


def stats(served) -> dict:
    with urllib.request.urlopen(served.base_url.removesuffix("/v1") + "/stats") as response:
        return json.loads(response.read())


def wait_for(condition, timeout_s: float = 60):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)
