"""The OpenAI-compatible HTTP layer: requests parsed and checked into SampleRequests, responses
built from the batcher's Samples (docs/SERVING.md).

Endpoints: /v1/models, /v1/completions, /v1/chat/completions (the model's chat template),
vLLM's token-in, token-out /inference/v1/generate (verifiers' training client), vLLM's
/tokenize and /detokenize (a prompt's or a chat's token ids, for token-in turns), /health and
/stats (the recent sampler calls: requests and rows each). Besides OpenAI's fields, vLLM's that
RL clients use: `return_token_ids` (the prompt's and each choice's token ids:
`prompt_token_ids` and `token_ids`, as vLLM names them), `return_tokens_as_token_ids`, `top_k`,
`stop_token_ids`, chat's `add_generation_prompt` and `continue_final_message`. Chat's `tools` go to the chat
template, and calls written in its format (tools/calls.py) come back as `tool_calls`. A request this server cannot honour
(bad values, an unknown model, too long a context, a field it does not implement) is a 400 with
OpenAI's error object; the server goes on. `stream: true` answers in server-sent events
(streamed.py, streaming.py). Before any endpoint, the gate (gate.py) checks the API key, the
body's size and the requests in flight, and cancels a request whose client left.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid

import fastapi
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from jaxprefix.serving import streamed, streaming
from jaxprefix.serving.batcher import MAX_N, Sample, SampleRequest
from jaxprefix.serving.gate import Gate, Load
from jaxprefix.serving.requests import (ChatRequest, CompletionRequest, DetokenizeRequest,
                                        GenerateRequest, Sampled, SamplingParams,
                                        TokenizeRequest)
from jaxprefix.tools import calls


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, code: str = "invalid_value"):
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


def error_body(message: str, param: str | None, code: str,
               kind: str = "invalid_request_error") -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


UNSUPPORTED = {"presence_penalty": 0.0, "frequency_penalty": 0.0,
               "logit_bias": None, "suffix": None, "response_format": None}


class Api:
    """What the endpoints need: the batcher, the tokenizer and the limits; `sampling` (a
    training server, live.py: temperature, top_p, top_k) the sampling every request must ask
    for, the one the learner scores the returned log-probs at."""

    def __init__(self, batcher, tokenizer, settings, model_context: int,
                 sampling: dict | None = None):
        self.batcher, self.tokenizer, self.settings = batcher, tokenizer, settings
        self.context_limit = settings.context_limit(model_context)
        self.vocab_size = batcher.model.config.vocab_size
        self.sampling = sampling
        self.load = Load()  # the gate's count of requests in flight and refused

    # --- requests -> SampleRequests --------------------------------------------------------

    def check_common(self, body: Sampled) -> None:
        s = self.settings
        if body.model != s.model_name:
            raise BadRequest(f"The model `{body.model}` does not exist; this server serves "
                             f"`{s.model_name}`", "model", "model_not_found")
        if self.sampling is not None:
            asked = {"temperature": body.temperature, "top_p": body.top_p,
                     "top_k": max(body.top_k, 0)}
            for field, value in self.sampling.items():
                if asked[field] != value:
                    raise BadRequest(f"{field}={asked[field]}: this server samples a policy in "
                                     f"training, whose learner scores the run's {field}={value}; "
                                     f"expected the sampling_args given to the environment, "
                                     f"unchanged", field)
        for field, default in UNSUPPORTED.items():
            value = getattr(body, field, default)
            if value and value != default:  # an empty list or dict asks for nothing either
                raise BadRequest(f"{field} is not supported by this server; expected it left "
                                 f"out", field, "unsupported_parameter")
        if body.stream_options is not None and not body.stream:
            raise BadRequest("stream_options is only allowed with stream: true",
                             "stream_options")
        if getattr(body, "best_of", None) not in (None, body.n):
            raise BadRequest("best_of is not supported; expected it left out or equal to n",
                             "best_of", "unsupported_parameter")
        limit = min(MAX_N, s.max_batch_rows)
        if not 1 <= body.n <= limit:
            raise BadRequest(f"n={body.n}: expected 1 <= n <= {limit}", "n")
        if not body.temperature >= 0:
            raise BadRequest(f"temperature={body.temperature}: expected >= 0", "temperature")
        if not 0 < body.top_p <= 1:
            raise BadRequest(f"top_p={body.top_p}: expected 0 < top_p <= 1", "top_p")
        if body.top_k < -1:
            raise BadRequest(f"top_k={body.top_k}: expected >= 0 (0 or -1: off)", "top_k")

    def sample_request(self, body: Sampled, prompt: list[int], max_tokens: int | None,
                       top_logprobs: int, param: str, echo: bool = False) -> SampleRequest:
        """The request of one prompt. With echo, max_tokens may be 0 (the prompt scored alone:
        one token is drawn, for the call, and left out of the answer)."""
        if not prompt:
            raise BadRequest("the prompt is empty; expected at least one token", param)
        if min(prompt) < 0 or max(prompt) >= self.vocab_size:
            raise BadRequest(f"prompt token ids must be in [0, {self.vocab_size})", param)
        left = self.context_limit - len(prompt)
        if left < 1:
            raise BadRequest(f"This model's maximum context length is {self.context_limit} "
                             f"tokens, and the prompt has {len(prompt)}; expected a shorter "
                             f"prompt", param, "context_length_exceeded")
        if max_tokens is None:
            max_tokens = min(self.settings.max_tokens, left)
        elif echo and max_tokens == 0:
            max_tokens = 1
        elif not 1 <= max_tokens <= self.settings.max_tokens:
            raise BadRequest(f"max_tokens={max_tokens}: expected 1 <= max_tokens <= "
                             f"{self.settings.max_tokens}", "max_tokens")
        elif max_tokens > left:
            raise BadRequest(f"This model's maximum context length is {self.context_limit} "
                             f"tokens; you asked for {len(prompt) + max_tokens} ({len(prompt)} "
                             f"in the prompt, {max_tokens} new); expected fewer",
                             "max_tokens", "context_length_exceeded")
        if not 0 <= top_logprobs <= self.settings.max_top_logprobs:
            raise BadRequest(f"logprobs={top_logprobs}: expected 0 <= logprobs <= "
                             f"{self.settings.max_top_logprobs}", "logprobs")
        return SampleRequest(prompt=tuple(prompt), n=body.n, max_tokens=max_tokens,
                             temperature=body.temperature, top_p=body.top_p,
                             top_k=max(body.top_k, 0), seed=body.seed, top_logprobs=top_logprobs,
                             echo=echo)

    def completion_prompts(self, body: CompletionRequest) -> list[list[int]]:
        prompt = body.prompt
        if isinstance(prompt, str):
            prompts = [prompt]
        elif prompt and all(isinstance(p, int) for p in prompt):
            prompts = [prompt]
        else:
            prompts = list(prompt)
        if not prompts:
            raise BadRequest("prompt is empty; expected text or token ids", "prompt")
        return [self.tokenizer.encode(p, add_special_tokens=True) if isinstance(p, str)
                else list(p) for p in prompts]

    def call_format(self, body: ChatRequest) -> str | None:
        """The template's tool-call format when the request offers tools, else None."""
        if body.tool_choice not in (None, "auto", "none"):
            raise BadRequest("tool_choice: only 'auto' and 'none' are supported", "tool_choice",
                             "unsupported_parameter")
        if not body.tools or body.tool_choice == "none":
            return None
        return calls.format_for(self.tokenizer.chat_template)

    def chat_prompt(self, body: ChatRequest) -> list[int]:
        messages = [dict(m, content=_text_of(m.get("content"))) for m in body.messages]
        try:
            return self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=body.add_generation_prompt,
                continue_final_message=body.continue_final_message, tokenize=True,
                tools=body.tools or None)
        except Exception as e:  # noqa: BLE001  (a template's own error on these messages)
            raise BadRequest(f"messages: the chat template refused them: {e}", "messages")

    async def sample(self, requests: list[SampleRequest]) -> list[list[Sample]]:
        futures = [asyncio.wrap_future(self.batcher.submit(r)) for r in requests]
        return await asyncio.gather(*futures)

    # --- Samples -> choices ----------------------------------------------------------------

    def finish(self, sample: Sample, body: SamplingParams) -> tuple[Sample, str, str]:
        """(the sample cut after its first of body.stop_token_ids and before its first of
        body.stop strings, its text, finish_reason)."""
        stop_ids = set(body.stop_token_ids or ())
        cut = next((i + 1 for i, t in enumerate(sample.token_ids) if t in stop_ids), None)
        if cut is not None:
            sample = _first(sample, cut)
        stop = streaming.stops(body.stop)
        text = self.tokenizer.decode(sample.token_ids, skip_special_tokens=True)
        hits = [(text.find(s), s) for s in stop if s and s in text]
        if not hits:
            return sample, text, "stop" if sample.stopped else "length"
        at, _ = min(hits)
        # The fewest tokens whose text holds a stop string (texts only grow with tokens).
        lo, hi = 1, len(sample.token_ids)
        while lo < hi:
            mid = (lo + hi) // 2
            prefix = self.tokenizer.decode(sample.token_ids[:mid], skip_special_tokens=True)
            lo, hi = (lo, mid) if any(s and s in prefix for s in stop) else (mid + 1, hi)
        return _first(sample, lo), text[:at], "stop"

    def head(self, response_id: str, kind: str) -> dict:
        """The fields a response (or each chunk of its stream) starts with."""
        return {"id": response_id, "object": kind, "created": int(time.time()),
                "model": self.settings.model_name}

    def token_text(self, token_id: int, as_ids: bool) -> str:
        return f"token_id:{token_id}" if as_ids else self.tokenizer.decode([token_id])

    def logprob_entries(self, token_ids, logprobs, alternatives, as_ids: bool,
                        offset: int = 0) -> dict:
        """A completion's `logprobs` object for these tokens: their texts, log-probabilities,
        the alternatives at each (the token itself among them; None where a position has none,
        as an echoed prompt's first token) and their text offsets from `offset`."""
        tokens = [self.token_text(t, as_ids) for t in token_ids]
        offsets, at = [], offset
        for token in tokens:
            offsets.append(at)
            at += len(token)
        top = None
        if alternatives is not None:
            top = [None if alts is None else
                   {self.token_text(t, as_ids): value for t, value in [*alts, (token, logprob)]}
                   for alts, token, logprob in zip(alternatives, token_ids, logprobs)]
        return {"tokens": tokens, "token_logprobs": list(logprobs), "top_logprobs": top,
                "text_offset": offsets}

    def completion_logprobs(self, sample: Sample, as_ids: bool) -> dict:
        return self.logprob_entries(sample.token_ids, sample.logprobs, sample.top_logprobs,
                                    as_ids)

    def echoed_logprobs(self, prompt: list[int], sample: Sample, as_ids: bool) -> dict:
        """OpenAI's echo: the prompt's tokens ahead of the completion's, the first without a
        log-probability (nothing predicts it), offsets running on through the completion."""
        alternatives = sample.prompt_top_logprobs
        head = self.logprob_entries(prompt, [None, *sample.prompt_logprobs],
                                    None if alternatives is None else [None, *alternatives],
                                    as_ids)
        tail = self.logprob_entries(sample.token_ids, sample.logprobs, sample.top_logprobs,
                                    as_ids, offset=sum(map(len, head["tokens"])))
        joined = {key: head[key] + tail[key] for key in ("tokens", "token_logprobs",
                                                         "text_offset")}
        joined["top_logprobs"] = None if head["top_logprobs"] is None else \
            head["top_logprobs"] + tail["top_logprobs"]
        return joined

    def chat_logprobs(self, sample: Sample, as_ids: bool) -> dict:
        def entry(token_id, logprob):
            text = self.token_text(token_id, as_ids)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}
        alternatives = sample.top_logprobs or [[] for _ in sample.token_ids]
        return {"content": [{**entry(t, lp), "top_logprobs": [entry(*a) for a in alts]}
                            for t, lp, alts in zip(sample.token_ids, sample.logprobs,
                                                   alternatives)]}


