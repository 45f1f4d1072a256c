"""The serve job from outside: `python -m jaxprefix.main --config=configs/serve.py:...` in a
subprocess on a free 127.0.0.1 port, driven by the `openai` client.

The default suite serves a tiny random llama over SmolLM2's vocabulary and chat template (an HF
directory built here) and checks greedy completions against transformers' greedy generate, one
log-probability per token, eight requests at once sampled together (a call of more than 4
rows in the continuous decode, rollout.max_rows_in_flight=4; a seeded request alone, in the
static one, samples the same), a stream of such a call, the 400s, and (when the server fixture ends) that SIGTERM stops
it with exit status 0. The slow test serves the bundled
SmolLM2 itself through `configs/serve.py:smollm2`, the issue's contract command.
"""
import concurrent.futures
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import numpy as np
import openai
import pytest
import torch
import transformers
import tiny_checkpoints
from jaxprefix import tokenizers
from jaxprefix.checkpoints.gguf import bundled_smollm2_path
from jaxprefix.serving.http_api import assistant_message

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_CONTEXT = 96  # the tiny server's serve.max_context: a long prompt is easy to make


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(url: str):
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


class Server:
    """A serve job in a subprocess; `client` talks to it."""

    def __init__(self, variant: str, workdir, *flags: str, start_timeout_s: float = 240):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = open(os.path.join(workdir, "server.log"), "w+")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "jaxprefix.main", f"--config=configs/serve.py:{variant}",
             f"--workdir={workdir}", f"--config.serve.port={self.port}", *flags],
            cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT,
            env={**os.environ, "JAX_PLATFORMS": "cpu"})
        deadline = time.monotonic() + start_timeout_s
        while True:
            if self.process.poll() is not None:
                raise AssertionError(f"the server exited {self.process.returncode}:\n"
                                     f"{self.output()}")
            try:
                get_json(self.base + "/health")
                break
            except (urllib.error.URLError, ConnectionError):
                assert time.monotonic() < deadline, "the server did not start:\n" + self.output()
                time.sleep(0.5)
        # Long: on a busy 2-core box a SmolLM2 call that compiles a new shape took 213 s.
        self.client = openai.OpenAI(base_url=self.base + "/v1", api_key="none", max_retries=0,
                                    timeout=1200)

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()[-5000:]

    def stats(self) -> list[dict]:
        return get_json(self.base + "/stats")["sampler_calls"]

    def stop(self) -> int:
        """SIGTERM; the exit status."""
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(60)
        finally:
            self.log.close()


@pytest.fixture(scope="module")
def tokenizer():
    return tokenizers.load(bundled_smollm2_path())


@pytest.fixture(scope="module")
def model_dir(tokenizer, tmp_path_factory):
    """A tiny random llama over SmolLM2's vocabulary and chat template."""
    return tiny_checkpoints.save_llama_over(tokenizer,
                                            tmp_path_factory.mktemp("tiny") / "tiny-llama")


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    served = Server("hf", tmp_path_factory.mktemp("serve"), f"--config.model.path={model_dir}",
                    f"--config.serve.max_context={MAX_CONTEXT}", "--config.serve.max_tokens=32",
                    "--config.serve.max_batch_rows=16", "--config.serve.batch_window_ms=200",
                    # a call of more rows takes the continuous decode
                    "--config.rollout.max_rows_in_flight=4")
    yield served
    status = served.stop()
    assert status == 0, f"SIGTERM: exit status {status}, expected 0:\n{served.output()}"


