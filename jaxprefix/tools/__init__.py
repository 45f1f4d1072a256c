"""Tools a policy calls in multi-turn rollouts (docs/TOOLS.md).

    registry = tools.registry(["calculator", "my_tools.py:lookup"])
    registry.run("calculator", {"expression": "12 * 13"})   -> ToolResult("156", ok=True)

A name is a built-in (`calculator`; `read_key`, the built-in tool task's; `python`, opt-in:
`python=PythonLimits(...)`) or a 'FILE.py:FUNCTION' of the user's. Layering: tools sit above sampling and tokenizers (the
reference rollout calls `sampling.generate`) and below rl, which trains on their episodes.
"""
from __future__ import annotations

from typing import Sequence

from jaxprefix.tools.api import DEFAULT_MAX_CHARS, Registry, Tool, ToolResult, call, error, \
    from_file
from jaxprefix.data.tasks import keyed_multiplication as _keyed
from jaxprefix.tools.calculator import CALCULATOR
from jaxprefix.tools.environments import Environment
from jaxprefix.tools.python_tool import python_tool
from jaxprefix.tools.sandbox import PythonLimits

# read_key: the built-in tool task's key reader (keyed_multiplication's environment calls it).
READ_KEY = Tool("read_key", _keyed.read_key, "Reads d and c off the key by the rule",
                {"rule": {"type": "string"}, "key": {"type": "string"}})
# read_key_blind: the tool study's control, called as read_key, answering by rule '<' whatever
# rule is asked (on a hard problem never what the answer needs).
READ_KEY_BLIND = Tool("read_key", _keyed.read_key_blind,
                      "Reads two digits off the key (rule '<' whatever the rule)",
                      READ_KEY.parameters)
BUILTIN = {"calculator": CALCULATOR, "read_key": READ_KEY, "read_key_blind": READ_KEY_BLIND}


def registry(names: Sequence[str], python: PythonLimits | None = None,
             field: str = "config.tools.names") -> Registry:
    """The tools named: built-ins by name, user tools as 'FILE.py:FUNCTION'. `python` (None:
    off) enables the python tool under those limits; naming it without is a one-line error."""
    tools = []
    for name in names:
        if ":" in name:
            tools.append(from_file(name, field))
        elif name in BUILTIN:
            tools.append(BUILTIN[name])
        elif name == "python":
            if python is None:
                raise ValueError(f"{field}: 'python' runs model-written code and is opt-in: "
                                 "expected tools.python.enabled=True (docs/TOOLS.md)")
            tools.append(python_tool(python))
        else:
            raise ValueError(f"{field}: unknown tool {name!r}: expected one of "
                             f"{sorted([*BUILTIN, 'python'])} or FILE.py:FUNCTION")
    return Registry(tools)


__all__ = ["BUILTIN", "DEFAULT_MAX_CHARS", "Environment", "PythonLimits", "Registry", "Tool", "ToolResult",
           "call", "error", "from_file", "python_tool", "registry"]
