"""The server's gate and clients that leave (docs/SERVING.md, "Limits"), against a server in this
process (tests/live_serving.py): a body over the limit is a 413, a request beyond those in
flight a 429, garbage a 400, each in OpenAI's error form and the server going on; a client that
disconnects before its call is dropped unsampled, one that leaves mid-stream frees its rows at
the next chunk.
"""
import concurrent.futures
import http.client
import json
import urllib.error
import urllib.request

import openai
import pytest
from live_serving import (MAX_TOKENS, NAME, client, held, live, model, paused,  # noqa: F401
                          server, stats, tokenizer, wait_for)


@pytest.fixture(scope="module")
def limited(model, tokenizer):
    with live(model, tokenizer, max_body_bytes=4096, max_in_flight=2) as served:
        yield served


def test_a_body_over_the_limit_is_a_413(limited):
    client = openai.OpenAI(base_url=limited.base_url, api_key="none", max_retries=0)
    with pytest.raises(openai.APIStatusError) as refused:
        client.completions.create(model=NAME, prompt="word " * 1000, max_tokens=MAX_TOKENS)
    assert refused.value.status_code == 413
    assert refused.value.body["code"] == "request_too_large"
    # A chunked body declares no length: refused when the bytes read pass the limit.
    host, port = limited.base_url.removeprefix("http://").removesuffix("/v1").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=60)
    body = json.dumps({"model": NAME, "prompt": "word " * 1000, "max_tokens": MAX_TOKENS})
    connection.request("POST", "/v1/completions", body=iter([body.encode()[:3000],
                                                              body.encode()[3000:]]),
                       headers={"Content-Type": "application/json"}, encode_chunked=True)
    response = connection.getresponse()
    assert response.status == 413 and json.loads(response.read())["error"]["param"] is None
    connection.close()
    out = client.completions.create(model=NAME, prompt="word " * 10, max_tokens=MAX_TOKENS)
    assert out.choices[0].finish_reason in ("stop", "length")


def test_beyond_max_in_flight_a_request_is_a_429_and_the_others_are_answered(limited):
    client = openai.OpenAI(base_url=limited.base_url, api_key="none", max_retries=0,
                           timeout=300)
    before = stats(limited)["refused"].get("429", 0)
    with held(limited.batcher) as release, concurrent.futures.ThreadPoolExecutor(2) as pool:
        answers = [pool.submit(client.completions.create, model=NAME, prompt=f"Say {i}",
                               max_tokens=MAX_TOKENS, stream=bool(i)) for i in range(2)]
        wait_for(lambda: stats(limited)["in_flight"] == 2)
        with pytest.raises(openai.RateLimitError) as refused:
            client.completions.create(model=NAME, prompt="One more", max_tokens=MAX_TOKENS)
        assert refused.value.status_code == 429
        assert refused.value.response.headers["retry-after"] == "1"
        assert refused.value.body["code"] == "rate_limit_exceeded"
        release.set()
        assert answers[0].result().choices[0].finish_reason in ("stop", "length")
        assert list(answers[1].result())[-1].choices[0].finish_reason in ("stop", "length")
    assert stats(limited)["refused"]["429"] == before + 1
    wait_for(lambda: stats(limited)["in_flight"] == 0)


GARBAGE = {
    "nested 100000 deep": b"[" * 100_000 + b"]" * 100_000,
    "nested in a field": b'{"model": "tiny", "prompt": "hi", "logit_bias": ' + b'{"a":' * 1500
                         + b"1" + b"}" * 1500 + b"}",
    "not utf-8": b'{"model": "tiny", "prompt": "\xff\xfe", "max_tokens": 2}',
    "binary": bytes(range(256)) * 8,
    "not an object": b"[1, 2, 3]",
    "truncated": b'{"model": "tiny", "prompt": "hi", "max_to',
    "NaN temperature": b'{"model": "tiny", "prompt": "hi", "temperature": NaN}',
}


@pytest.mark.parametrize("what", GARBAGE)
def test_garbage_is_a_400_in_openais_form_and_the_server_goes_on(server, what):
    for path in ("/completions", "/chat/completions"):
        request = urllib.request.Request(server.base_url + path, data=GARBAGE[what],
                                         headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=60)
        assert refused.value.code == 400, refused.value.read()
        error = json.loads(refused.value.read())["error"]
        assert set(error) == {"message", "type", "param", "code"}
    assert stats(server)["in_flight"] == 0


# --- a client that leaves ------------------------------------------------------------------