@pytest.fixture(scope="module")
def reference(model_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


def greedy_reference(model, prompt_ids, max_new_tokens):
    """transformers' greedy tokens and each one's log-probability."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens,
                             do_sample=False, output_scores=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt_ids):].tolist()
    logprobs = [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.scores, tokens)]
    return tokens, logprobs


def test_models_lists_the_served_model(server):
    [model] = server.client.models.list().data
    assert model.id == "tiny-llama"


@pytest.mark.parametrize("prompt", ["The capital of France is", "1, 2, 3,"])
def test_greedy_completion_equals_transformers_with_one_logprob_per_token(server, reference,
                                                                          prompt):
    out = server.client.completions.create(
        model="tiny-llama", prompt=prompt, max_tokens=12, temperature=0, logprobs=2,
        extra_body={"return_token_ids": True})
    [choice] = out.choices
    prompt_ids, token_ids = choice.model_extra["prompt_token_ids"], choice.model_extra["token_ids"]
    expected, expected_logprobs = greedy_reference(reference, prompt_ids, 12)
    assert token_ids == expected
    logprobs = choice.logprobs
    assert len(logprobs.token_logprobs) == len(logprobs.tokens) == len(token_ids)
    np.testing.assert_allclose(logprobs.token_logprobs, expected_logprobs, atol=1e-4)
    # The alternatives come from a forward of the whole row: greedy's token is their best.
    assert len(logprobs.top_logprobs) == len(token_ids)
    for alternatives, logprob in zip(logprobs.top_logprobs, logprobs.token_logprobs):
        assert max(alternatives.values()) == pytest.approx(logprob, abs=1e-4)
    assert out.usage.completion_tokens == len(token_ids)
    assert choice.finish_reason in ("stop", "length")


@pytest.mark.parametrize("max_tokens", [0, 3])
def test_echo_scores_the_prompt_as_transformers_does(server, reference, max_tokens):
    """lm-eval-harness's log-likelihoods (local-completions): the prompt echoed with each
    token's log-probability, the first none, and whether each was the greedy choice."""
    prompt = "The capital of France is"
    out = server.client.completions.create(
        model="tiny-llama", prompt=prompt, max_tokens=max_tokens, temperature=0, echo=True,
        logprobs=1, extra_body={"return_token_ids": True})
    [choice] = out.choices
    prompt_ids, token_ids = choice.model_extra["prompt_token_ids"], choice.model_extra["token_ids"]
    assert len(token_ids) == max_tokens and choice.text.startswith(prompt)
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(prompt_ids) + max_tokens
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert logprobs.text_offset[0] == 0 and logprobs.text_offset == sorted(logprobs.text_offset)
    row = prompt_ids + token_ids
    with torch.no_grad():
        logits = reference(torch.tensor([row])).logits[0].float()
    expected = torch.log_softmax(logits, -1)[torch.arange(len(row) - 1), torch.tensor(row[1:])]
    np.testing.assert_allclose(logprobs.token_logprobs[1:], expected.tolist(), atol=1e-4)
    greedy = (logits.argmax(-1)[:-1] == torch.tensor(row[1:])).tolist()
    for alternatives, logprob, was_greedy in zip(logprobs.top_logprobs[1:],
                                                 logprobs.token_logprobs[1:], greedy):
        assert (max(alternatives.values()) == pytest.approx(logprob, abs=1e-4)) == was_greedy


def test_chat_renders_the_models_template(server, tokenizer, reference):
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    out = server.client.chat.completions.create(
        model="tiny-llama", messages=messages, max_tokens=8, temperature=0, logprobs=True,
        top_logprobs=3, extra_body={"return_token_ids": True})
    prompt_ids = out.model_extra["prompt_token_ids"]
    assert prompt_ids == tokenizer.apply_chat_template(messages, tokenize=True)
    [choice] = out.choices
    token_ids = choice.model_extra["token_ids"]
    assert token_ids == greedy_reference(reference, prompt_ids, 8)[0]
    content = choice.logprobs.content
    assert len(content) == len(token_ids) and all(len(c.top_logprobs) == 3 for c in content)
    assert choice.message.role == "assistant"


TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluates arithmetic.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}}]