def assistant_message(content: str, raw: str, call_format: str | None) -> dict:
    """A chat choice's message. With tools offered (`call_format`, the template's), the calls
    that `raw` (the text with special tokens) makes in that format become OpenAI's tool_calls
    and the content is the text before them; a malformed call stays text."""
    found = [c for c in calls.parser(call_format)(raw) if not c.error] if call_format else []
    if not found:
        return {"role": "assistant", "content": content}
    before = content.split("<tool_call>")[0].strip() if call_format == "hermes" else ""
    return {"role": "assistant", "content": before or None, "tool_calls": [
        {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
         "function": {"name": c.name, "arguments": json.dumps(c.arguments)}} for c in found]}


def _text_of(content) -> str:
    """A message's content as text: a string, or OpenAI's list of parts (text parts joined)."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict)
                       and p.get("type") == "text")
    raise BadRequest("messages[].content: expected a string or a list of text parts",
                     "messages")


def _first(sample: Sample, count: int, stopped: bool = True) -> Sample:
    """The sample's first `count` tokens, ended by a stop (a stop token or string) unless
    `stopped` is False."""
    top = sample.top_logprobs
    return dataclasses.replace(sample, token_ids=sample.token_ids[:count],
                               logprobs=sample.logprobs[:count], stopped=stopped,
                               top_logprobs=None if top is None else top[:count])


def server_error(e: Exception) -> JSONResponse:
    """The sampler's failure: a 500, the server goes on."""
    return JSONResponse(error_body(f"the sampler failed: {type(e).__name__}: {e}", None,
                                   "internal_error", "server_error"), status_code=500)




