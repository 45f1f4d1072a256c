"""Environments: how an episode's turns meet its tools.

A problem opens an episode: its first prompt is the context the method asks for (POPE's
guidance sits there, in the first user turn). The environment then decides three things, and
nothing else:

    tools    the Registry a call's name is looked up in
    parse    a sampled turn's text -> its tool calls ([] : the turn is the final answer)
    observe  the calls' results (and the stop token the turn ended on) -> the token ids
             appended before the next turn

The rollout (tools/episodes.py) ends an episode at a final answer, `max_turns` or the token
budget, and the verifier scores its last turn. Environments by name:

    chat                   the chat template's own call format (Hermes <tool_call> JSON,
                           Llama 3 JSON; tools.format) and its tool turn (observations.py)
    keyed_multiplication   the built-in tool task: the key reader called in the task's own
                           symbols (data/tasks/keyed_multiplication.py, docs/TOOLS.md)
    FILE.py:NAME           a user's: NAME(tokenizer, tools) -> Environment
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

from jaxprefix.data.tasks import keyed_multiplication as keyed
from jaxprefix.rewards import from_file as _files
from jaxprefix.tokenizers.chars import CONCATENATE_CONTENTS
from jaxprefix.tools.api import Registry, ToolResult
from jaxprefix.tools.calls import ToolCall, format_for, parser
from jaxprefix.tools.observations import observation_tokens


@dataclasses.dataclass(frozen=True)
class Environment:
    tools: Registry
    parse: Callable[[str], list[ToolCall]]
    observe: Callable[[Sequence[ToolResult], int | None], list[int]]

    def rollout_keywords(self) -> dict:
        """What an episode rollout (tools/episodes.py) takes of the environment."""
        return dict(tools=self.tools, parse=self.parse, observe=self.observe)


def chat(tokenizer, tools: Registry, format: str = "") -> Environment:
    """Calls in the chat template's format (`format`: '' reads it off the template), results
    appended as the template's own tool turn."""
    if tokenizer.chat_template in (None, CONCATENATE_CONTENTS):  # a task's characters: none
        raise ValueError(f"config.tools.environment='chat': {tokenizer.source} has no chat "
                         f"template to render a tool turn with; expected a chat model, or a "
                         f"built-in task's environment")
    parse = parser(format or format_for(tokenizer.chat_template))

    def observe(results, sampled_stop):
        return observation_tokens(tokenizer, [r.text for r in results], sampled_stop)
    return Environment(tools, parse, observe)


def keyed_multiplication(tokenizer, tools: Registry) -> Environment:
    """The built-in tool task: a turn that starts with the task's CALL asks the key reader
    (`read_key`) for d and c; its answer, or '__' when the call failed (an error line is not in
    the task's vocabulary), comes back as 'dc='."""
    if "read_key" not in tools:
        raise ValueError("config.tools.names: the keyed_multiplication environment calls "
                         "'read_key'; expected it among the tools (the built-in or a "
                         "FILE.py:read_key)")

    def parse(text: str) -> list[ToolCall]:
        arguments = keyed.call_arguments(text)
        return [] if arguments is None else [ToolCall("read_key", arguments)]

    def observe(results, sampled_stop):
        (result,) = results
        return tokenizer.encode(keyed.observation_text(result.text if result.ok else None))
    return Environment(tools, parse, observe)


BUILTIN = {"chat": chat, "keyed_multiplication": keyed_multiplication}


def environment(name: str, tokenizer, tools: Registry, *, format: str = "",
                field: str = "config.tools.environment") -> Environment:
    """The environment `name` (a built-in, or FILE.py:NAME) over `tools`; one-line errors."""
    if ":" in name:
        made = _files.load(name, field).fn(tokenizer, tools)
        if not isinstance(made, Environment):
            raise ValueError(f"{field}={name!r}: returned {type(made).__name__}, expected a "
                             f"jaxprefix.tools.Environment")
        return made
    if name not in BUILTIN:
        raise ValueError(f"{field}={name!r}: expected one of {sorted(BUILTIN)} or FILE.py:NAME")
    if format and name != "chat":
        raise ValueError(f"config.tools.format={format!r} is set but the {name} environment "
                         f"has its own call format; expected tools.format=''")
    return chat(tokenizer, tools, format) if name == "chat" else BUILTIN[name](tokenizer, tools)