def test_chat_with_tools_renders_them_and_takes_a_tool_turn(server, tokenizer):
    messages = [{"role": "user", "content": "What is 2 + 3?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {
                        "name": "calculator", "arguments": '{"expression": "2 + 3"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "5"}]
    out = server.client.chat.completions.create(
        model="tiny-llama", messages=messages, tools=TOOLS, max_tokens=4, temperature=0,
        extra_body={"return_token_ids": True})
    assert out.model_extra["prompt_token_ids"] == tokenizer.apply_chat_template(
        [dict(m, content=m["content"] or "") for m in messages], tools=TOOLS, tokenize=True)
    with pytest.raises(openai.BadRequestError, match="tool_choice"):
        server.client.chat.completions.create(
            model="tiny-llama", messages=messages[:1], tools=TOOLS, tool_choice="required")


def test_tool_calls_in_the_templates_format_become_openais():
    raw = ('Let me compute. <tool_call>{"name": "calculator", "arguments": {"expression": '
           '"2 + 3"}}</tool_call><|im_end|>')
    message = assistant_message("Let me compute. ", raw, "hermes")
    [call] = message["tool_calls"]
    assert message["content"] == "Let me compute."
    assert call["function"] == {"name": "calculator", "arguments": '{"expression": "2 + 3"}'}
    assert call["type"] == "function" and call["id"].startswith("call_")
    # A malformed call stays text; without tools offered nothing is parsed.
    broken = "<tool_call>{not json</tool_call>"
    assert assistant_message(broken, broken, "hermes") == {"role": "assistant",
                                                           "content": broken}
    assert "tool_calls" not in assistant_message("x", raw, None)
    llama = '<|python_tag|>{"name": "calculator", "parameters": {"expression": "1"}}<|eom_id|>'
    assert assistant_message("", llama, "llama3")["tool_calls"][0]["function"]["name"] == \
        "calculator"


def test_n_samples_with_a_seed_are_reproducible(server):
    def ask(seed):
        out = server.client.completions.create(
            model="tiny-llama", prompt="Once upon a time", max_tokens=10, temperature=1.0,
            n=3, seed=seed, extra_body={"return_token_ids": True})
        return [c.model_extra["token_ids"] for c in out.choices]
    first = ask(7)
    assert len(first) == 3 and len({tuple(t) for t in first}) > 1  # the 3 samples differ
    assert ask(7) == first


def test_eight_requests_at_once_are_answered_in_shared_calls(server):
    before = len(server.stats())
    prompts = [f"Request number {i} says" for i in range(8)]

    def ask(i):
        out = server.client.completions.create(
            model="tiny-llama", prompt=prompts[i], max_tokens=6 + i, temperature=0.7,
            seed=i, extra_body={"return_token_ids": True})
        return out.choices[0].model_extra["token_ids"]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, range(8)))
    assert all(1 <= len(a) <= 6 + i for i, a in enumerate(answers))
    calls = server.stats()[before:]
    assert sum(c["requests"] for c in calls) == 8
    assert max(c["requests"] for c in calls) >= 2, calls  # batched, not one at a time
    # A seeded request samples the same alone as it did in company.
    assert ask(5) == answers[5]


def test_a_stream_of_more_rows_than_fit_at_once_joins_to_the_unstreamed_answer(server):
    """The serve job streams a call of 6 rows in the continuous decode (4 in flight) in
    chunks of 16 steps, each choice's chunks joining to the seeded answer without stream."""
    ask = dict(model="tiny-llama", prompt="Once upon a time", max_tokens=24, temperature=1.0,
               n=6, seed=2, logprobs=0, extra_body={"return_token_ids": True})
    whole = server.client.completions.create(**ask)
    before = len(server.stats())
    chunks = list(server.client.completions.create(**ask, stream=True))
    assert server.stats()[before:][0]["chunks"] >= 2  # rows wait for a slot: more steps
    for expected in whole.choices:
        mine = [c.choices[0] for c in chunks if c.choices[0].index == expected.index]
        assert "".join(c.text for c in mine) == expected.text
        assert [t for c in mine for t in c.model_extra.get("token_ids") or []] == \
            expected.model_extra["token_ids"]
        assert [lp for c in mine if c.logprobs for lp in c.logprobs.token_logprobs] == \
            expected.logprobs.token_logprobs
        assert mine[-1].finish_reason == expected.finish_reason


