"""The `python` tool, opt-in only: model-written code in a fresh sandbox per call (sandbox.py).

    tool = python_tool(PythonLimits(cpu_s=2, memory_mb=512, wall_s=5))
    call(tool, {"code": "print(sum(range(10)))"})   ->  ToolResult("45\n", ok=True)

Each call runs `python -I -S -u` (isolated: no PYTHON* variables, no site-packages, no user site)
with an EMPTY environment (no variable of this process, so no credentials held in it), in an
empty temporary directory deleted afterwards, under the caps of PythonLimits and, by default,
inside a bubblewrap sandbox: no network, the filesystem read-only but that directory, its own
pid namespace, a cap on its processes (docs/TOOLS.md, "The sandbox"). Building the tool where
no sandbox starts is refused in one line naming tools.python.isolation, unless the user chose
isolation='capped_subprocess' (the caps alone) by that name.

A call that crashes, hangs, allocates without bound, prints past the cap or is refused by the
sandbox answers a one-line error observation; `ToolResult.stopped` says which refusal or cap
it met (sandbox.REFUSALS, sandbox.KILLS), which the episodes count.
"""
from __future__ import annotations

import dataclasses
import signal

from jaxprefix.tools import sandbox
from jaxprefix.tools.api import Tool, ToolResult, error
from jaxprefix.tools.sandbox import PythonLimits

# What the observation adds to a refusal's error line: what the sandbox withholds.
_WHY = {"network": "the sandbox has no network", "read_only": "only its directory is writable",
        "hidden": "the sandbox shows only its own files and processes"}


def _signal_name(returncode: int) -> str:
    try:
        return signal.Signals(-returncode).name
    except ValueError:
        return f"signal {-returncode}"


def run_code(code: str, limits: PythonLimits = PythonLimits()) -> ToolResult:
    """Runs `code` under `limits`; stdout and stderr (merged) are the observation."""
    if not isinstance(code, str):
        return error(f"python: code must be a string, got {type(code).__name__}")
    ran = sandbox.run(code, limits)
    message = {
        "timeout": f"timed out after {limits.wall_s:g} s wall clock",
        "cpu": f"CPU time limit of {limits.cpu_s} s exceeded",
        "killed": f"killed by SIGKILL (the hard CPU time limit of {limits.cpu_s + 1} s, or "
                  f"the kernel out of memory)",
        "output": f"output over {limits.output_bytes} bytes",
        "memory": f"MemoryError (address space capped at {limits.memory_mb} MiB)",
        "processes": f"BlockingIOError: no more processes (the sandbox caps them at "
                     f"{limits.processes})",
    }.get(ran.stopped)
    if message is None and ran.returncode < 0:
        message = f"killed by {_signal_name(ran.returncode)}"
    if message is None and ran.returncode != 0:
        message = sandbox.last_line(ran.text) or f"exit status {ran.returncode}"
        if ran.stopped in _WHY:
            message += f" ({_WHY[ran.stopped]})"
    if message is None:
        return ToolResult(ran.text, ok=True)
    return dataclasses.replace(error(f"python: {message}"), stopped=ran.stopped)


def python_tool(limits: PythonLimits = PythonLimits()) -> Tool:
    """The `python` tool under `limits`: argument 'code', its printed output as observation.
    With isolation='sandbox' where no sandbox starts: a one-line ValueError."""
    if limits.isolation == "sandbox" and (why := sandbox.unavailable(limits.bwrap)):
        raise ValueError(
            f"config.tools.python.isolation='sandbox': expected a sandbox for the python tool's "
            f"model-written code, and none starts here ({why}); install bubblewrap, or set "
            f"tools.python.isolation='capped_subprocess' to run it under the caps alone, with "
            f"the network and every file this user can read (docs/TOOLS.md)")

    def python(arguments: dict) -> ToolResult:
        if "code" not in arguments:
            return error(f"python: expected argument 'code', got {sorted(arguments)}")
        return run_code(arguments["code"], limits)
    return Tool("python", python, "Runs Python code; what it prints is the result.",
                {"code": {"type": "string", "description": "a Python program that prints"}})
