"""The OpenAI-compatible server as real clients use it (docs/SERVING.md): `stream: true` through
the `openai` client, against a server in this process (tests/live_serving.py); the API key.

A streamed answer joins to the same request's answer without `stream` (greedy, seeded, with
stop strings), the chunks in OpenAI's format, one per token with its log-probabilities and id
where asked for, the first ones out while the call still decodes. With a key set, a request
without it is a 401; off the loopback, no key is no server.
"""
import json
import os
import subprocess
import sys
import urllib.error
import urllib.request

import openai
import pytest
from jaxprefix import run_config
from jaxprefix.errors import ConfigError
from jaxprefix.run_setup import preflight
from jaxprefix.serving import streaming
from jaxprefix.serving.settings import API_KEY_VARIABLE, ServeSettings, is_loopback
from live_serving import (MAX_TOKENS, NAME, client, live, model, paused, server,  # noqa: F401
                          stats, tokenizer)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_a_streamed_completion_joins_to_the_greedy_answer(client):
    ask = dict(model=NAME, prompt=["The capital of France is", "1, 2, 3,"], max_tokens=MAX_TOKENS,
               temperature=0, logprobs=2, extra_body={"return_token_ids": True})
    whole = client.completions.create(**ask)
    chunks = list(client.completions.create(**ask, stream=True,
                                            stream_options={"include_usage": True}))
    assert all(c.object == "text_completion" and c.model == NAME for c in chunks)
    assert len({c.id for c in chunks}) == 1
    *streamed, last = chunks
    assert last.choices == [] and last.usage == whole.usage
    assert all("usage" in c.model_fields_set and c.usage is None for c in streamed)  # null
    for expected in whole.choices:
        mine = [c.choices[0] for c in streamed if c.choices[0].index == expected.index]
        *tokens, end = mine
        assert "".join(c.text for c in tokens) == expected.text
        assert end.finish_reason == expected.finish_reason and end.text == ""
        assert all(c.finish_reason is None for c in tokens)
        token_ids = expected.model_extra["token_ids"]
        assert len(tokens) == len(token_ids)  # a chunk per token
        assert [t for c in tokens for t in c.model_extra["token_ids"]] == token_ids
        assert tokens[0].model_extra["prompt_token_ids"] == \
            expected.model_extra["prompt_token_ids"]
        assert [lp for c in tokens for lp in c.logprobs.token_logprobs] == \
            expected.logprobs.token_logprobs
        assert [t for c in tokens for t in c.logprobs.top_logprobs] == \
            expected.logprobs.top_logprobs


def test_a_streamed_chat_joins_to_the_unstreamed_answer_role_first(client):
    ask = dict(model=NAME, messages=[{"role": "user", "content": "What is 2 + 3?"}],
               max_tokens=MAX_TOKENS, temperature=1.0, n=2, seed=5, logprobs=True,
               top_logprobs=2, extra_body={"return_token_ids": True})
    whole = client.chat.completions.create(**ask)
    chunks = list(client.chat.completions.create(**ask, stream=True))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert all(c.usage is None for c in chunks)  # no usage chunk unless asked
    for expected in whole.choices:
        first, *tokens, end = [c.choices[0] for c in chunks if c.choices[0].index ==
                               expected.index]
        assert first.delta.role == "assistant" and not first.delta.content
        assert "".join(c.delta.content for c in tokens) == expected.message.content
        assert all(c.delta.role is None for c in tokens)
        assert end.finish_reason == expected.finish_reason and end.delta.content is None
        assert [e.logprob for c in tokens for e in c.logprobs.content] == \
            [e.logprob for e in expected.logprobs.content]
        assert [t for c in tokens for t in c.model_extra["token_ids"]] == \
            expected.model_extra["token_ids"]
    first_chunk = next(c for c in chunks if c.choices[0].index == 0)
    assert first_chunk.model_extra["prompt_token_ids"] == whole.model_extra["prompt_token_ids"]


def test_increments_hand_out_only_what_the_finished_text_begins_with():
    """streaming.Increments on a byte-ish tokenizer: token 3 is half a character (its text ends
    in U+FFFD until token 4 completes it), stop string "cd" may begin at the last character,
    token 9 is a stop token id."""
    vocab = {1: "a", 2: "b", 3: "\ufffd", 4: "é", 5: "c", 6: "d", 7: "e", 9: ""}

    def decode(ids):
        text = "".join(vocab[i] for i in ids)
        return text.replace("\ufffdé", "é")  # 3 then 4: one character
    inc = streaming.Increments(decode, ["cd"], {9}, max_tokens=10)
    assert inc.more([1, 2]) == [(0, ""), (1, "a")]  # the last character may begin "cd"
    assert inc.more([1, 2, 3]) == []                  # half a character: held
    assert inc.more([1, 2, 3, 4, 5]) == [(2, ""), (3, "b"), (4, "é")]  # completed by token 4
    assert inc.more([1, 2, 3, 4, 5, 6, 7]) == []      # "cd": the finished text ends before it
    finished = "abé"  # what api.finish cuts: before the stop string, tokens through "d"
    rest = inc.rest([1, 2, 3, 4, 5, 6], finished)
    assert "".join(p for _, p in rest) == "" and [i for i, _ in rest] == [5]
    stop_id = streaming.Increments(decode, [], {9}, max_tokens=3)
    assert stop_id.more([1, 9, 2]) == [(0, "a")]      # nothing from a stop token on
    assert stop_id.more([1, 9, 2, 5]) == []
    assert [p for _, p in stop_id.rest([1, 9], "a")] == [""]


