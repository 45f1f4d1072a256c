"""Tool calls in the chat template's own format, parsed from an assistant turn's text.

    hermes  (Qwen2.5/Qwen3, Hermes, SmolLM2):  <tool_call>{"name": "calculator",
                                               "arguments": {"expression": "2+3"}}</tool_call>
    llama3  (Llama 3.1/3.2 JSON tool calling): {"name": "calculator",
                                               "parameters": {"expression": "2+3"}}
            the whole turn is the JSON object, optionally after <|python_tag|>

A turn may hold several Hermes calls; each is a `ToolCall`. A call the model meant but wrote
wrongly (bad JSON, no name, arguments that are not an object) is still a ToolCall, with `error`
set: the rollout answers it with that error as the observation, as if a tool had failed, so the
policy sees (and is scored on) its own malformed call instead of the episode silently ending.
"""
from __future__ import annotations

import dataclasses
import json
import re
from typing import Callable

_HERMES = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
# Markup a Llama 3 turn may end or start with, around its JSON call.
_LLAMA3_MARKUP = ("<|python_tag|>", "<|eom_id|>", "<|eot_id|>", "<|end_of_text|>")


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One call: the tool's name and its JSON-object arguments; `error` when malformed."""
    name: str
    arguments: dict
    error: str | None = None


def _call(payload: str, arguments_key: str) -> ToolCall:
    try:
        value = json.loads(payload)
    except json.JSONDecodeError as e:
        return ToolCall("", {}, f"tool call is not valid JSON ({e.msg} at column {e.colno})")
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return ToolCall("", {}, 'tool call must be a JSON object with a string "name"')
    arguments = value.get(arguments_key, value.get("arguments", value.get("parameters", {})))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    if not isinstance(arguments, dict):
        return ToolCall(value["name"], {}, f'tool call "{arguments_key}" must be a JSON object')
    return ToolCall(value["name"], arguments)


def parse_hermes(text: str) -> list[ToolCall]:
    """Every <tool_call>JSON</tool_call> block of `text` (an unclosed final block included)."""
    return [_call(m.group(1).strip(), "arguments") for m in _HERMES.finditer(text)]


def parse_llama3(text: str) -> list[ToolCall]:
    """The turn's JSON call, when the turn (markup aside) is one JSON object with a "name"."""
    body = text
    for markup in _LLAMA3_MARKUP:
        body = body.replace(markup, "")
    body = body.strip()
    if not body.startswith("{"):
        return []  # prose: a final answer, not a call
    call = _call(body, "parameters")
    if call.error and '"name"' not in body:
        return []  # JSON-looking prose without a name is an answer
    return [call]


PARSERS: dict[str, Callable[[str], list[ToolCall]]] = {
    "hermes": parse_hermes, "llama3": parse_llama3}


def format_for(chat_template: str | None) -> str:
    """The call format a chat template speaks: llama3 where it mentions Llama 3's
    <|python_tag|> or "parameters" calls, else hermes (<tool_call>, also SmolLM2's)."""
    template = chat_template or ""
    if "<|python_tag|>" in template or ("<|eot_id|>" in template and "<tool_call>" not in template):
        return "llama3"
    return "hermes"


def parser(name: str, field: str = "config.tools.format") -> Callable[[str], list[ToolCall]]:
    if name not in PARSERS:
        raise ValueError(f"{field}={name!r}: expected one of {sorted(PARSERS)}")
    return PARSERS[name]