def leave_after_sending(served, body: dict, read_first_line: bool = False) -> None:
    """Posts `body` to /v1/completions and closes the connection (after the first line of the
    answer, with read_first_line)."""
    host, port = served.base_url.removeprefix("http://").removesuffix("/v1").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=300)
    connection.request("POST", "/v1/completions", body=json.dumps(body),
                       headers={"Content-Type": "application/json"})
    if read_first_line:
        response = connection.getresponse()
        assert response.status == 200 and response.read(7) == b"data: {"
    connection.close()


def test_a_client_that_leaves_before_its_call_is_dropped_unsampled(server, client):
    before = stats(server)
    calls = len(before["sampler_calls"])
    ask = dict(model=NAME, max_tokens=MAX_TOKENS, temperature=0)
    with held(server.batcher) as release, concurrent.futures.ThreadPoolExecutor(1) as pool:
        answer = pool.submit(client.completions.create, prompt="Stay", **ask)
        assert release.entered.wait(60)  # its call has begun: the others wait for the next
        leave_after_sending(server, dict(ask, prompt="Leave", stream=True))
        leave_after_sending(server, dict(ask, prompt="Leave too"))  # not streamed either
        wait_for(lambda: stats(server)["client_left"] == before["client_left"] + 2)
        assert stats(server)["in_flight"] == 1
        release.set()
        assert answer.result().choices[0].finish_reason in ("stop", "length")
    wait_for(lambda: stats(server)["dropped_requests"] == before["dropped_requests"] + 2)
    after = stats(server)["sampler_calls"][calls:]
    assert [c["requests"] for c in after] == [1], after  # the one that stayed
    assert client.completions.create(prompt="Still here", **ask).choices[0].text is not None


def test_a_client_that_leaves_mid_stream_leaves_nothing_in_flight(server, client):
    leave_after_sending(server, dict(model=NAME, prompt="Go", max_tokens=MAX_TOKENS,
                                     stream=True), read_first_line=True)
    wait_for(lambda: stats(server)["in_flight"] == 0)
    out = client.completions.create(model=NAME, prompt="Still here", max_tokens=MAX_TOKENS)
    assert out.choices[0].finish_reason in ("stop", "length")


def test_a_call_whose_every_client_left_mid_stream_stops_at_its_next_chunk(server, client,
                                                                          paused):
    before = stats(server)
    stream = client.completions.create(model=NAME, prompt="Once upon a time",
                                       max_tokens=MAX_TOKENS, temperature=0, stream=True,
                                       extra_body={"return_token_ids": True})
    next(c for c in stream if c.choices[0].model_extra.get("token_ids"))
    stream.close()  # gone after the first token
    wait_for(lambda: stats(server)["client_left"] == before["client_left"] + 1)
    paused.set()
    wait_for(lambda: stats(server)["abandoned_calls"] == before["abandoned_calls"] + 1)
    assert stats(server)["sampler_calls"] == before["sampler_calls"]  # none finished
    out = client.completions.create(model=NAME, prompt="Still here", max_tokens=MAX_TOKENS)
    assert out.choices[0].finish_reason in ("stop", "length")


def test_a_left_streams_rows_stop_at_the_next_chunk_and_its_company_is_answered(
        server, client, paused):
    """A whole request of 4 tokens and a stream of 12 share a call (queued behind a held
    one); the stream's client leaves after its first token: at the next chunk no row is
    wanted (one left, one has its 4 tokens), so the call ends there, not after 12 steps."""
    ask = dict(model=NAME, temperature=0, extra_body={"return_token_ids": True})

    def leave_after_a_token():
        stream = client.completions.create(prompt="Leaving soon", max_tokens=MAX_TOKENS,
                                           stream=True, **ask)
        next(c for c in stream if c.choices[0].model_extra.get("token_ids"))
        stream.close()
    before = stats(server)
    with held(server.batcher) as release, concurrent.futures.ThreadPoolExecutor(3) as pool:
        pool.submit(client.completions.create, prompt="Hold on", max_tokens=4, **ask)
        assert release.entered.wait(60)
        short = pool.submit(client.completions.create, prompt="Short one", max_tokens=4, **ask)
        gone = pool.submit(leave_after_a_token)
        wait_for(lambda: stats(server)["in_flight"] == 3)
        release.set()
        gone.result(timeout=120)
        wait_for(lambda: stats(server)["client_left"] == before["client_left"] + 1)
        paused.set()
        answer = short.result(timeout=120)
    calls = stats(server)["sampler_calls"][len(before["sampler_calls"]):]
    assert [(c["requests"], c["chunks"]) for c in calls] == [(1, 1), (2, 2)], calls
    alone = client.completions.create(prompt="Short one", max_tokens=4, **ask)
    assert answer.choices[0].model_extra["token_ids"] == alone.choices[0].model_extra["token_ids"]
