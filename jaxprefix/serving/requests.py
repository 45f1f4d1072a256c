"""The request bodies the endpoints take (http_api.py), as pydantic parses them: OpenAI's fields
and the vLLM ones RL clients use. A field of the wrong type is a 400 before any endpoint runs."""
from __future__ import annotations

from typing import Union

import pydantic


class SamplingParams(pydantic.BaseModel):
    """How to sample: the fields every endpoint takes (vLLM's sampling_params of generate)."""
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                               # vLLM: 0 or -1 is off
    max_tokens: int | None = None
    stop: Union[str, list[str], None] = None
    stop_token_ids: list[int] | None = None      # vLLM: besides the model's end of turn
    seed: int | None = None


class StreamOptions(pydantic.BaseModel):
    include_usage: bool = False                  # a last chunk of the usage


class Sampled(SamplingParams):
    """Fields the OpenAI endpoints take."""
    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False               # vLLM
    return_tokens_as_token_ids: bool = False     # vLLM
    # OpenAI fields this server does not implement: refused unless left at these values.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict | None = None


class CompletionRequest(Sampled):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class GenerateParams(SamplingParams):
    logprobs: int | None = None                  # alternatives listed (the sampled token's
                                                 # log-probability is always returned)


class GenerateRequest(pydantic.BaseModel):
    """vLLM's token-in, token-out /inference/v1/generate (verifiers' training client)."""
    model: str
    token_ids: list[int]
    sampling_params: GenerateParams = GenerateParams()


class ChatRequest(Sampled):
    messages: list[dict]
    logprobs: bool = False
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True           # vLLM
    continue_final_message: bool = False         # vLLM
    tools: list[dict] | None = None
    tool_choice: Union[str, dict, None] = None
    response_format: dict | None = None


class TokenizeRequest(pydantic.BaseModel):
    """vLLM's /tokenize: a text `prompt`, or chat `messages` rendered by the model's template."""
    model: str | None = None
    prompt: str | None = None
    add_special_tokens: bool = True              # a prompt's (the template writes a chat's)
    messages: list[dict] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[dict] | None = None


class DetokenizeRequest(pydantic.BaseModel):
    model: str | None = None
    tokens: list[int]
