"""The `python` tool, opt-in only: model-written code in a fresh, capped subprocess per call.

    tool = python_tool(PythonLimits(cpu_s=2, memory_mb=512, wall_s=5))
    call(tool, {"code": "print(sum(range(10)))"})   ->  ToolResult("45\n", ok=True)

Each call runs `python -I -S` (isolated: no PYTHON* variables, no site-packages, no user
site) in a new session, with an EMPTY environment (no variable of this process, so no
credentials held in it), in an empty temporary working directory deleted afterwards, under
RLIMIT_CPU (CPU seconds), RLIMIT_AS (address space), RLIMIT_FSIZE (its combined stdout and
stderr go to a file in that directory: printing megabytes stops at the cap) and RLIMIT_CORE 0,
and a wall-clock timeout after which its whole process group is killed. A call that crashes,
hangs, allocates without bound or prints past the cap answers a one-line error observation.

What the caps do NOT stop (docs/TOOLS.md, threat model): the code runs as this user, so it can
read any file this user can read (outside its directory too) and reach the network; there is no
namespace, seccomp filter or container. Enable it only where that is acceptable. (The one
variable the child's environment holds is LC_CTYPE, which the interpreter sets itself: PEP 538.)
"""
from __future__ import annotations

import dataclasses
import os
import resource
import signal
import subprocess
import sys
import tempfile

from jaxprefix.tools.api import Tool, ToolResult, error

_OUTPUT_FILE = "output.txt"


@dataclasses.dataclass(frozen=True)
class PythonLimits:
    """Caps of one call: CPU seconds, address space (MiB), wall seconds, output bytes."""
    cpu_s: int = 2
    memory_mb: int = 512
    wall_s: float = 5.0
    output_bytes: int = 16_384

    def __post_init__(self):
        for name in ("cpu_s", "memory_mb", "wall_s", "output_bytes"):
            if not getattr(self, name) > 0:
                raise ValueError(f"tools.python.{name}={getattr(self, name)!r}: expected > 0")


def _limit(limits: PythonLimits):
    """The child's caps, set between fork and exec (the parent is not touched)."""
    def apply():
        resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s + 1))
        memory = limits.memory_mb * 2 ** 20
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
        resource.setrlimit(resource.RLIMIT_FSIZE, (limits.output_bytes, limits.output_bytes))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    return apply


def _signal_name(returncode: int) -> str:
    try:
        return signal.Signals(-returncode).name
    except ValueError:
        return f"signal {-returncode}"


def run_code(code: str, limits: PythonLimits = PythonLimits()) -> ToolResult:
    """Runs `code` under `limits`; stdout and stderr (merged) are the observation."""
    if not isinstance(code, str):
        return error(f"python: code must be a string, got {type(code).__name__}")
    with tempfile.TemporaryDirectory(prefix="jaxprefix_tool_") as workdir:
        output_path = os.path.join(workdir, _OUTPUT_FILE)
        with open(output_path, "wb") as output:
            process = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", code], cwd=workdir, env={},
                stdin=subprocess.DEVNULL, stdout=output, stderr=subprocess.STDOUT,
                preexec_fn=_limit(limits), start_new_session=True, close_fds=True)
            try:
                returncode = process.wait(timeout=limits.wall_s)
                timed_out = False
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)  # its children too (own session)
                returncode, timed_out = process.wait(), True
            if not timed_out:  # children it left running die with it
                try:
                    os.killpg(process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        # Python ignores SIGXFSZ: a write past RLIMIT_FSIZE fails (EFBIG) and the file stays
        # at the cap, which is how a flood is told from output that merely fits.
        flooded = os.path.getsize(output_path) >= limits.output_bytes
        with open(output_path, "rb") as f:
            text = f.read(limits.output_bytes).decode("utf-8", errors="replace")
    if timed_out:
        return error(f"python: timed out after {limits.wall_s:g} s wall clock")
    if returncode == -signal.SIGXCPU:  # the soft RLIMIT_CPU
        return error(f"python: CPU time limit of {limits.cpu_s} s exceeded")
    if returncode == -signal.SIGKILL:
        return error(f"python: killed by SIGKILL (the hard CPU time limit of {limits.cpu_s + 1} "
                     "s, or the kernel out of memory)")
    if flooded or returncode == -signal.SIGXFSZ:
        return error(f"python: output over {limits.output_bytes} bytes")
    if returncode < 0:
        return error(f"python: killed by {_signal_name(returncode)}")
    if returncode != 0:
        lines = [line for line in text.strip().splitlines() if line.strip()]
        last = lines[-1] if lines else f"exit status {returncode}"
        if "MemoryError" in last:
            last = f"MemoryError (address space capped at {limits.memory_mb} MiB)"
        return error(f"python: {last}")
    return ToolResult(text, ok=True)


def python_tool(limits: PythonLimits = PythonLimits()) -> Tool:
    """The `python` tool under `limits`: argument 'code', its printed output as observation."""
    def python(arguments: dict) -> ToolResult:
        if "code" not in arguments:
            return error(f"python: expected argument 'code', got {sorted(arguments)}")
        return run_code(arguments["code"], limits)
    return Tool("python", python, "Runs Python code; what it prints is the result.",
                {"code": {"type": "string", "description": "a Python program that prints"}})
