"""The tool API: a tool is a name and a function of a JSON-able argument dict -> observation text.

    def lookup(arguments: dict) -> str: ...
    tool = Tool("lookup", lookup, "reads a key")          # or, from a file:
    tool = from_file("my_tools.py:lookup")                # the function's name is the tool's

`call(tool, arguments)` is the only way the rollout runs a tool: whatever the function does
(raises, returns a non-string, returns megabytes) it answers a `ToolResult` whose text is at
most `max_chars` characters, and a failure is one line starting with "error:". It never raises
into the caller. What it cannot do in process is stop a function that hangs or allocates
without bound: tools that run untrusted code do it in a subprocess of their own (python_tool.py).
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Mapping

from jaxprefix.rewards import from_file as _files

DEFAULT_MAX_CHARS = 2000  # an observation's cap: a few hundred tokens appended to the episode


@dataclasses.dataclass(frozen=True)
class Tool:
    """`fn(arguments) -> str`; `description` is what a system prompt may say about the tool;
    `parameters` its JSON-schema 'properties' (for templates that render a tool list)."""
    name: str
    fn: Callable[[dict], str]
    description: str = ""
    parameters: Mapping[str, dict] = dataclasses.field(default_factory=dict)

    def schema(self) -> dict:
        """The OpenAI-style function schema chat templates render (`tools=[...]`)."""
        return {"type": "function", "function": {
            "name": self.name, "description": self.description,
            "parameters": {"type": "object", "properties": dict(self.parameters),
                           "required": sorted(self.parameters)}}}


@dataclasses.dataclass(frozen=True)
class ToolResult:
    """The observation text of one call; ok False: the call failed and `text` says how.
    `stopped`: what a sandbox refused or a cap ended ('' nothing; python_tool's calls)."""
    text: str
    ok: bool
    stopped: str = ""


def error(message: str, max_chars: int = DEFAULT_MAX_CHARS) -> ToolResult:
    """A failed call's observation: one line, "error: ...", at most max_chars characters."""
    line = " ".join(str(message).split()) or "unknown failure"
    return ToolResult(_truncate(f"error: {line}", min(max_chars, 300)), ok=False)


def _truncate(text: str, max_chars: int) -> str:
    if len(text) <= max_chars:
        return text
    marker = f"... [{len(text) - max_chars} more characters cut]"
    return text[:max(0, max_chars - len(marker))] + marker


def call(tool: Tool, arguments, max_chars: int = DEFAULT_MAX_CHARS) -> ToolResult:
    """Runs `tool` on `arguments`; never raises (except KeyboardInterrupt / SystemExit)."""
    if not isinstance(arguments, dict):
        return error(f"{tool.name}: arguments must be a JSON object, got "
                     f"{type(arguments).__name__}", max_chars)
    try:
        out = tool.fn(arguments)
    except Exception as e:  # a tool's failure is the model's observation, not the run's crash
        return error(f"{tool.name}: {type(e).__name__}: {e}", max_chars)
    if isinstance(out, ToolResult):
        return dataclasses.replace(out, text=_truncate(out.text, max_chars))
    if not isinstance(out, str):
        return error(f"{tool.name} returned {type(out).__name__}, expected str", max_chars)
    return ToolResult(_truncate(out, max_chars), ok=True)


def from_file(spec: str, field: str = "config.tools.path") -> Tool:
    """The tool `FUNCTION` of 'FILE.py:FUNCTION' (its docstring is the description), checked
    here; errors are one line naming `field`, the file and the function (as rewards.path)."""
    loaded = _files.load(spec, field)
    fn = loaded.fn
    return Tool(loaded.function, fn, (fn.__doc__ or "").strip().split("\n")[0])


class Registry:
    """Tools by name: what a parsed call's name is looked up in."""

    def __init__(self, tools=()):
        self._tools: dict[str, Tool] = {}
        for tool in tools:
            self.add(tool)

    def add(self, tool: Tool) -> None:
        if not tool.name.isidentifier():
            raise ValueError(f"tool name {tool.name!r}: expected an identifier")
        if tool.name in self._tools:
            raise ValueError(f"tool {tool.name!r} registered twice")
        self._tools[tool.name] = tool

    def __contains__(self, name) -> bool:
        return name in self._tools

    def __iter__(self):
        return iter(self._tools.values())

    def schemas(self) -> list[dict]:
        """The tools' function schemas, for a chat template's tool list (apply_chat_template)."""
        return [tool.schema() for tool in self]

    @property
    def names(self) -> list[str]:
        return sorted(self._tools)

    def run(self, name: str, arguments, max_chars: int = DEFAULT_MAX_CHARS) -> ToolResult:
        """The observation of calling tool `name`; an unknown name is an error observation."""
        if name not in self._tools:
            return error(f"no tool named {name!r} (tools: {', '.join(self.names) or 'none'})",
                         max_chars)
        return call(self._tools[name], arguments, max_chars)