def test_increments_on_smollm2s_byte_tokens_join_to_the_text(tokenizer):
    """Characters split over byte tokens (emoji, CJK) go out whole, one chunk a token."""
    text = "Snow ☃ and 雪 — 🎉🎉 done, ok?"
    ids = tokenizer.encode(text)
    def decode(i):
        return tokenizer.decode(i, skip_special_tokens=True)
    assert any(decode(ids[:k]).endswith("\ufffd") for k in range(1, len(ids)))  # it splits
    for stop in ([], ["ok?"], ["🎉"]):
        inc = streaming.Increments(decode, stop, (), max_tokens=len(ids))
        out = []
        for k in range(1, len(ids) + 1, 3):  # chunks of 3 tokens
            out += inc.more(ids[:k])
        finished = text[:min([text.find(s) for s in stop if s in text] or [len(text)])]
        cut = next((k for k in range(1, len(ids) + 1) if any(s in decode(ids[:k])
                                                            for s in stop)), len(ids))
        out += inc.rest(ids[:cut], finished)
        assert "".join(p for _, p in out) == finished
        assert [i for i, _ in out if i is not None] == list(range(cut))
        assert not any("\ufffd" in p for _, p in out)


def joined(chunks, index: int) -> tuple[str, list[int], list[float], str]:
    """A completion choice's streamed (text, token ids, log-probs, finish_reason)."""
    mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == index]
    return ("".join(c.text for c in mine),
            [t for c in mine for t in (c.model_extra.get("token_ids") or [])],
            [lp for c in mine if c.logprobs for lp in c.logprobs.token_logprobs],
            mine[-1].finish_reason)