def post_json(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.loads(response.read())


def test_tokenize_gives_the_ids_a_prompt_or_a_chat_is_sampled_from(server, tokenizer):
    """vLLM's /tokenize: a chat's ids equal the chat completion's prompt_token_ids, a text's the
    tokenizer's; /detokenize inverts; another model's name is a 400."""
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    chat = post_json(server.base + "/tokenize", {"model": "tiny-llama", "messages": messages})
    out = server.client.chat.completions.create(model="tiny-llama", messages=messages,
                                                max_tokens=1, extra_body={"return_token_ids": True})
    assert chat["tokens"] == out.model_extra["prompt_token_ids"]
    assert chat["count"] == len(chat["tokens"]) and chat["max_model_len"] == MAX_CONTEXT
    text = "\n<|im_start|>user\nSure?<|im_end|>\n"
    ids = post_json(server.base + "/tokenize", {"prompt": text, "add_special_tokens": False})
    assert ids["tokens"] == tokenizer.encode(text, add_special_tokens=False)
    assert post_json(server.base + "/detokenize", {"tokens": ids["tokens"]})["prompt"] == text
    with pytest.raises(urllib.error.HTTPError) as refused:
        post_json(server.base + "/tokenize", {"model": "other", "prompt": "hi"})
    assert refused.value.code == 400


def test_token_in_token_out_generate_as_verifiers_training_client_calls_it(server, reference):
    """vLLM's /inference/v1/generate, with the body verifiers' renderer client sends."""
    prompt = [1, 504, 3458, 282, 4649, 314]

    def generate(**params):
        return post_json(server.base + "/inference/v1/generate", {
            "model": "tiny-llama", "token_ids": prompt,
            "sampling_params": {"max_tokens": 10, "temperature": 0, "logprobs": 1,
                                "skip_special_tokens": False, **params}})
    out = generate()
    [choice] = out["choices"]
    expected, expected_logprobs = greedy_reference(reference, prompt, 10)
    assert out["prompt_token_ids"] == prompt and choice["token_ids"] == expected
    content = choice["logprobs"]["content"]
    assert [c["token"] for c in content] == [f"token_id:{t}" for t in expected]
    np.testing.assert_allclose([c["logprob"] for c in content], expected_logprobs, atol=1e-4)
    # A stop token id of the request ends the sample at its first occurrence, kept.
    stop = expected[3]
    cut = generate(stop_token_ids=[stop])["choices"][0]
    assert cut["token_ids"] == expected[:expected.index(stop) + 1]
    assert cut["finish_reason"] == "stop"


def test_stop_string_cuts_the_completion(server):
    def ask(**kw):
        return server.client.completions.create(
            model="tiny-llama", prompt="The capital of France is", max_tokens=16,
            temperature=0, extra_body={"return_token_ids": True}, **kw).choices[0]
    full = ask()
    stop = full.text[len(full.text) // 2:][:3]
    assert stop
    cut = ask(stop=[stop])
    assert cut.text == full.text[:full.text.index(stop)]
    assert cut.finish_reason == "stop"
    assert full.model_extra["token_ids"][:len(cut.model_extra["token_ids"])] == \
        cut.model_extra["token_ids"]


@pytest.mark.parametrize("kwargs,param,code", [
    (dict(max_tokens=0), "max_tokens", "invalid_value"),
    (dict(model="no-such-model"), "model", "model_not_found"),
    (dict(prompt="word " * MAX_CONTEXT), "prompt", "context_length_exceeded"),
    (dict(prompt="word " * (MAX_CONTEXT - 20), max_tokens=30), "max_tokens",
     "context_length_exceeded"),
    (dict(temperature="hot"), "temperature", "invalid_value"),
    (dict(n=0), "n", "invalid_value"),
    (dict(suffix="!"), "suffix", "unsupported_parameter"),
    (dict(echo=True, stream=True), "echo", "unsupported_parameter"),
])
def test_a_bad_request_is_a_400_and_the_server_goes_on(server, kwargs, param, code):
    request = dict(model="tiny-llama", prompt="Hello", max_tokens=4) | kwargs
    with pytest.raises(openai.BadRequestError) as raised:
        server.client.completions.create(**request)
    assert raised.value.status_code == 400
    error = raised.value.body
    assert set(error) >= {"message", "type", "param", "code"}, error
    assert error["param"] == param and error["code"] == code, error
    out = server.client.completions.create(model="tiny-llama", prompt="Hello", max_tokens=2)
    assert out.choices[0].finish_reason in ("stop", "length")


def test_malformed_json_is_a_400(server):
    request = urllib.request.Request(server.base + "/v1/completions", data=b"{not json",
                                     headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as raised:
        urllib.request.urlopen(request, timeout=10)
    assert raised.value.code == 400
    assert set(json.loads(raised.value.read())["error"]) == {"message", "type", "param", "code"}


@pytest.mark.slow
def test_smollm2_serves_greedy_completions_equal_to_transformers(tmp_path):
    """The contract command on the bundled SmolLM2-135M-Instruct (GGUF, dequantised)."""
    served = Server("smollm2", tmp_path, start_timeout_s=600)
    try:
        out = served.client.completions.create(
            model="SmolLM2-135M-Instruct", prompt="The capital of France is", max_tokens=16,
            temperature=0, logprobs=0, extra_body={"return_token_ids": True})
        [choice] = out.choices
        prompt_ids = choice.model_extra["prompt_token_ids"]
        path = bundled_smollm2_path()
        reference = transformers.AutoModelForCausalLM.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32)
        expected, expected_logprobs = greedy_reference(reference, prompt_ids, 16)
        assert choice.model_extra["token_ids"] == expected
        np.testing.assert_allclose(choice.logprobs.token_logprobs, expected_logprobs, atol=2e-3)
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            outs = list(pool.map(lambda i: served.client.chat.completions.create(
                model="SmolLM2-135M-Instruct", max_tokens=8, temperature=0.7, seed=i,
                messages=[{"role": "user", "content": f"Say a number above {i}."}]), range(8)))
        assert all(o.choices[0].message.content is not None for o in outs)
        assert max(c["requests"] for c in served.stats()[1:]) >= 2
    finally:
        assert served.stop() == 0