def make_app(api: Api) -> fastapi.FastAPI:
    app = fastapi.FastAPI(title="jaxprefix")
    s = api.settings
    app.add_middleware(Gate, api_key=s.api_key, max_body_bytes=s.max_body_bytes,
                       max_in_flight=s.max_in_flight, load=api.load)

    @app.exception_handler(BadRequest)
    async def bad_request(_, e: BadRequest):
        return JSONResponse(error_body(e.message, e.param, e.code), status_code=400)

    @app.exception_handler(RequestValidationError)
    async def invalid(_, e: RequestValidationError):
        first = e.errors()[0]
        if first.get("type") == "json_invalid":
            reason = first.get("ctx", {}).get("error")
            return JSONResponse(error_body(f"the body is not JSON: {reason} (at character "
                                           f"{first['loc'][-1]})", None, "invalid_value"),
                                status_code=400)
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        return JSONResponse(error_body(f"{where or 'body'}: {first.get('msg')}", where or None,
                                       "invalid_value"), status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(_, e: HTTPException):  # fastapi's own: a body it could not parse
        return JSONResponse(error_body(f"{e.detail}", None, "invalid_value"),
                            status_code=e.status_code, headers=e.headers)

    @app.exception_handler(Exception)
    async def failed(_, e: Exception):
        return server_error(e)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/stats")
    async def stats():
        return {"sampler_calls": list(api.batcher.calls), "in_flight": api.load.in_flight,
                "refused": dict(api.load.refused), "client_left": api.load.client_left,
                "dropped_requests": api.batcher.dropped,
                "abandoned_calls": api.batcher.abandoned}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": api.settings.model_name, "object": "model", "created": 0,
            "owned_by": "jaxprefix", "max_model_len": api.context_limit}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest):
        api.check_common(body)
        if body.echo and body.stream:
            raise BadRequest("echo with stream: true is not supported; expected one of them",
                             "echo", "unsupported_parameter")
        prompts = api.completion_prompts(body)
        requests = [api.sample_request(body, p, body.max_tokens, body.logprobs or 0, "prompt",
                                       echo=body.echo) for p in prompts]
        head = api.head(f"cmpl-{uuid.uuid4().hex}", "text_completion")
        nothing_new = body.echo and body.max_tokens == 0  # the prompt scored, no token drawn

        def finished(results):  # (index, prompt, sample, text, reason) of each choice
            return [(p * body.n + j, prompt,
                     *((_first(raw, 0, stopped=False), "", "length") if nothing_new else
                       api.finish(raw, body)))
                    for p, (prompt, result) in enumerate(zip(prompts, results))
                    for j, raw in enumerate(result)]

        def logprobs(prompt, sample):
            if body.logprobs is None:
                return None
            as_ids = body.return_tokens_as_token_ids
            return api.echoed_logprobs(prompt, sample, as_ids) if body.echo else \
                api.completion_logprobs(sample, as_ids)

        if body.stream:
            return streaming.EventStream(
                streamed.completion_events(api, body, prompts, requests, head), server_error)
        done = finished(await api.sample(requests))
        choices = []
        for index, prompt, sample, text, reason in done:
            if body.echo:  # the prompt as sent (a text prompt's own text), then the completion
                sent = body.prompt if isinstance(body.prompt, list) else [body.prompt]
                text = (sent[index // body.n] if isinstance(sent[index // body.n], str) else
                        api.tokenizer.decode(prompt)) + text
            choice = {"index": index, "text": text, "finish_reason": reason,
                      "logprobs": logprobs(prompt, sample)}
            if body.return_token_ids:
                choice |= {"prompt_token_ids": prompt, "token_ids": sample.token_ids}
            choices.append(choice)
        return head | {"choices": choices,
                       "usage": streaming.usage(sum(map(len, prompts)), [d[2] for d in done])}

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest):
        api.check_common(body)
        prompt = api.chat_prompt(body)
        call_format = api.call_format(body)
        top = (body.top_logprobs or 0) if body.logprobs else 0
        if body.top_logprobs and not body.logprobs:
            raise BadRequest("top_logprobs needs logprobs=true", "top_logprobs")
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None \
            else body.max_tokens
        request = api.sample_request(body, prompt, max_tokens, top, "messages")
        head = api.head(f"chatcmpl-{uuid.uuid4().hex}", "chat.completion")

        def message_of(sample, text):  # tool calls in the template's format become OpenAI's
            return assistant_message(text, api.tokenizer.decode(sample.token_ids), call_format)

        def finished(result):  # (sample, text, message, finish_reason, logprobs) per choice
            for drawn in result:
                sample, text, reason = api.finish(drawn, body)
                message = message_of(sample, text)
                yield (sample, text, message,
                       "tool_calls" if "tool_calls" in message else reason,
                       api.chat_logprobs(sample, body.return_tokens_as_token_ids)
                       if body.logprobs else None)

        if body.stream:
            head["object"] = "chat.completion.chunk"
            return streaming.EventStream(streamed.chat_events(
                api, body, prompt, request, head, call_format, message_of), server_error)
        [result] = await api.sample([request])
        choices, samples = [], []
        for j, (sample, _, message, reason, logprobs) in enumerate(finished(result)):
            samples.append(sample)
            choice = {"index": j, "message": message, "finish_reason": reason,
                      "logprobs": logprobs}
            if body.return_token_ids:
                choice["token_ids"] = sample.token_ids
            choices.append(choice)
        response = head | {"choices": choices, "usage": streaming.usage(len(prompt), samples)}
        if body.return_token_ids:
            response["prompt_token_ids"] = prompt
        return response

    def check_tokenizing(model: str | None) -> None:
        if model not in (None, api.settings.model_name):
            raise BadRequest(f"The model `{model}` does not exist; this server serves "
                             f"`{api.settings.model_name}`", "model", "model_not_found")

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        """The token ids a prompt, or a chat's messages, are sampled from (vLLM's /tokenize):
        what an environment appends to write a token-in turn."""
        check_tokenizing(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise BadRequest("expected one of prompt and messages", "prompt")
        if body.messages is not None:
            tokens = api.chat_prompt(ChatRequest(
                model=api.settings.model_name, messages=body.messages, tools=body.tools,
                add_generation_prompt=body.add_generation_prompt,
                continue_final_message=body.continue_final_message))
        else:
            tokens = api.tokenizer.encode(body.prompt,
                                          add_special_tokens=body.add_special_tokens)
        return {"count": len(tokens), "max_model_len": api.context_limit,
                "tokens": list(tokens)}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        check_tokenizing(body.model)
        if any(not 0 <= t < api.vocab_size for t in body.tokens):
            raise BadRequest(f"tokens: expected ids in [0, {api.vocab_size})", "tokens")
        return {"prompt": api.tokenizer.decode(body.tokens)}

    @app.post("/inference/v1/generate")
    async def generate(body: GenerateRequest):
        params = body.sampling_params
        sampled = Sampled(model=body.model, **params.model_dump(exclude={"logprobs"}))
        api.check_common(sampled)
        [result] = await api.sample([api.sample_request(
            sampled, body.token_ids, params.max_tokens, params.logprobs or 0, "token_ids")])
        choices, samples = [], []
        for j, drawn in enumerate(result):
            sample, _, reason = api.finish(drawn, params)
            samples.append(sample)
            choices.append({"index": j, "token_ids": sample.token_ids, "finish_reason": reason,
                            "logprobs": api.chat_logprobs(sample, as_ids=True)})
        return {"request_id": f"gen-{uuid.uuid4().hex}", "prompt_token_ids": body.token_ids,
                "choices": choices, "usage": streaming.usage(len(body.token_ids), samples)}

    return app