@pytest.mark.parametrize("extra", [{}, {"stop": True}, {"temperature": 1.0, "seed": 3}])
def test_a_stream_delivered_as_drawn_joins_to_the_unstreamed_answer(server, client, extra):
    """No alternatives asked for: each choice's tokens go out after each chunk of the call,
    never past a stop string (held back where one could begin), and join to the answer."""
    ask = dict(model=NAME, prompt=["The capital of France is", "1, 2, 3,"], n=2,
               max_tokens=MAX_TOKENS, temperature=0, logprobs=0,
               extra_body={"return_token_ids": True}) | extra
    if "stop" in extra:  # two characters from the middle of the first answer, and a miss
        text = client.completions.create(**(ask | {"stop": None})).choices[0].text
        ask["stop"] = extra["stop"] = [text[len(text) // 2:][:2], "never said"]
    whole = client.completions.create(**ask)
    calls = len(stats(server)["sampler_calls"])
    chunks = list(client.completions.create(**ask, stream=True))
    [call] = stats(server)["sampler_calls"][calls:]
    assert call["chunks"] >= 2, call  # decoded in chunks, the tokens handed out between
    for expected in whole.choices:
        text, token_ids, logprobs, reason = joined(chunks, expected.index)
        assert text == expected.text and reason == expected.finish_reason
        assert token_ids == expected.model_extra["token_ids"]
        assert logprobs == expected.logprobs.token_logprobs
    if "stop" in extra:  # the stop strings cut something, and no chunk shows one
        assert any(c.finish_reason == "stop" for c in whole.choices)
        assert not any(s in c.choices[0].text for c in chunks if c.choices
                       for s in extra["stop"])


def test_a_streamed_chat_delivered_as_drawn_joins_to_the_unstreamed_answer(client):
    ask = dict(model=NAME, messages=[{"role": "user", "content": "Count to five."}],
               max_tokens=MAX_TOKENS, temperature=1.0, n=2, seed=11, logprobs=True,
               extra_body={"return_token_ids": True})
    whole = client.chat.completions.create(**ask)
    chunks = list(client.chat.completions.create(**ask, stream=True))
    for expected in whole.choices:
        first, *rest, end = [c.choices[0] for c in chunks if c.choices[0].index ==
                             expected.index]
        assert first.delta.role == "assistant"
        assert "".join(c.delta.content for c in rest) == expected.message.content
        assert [e.logprob for c in rest for e in c.logprobs.content] == \
            [e.logprob for e in expected.logprobs.content]
        assert [t for c in rest for t in c.model_extra["token_ids"]] == \
            expected.model_extra["token_ids"]
        assert end.finish_reason == expected.finish_reason


def test_the_first_tokens_arrive_while_the_call_still_decodes(server, client, paused):
    """The call stops after its first chunk until the client has read a chunk of text."""
    go_on = paused
    stream = client.completions.create(model=NAME, prompt="Once upon a time",
                                       max_tokens=MAX_TOKENS, temperature=0, stream=True,
                                       extra_body={"return_token_ids": True})
    first = next(c.choices[0] for c in stream if c.choices[0].model_extra.get("token_ids"))
    assert stats(server)["in_flight"] == 1  # its call has not finished
    go_on.set()
    rest = list(stream)
    assert rest[-1].choices[0].finish_reason in ("stop", "length")
    assert len(first.model_extra["token_ids"]) == 1


def stream_lines(server, path: str, body: dict) -> list[bytes]:
    request = urllib.request.Request(server.base_url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        assert response.headers["Content-Type"].startswith("text/event-stream")
        return response.read().split(b"\n\n")


def test_the_stream_is_server_sent_events_ending_with_done(server):
    events = stream_lines(server, "/completions", {
        "model": NAME, "prompt": "Hello", "max_tokens": MAX_TOKENS, "stream": True})
    *chunks, done, after = events
    assert done == b"data: [DONE]" and after == b""
    assert all(c.startswith(b"data: {") for c in chunks)
    assert json.loads(chunks[-1][len(b"data: "):])["choices"][0]["finish_reason"] in (
        "stop", "length")


def test_stream_options_without_stream_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model=NAME, prompt="Hi", max_tokens=MAX_TOKENS,
                                  stream_options={"include_usage": True})
    assert raised.value.body["param"] == "stream_options"


# --- the API key ---------------------------------------------------------------------------

KEY = "sk-test-0123"


def test_with_a_key_set_a_request_must_carry_it(model, tokenizer):
    with live(model, tokenizer, api_key=KEY) as served:
        for wrong in ("none", KEY + "x"):
            stranger = openai.OpenAI(base_url=served.base_url, api_key=wrong, max_retries=0)
            with pytest.raises(openai.AuthenticationError) as refused:
                stranger.models.list()
            assert refused.value.status_code == 401
            assert refused.value.body["code"] == "invalid_api_key"
            assert set(refused.value.body) == {"message", "type", "param", "code"}
        request = urllib.request.Request(served.base_url + "/models")  # no header at all
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=10)
        assert refused.value.code == 401
        with urllib.request.urlopen(served.base_url.removesuffix("/v1") + "/health") as r:
            assert r.status == 200  # a liveness probe needs no key
        friend = openai.OpenAI(base_url=served.base_url, api_key=KEY, max_retries=0,
                               timeout=300)
        assert friend.models.list().data[0].id == NAME
        streamed = friend.completions.create(model=NAME, prompt="Hi", max_tokens=MAX_TOKENS,
                                             stream=True)
        assert list(streamed)[-1].choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("host,loopback", [
    ("127.0.0.1", True), ("127.3.2.1", True), ("localhost", True), ("::1", True),
    ("0.0.0.0", False), ("::", False), ("10.1.2.3", False), ("example.com", False)])
def test_a_server_off_the_loopback_needs_a_key(host, loopback, monkeypatch):
    monkeypatch.delenv(API_KEY_VARIABLE, raising=False)
    assert is_loopback(host) == loopback
    config = run_config.from_file(os.path.join(ROOT, "configs", "serve.py"), "hf")
    config.model.path = "/no/such/model"
    config.serve.host = host
    if loopback:
        assert ServeSettings.from_config(config).api_key == ""
        return
    with pytest.raises(ConfigError) as refused:
        preflight.check(config, "/tmp/unused-workdir")
    line = str(refused.value)
    assert "\n" not in line and line.startswith("config.serve.api_key='': expected a key")
    monkeypatch.setenv(API_KEY_VARIABLE, KEY)  # the variable stands in for the field
    assert ServeSettings.from_config(config).api_key == KEY
    assert KEY not in repr(ServeSettings.from_config(config))


def test_main_refuses_to_serve_off_the_loopback_without_a_key_in_one_line(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != API_KEY_VARIABLE}
    result = subprocess.run(
        [sys.executable, "-m", "jaxprefix.main", "--config=configs/serve.py:hf",
         f"--workdir={tmp_path}", "--config.model.path=/no/such/model",
         "--config.serve.host=0.0.0.0"], cwd=ROOT, env=env | {"JAX_PLATFORMS": "cpu"},
        capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert lines == [lines[0]] and "config.serve.api_key" in lines[0], result.stderr[-2000:]
