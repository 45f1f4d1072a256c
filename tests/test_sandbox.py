"""The python tool's sandbox (tools/sandbox.py): model-written code that reaches for the network,
writes outside its directory, forks a bomb or reads another process's files is stopped and
counted, leaves nothing running, and ordinary code still runs; where no sandbox starts, the
python tool is refused in one line unless the capped subprocess is chosen by name."""
import os
import socket
import time

import pytest

import numpy as np

from jaxprefix.tools import ToolResult, call, sandbox
from jaxprefix.tools.episodes import Episode, episode_metrics
from jaxprefix.tools.python_tool import PythonLimits, python_tool, run_code

WHY_NOT = sandbox.unavailable()
needs_sandbox = pytest.mark.skipif(bool(WHY_NOT), reason=f"no sandbox here: {WHY_NOT}")
# wall_s well above cpu_s: on a loaded machine the CPU cap, not the clock, stops a loop.
LIMITS = PythonLimits(cpu_s=2, memory_mb=256, wall_s=20.0, output_bytes=8192, processes=16)


def _left_running(marker: str) -> list[str]:
    """Host processes whose command line holds `marker` (the code of a call carries it)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    found.append(pid)
        except OSError:  # gone meanwhile
            pass
    return found


def _none_left(marker: str) -> bool:
    """True once no process carries `marker` (the pid namespace dies with its first process;
    its members are reaped within moments)."""
    deadline = time.monotonic() + 5
    while _left_running(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not _left_running(marker)


@needs_sandbox
def test_ordinary_code_runs_and_returns_its_output():
    code = ("import json, math, os\nopen('notes.txt', 'w').write('kept')\n"
            "print(json.dumps([math.factorial(5), open('notes.txt').read(), os.getcwd()]))")
    assert run_code(code, LIMITS) == ToolResult('[120, "kept", "/tmp"]\n', ok=True)


@needs_sandbox
def test_a_socket_even_to_this_hosts_loopback_is_refused_and_counted():
    with socket.socket() as server:  # listening on the host's 127.0.0.1: the sandbox's is its own
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.settimeout(0)
        port = server.getsockname()[1]
        for code in (f"import socket\nsocket.create_connection(('127.0.0.1', {port}))",
                     "import socket\nsocket.create_connection(('example.com', 80))",
                     "import urllib.request\nurllib.request.urlopen('http://10.0.0.1/')"):
            result = run_code(code, LIMITS)
            assert not result.ok and result.stopped == "network", (code, result)
            assert "(the sandbox has no network)" in result.text
        with pytest.raises(BlockingIOError):
            server.accept()  # nothing came through


@needs_sandbox
@pytest.mark.parametrize("path", ["/usr/escaped.txt", "/escaped.txt", "/etc/escaped.txt",
                                  "/proc/sys/kernel/hostname"])
def test_writing_outside_its_directory_is_refused_and_counted(path):
    result = run_code(f"open({path!r}, 'w').write('x')", LIMITS)
    assert not result.ok and result.stopped in ("read_only", "hidden"), result
    assert not os.path.exists(path) or open(path).read() != "x"


@needs_sandbox
def test_a_host_file_is_neither_read_nor_written(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("hunter2")
    for code in (f"print(open({str(secret)!r}).read())",
                 f"open({str(secret)!r}, 'w').write('overwritten')",
                 f"import os\nos.remove({str(secret)!r})"):
        result = run_code(code, LIMITS)
        assert not result.ok and result.stopped == "hidden", (code, result)
        assert "hunter2" not in result.text
    assert secret.read_text() == "hunter2"


@needs_sandbox
def test_another_process_files_are_not_readable(monkeypatch):
    """Its /proc is its own pid namespace's: the test's process is not there, and pid 1 is the
    sandbox's own (bwrap's, not this host's init), out of its reach."""
    monkeypatch.setenv("JAXPREFIX_TEST_SECRET", "hunter2")
    for path in (f"/proc/{os.getpid()}/cmdline", f"/proc/{os.getpid()}/environ",
                 "/proc/1/environ"):
        result = run_code(f"print(open({path!r}, 'rb').read())", LIMITS)
        assert "hunter2" not in result.text and "pytest" not in result.text, (path, result)
        if path != "/proc/1/environ" or os.geteuid() == 0:  # as root its pid 1 is root's
            assert not result.ok and result.stopped == "hidden", (path, result)
    listing = run_code("import os\nprint(sorted(int(p) for p in os.listdir('/proc') "
                       "if p.isdigit()))", LIMITS)
    assert max(eval(listing.text)) < 10  # its own few processes, numbered from 1


@needs_sandbox
def test_a_fork_bomb_is_stopped_counted_and_leaves_nothing_running():
    marker = "fork_bomb_marker_5c1f"
    started = time.monotonic()
    result = run_code(f"import os  # {marker}\nwhile True:\n    os.fork()", LIMITS)
    assert result.stopped == "processes" and not result.ok, result
    assert result.text == ("error: python: BlockingIOError: no more processes (the sandbox caps "
                           "them at 16)")
    assert time.monotonic() - started < LIMITS.wall_s  # stopped by the cap, not the clock
    assert _none_left(marker)


@needs_sandbox
def test_children_it_leaves_behind_die_with_it():
    """A child that calls setsid() and outlives its parent, or a hang killed at the wall clock:
    either way no process of the call survives it."""
    marker = "orphan_marker_9d2e"
    code = (f"import os, time  # {marker}\nif os.fork() == 0:\n    os.setsid()\n"
            f"    time.sleep(600)\nprint('parent done')")
    assert run_code(code, LIMITS).text == "parent done\n"
    assert _none_left(marker)
    hang = PythonLimits(cpu_s=2, memory_mb=256, wall_s=1.0, output_bytes=8192)
    result = run_code(f"import os, time  # {marker}\nos.fork()\ntime.sleep(600)", hang)
    assert result.stopped == "timeout"
    assert _none_left(marker)


@needs_sandbox
def test_the_caps_still_stop_and_count():
    cases = {"while True:\n    pass": "cpu", "x = bytearray(10 ** 10)": "memory",
             "print('y' * 10 ** 6)": "output"}
    for code, kind in cases.items():
        assert run_code(code, LIMITS).stopped == kind, code


@needs_sandbox
def test_episode_metrics_count_refusals_and_kills():
    results = [run_code(code, LIMITS) for code in (
        "import socket\nsocket.create_connection(('127.0.0.1', 9))",   # refused
        "open('/usr/x', 'w')",                                          # refused
        "bytearray(10 ** 10)",                                          # a cap
        "print(6 * 7)", "raise ValueError('boom')")]                    # neither
    tokens = np.zeros(4, np.int32)
    episode = Episode(tokens, tokens, tokens.astype(np.float32), 1, (1,), len(results),
                      sum(not r.ok for r in results), "answer", 0,
                      stopped=tuple(r.stopped for r in results if r.stopped))
    metrics = episode_metrics([episode])
    assert (metrics["rollout/sandbox_refusals"], metrics["rollout/sandbox_kills"]) == (2.0, 1.0)
    assert metrics["rollout/tool_failures"] == 4.0


def test_no_sandbox_refuses_the_python_tool_in_one_line():
    """Pointed at a bwrap that is not there (the same probe a machine without bubblewrap
    fails), the python tool is refused naming the field and the opt-out; the capped
    subprocess, chosen by name, still runs."""
    missing = PythonLimits(bwrap="/nonexistent/bwrap")
    assert sandbox.unavailable(missing.bwrap).startswith("'/nonexistent/bwrap' not found")
    with pytest.raises(ValueError) as e:
        python_tool(missing)
    assert str(e.value).startswith(
        "config.tools.python.isolation='sandbox': expected a sandbox for the python tool's "
        "model-written code, and none starts here ('/nonexistent/bwrap' not found")
    assert "tools.python.isolation='capped_subprocess'" in str(e.value)
    assert "\n" not in str(e.value)
    # Asked to run anyway, it runs nothing unsandboxed.
    refused = run_code("print('ran')", missing)
    assert not refused.ok and "ran" not in refused.text.replace("error:", "")
    capped = PythonLimits(isolation="capped_subprocess", bwrap="/nonexistent/bwrap")
    assert call(python_tool(capped), {"code": "print(6 * 7)"}).text == "42\n"


def test_isolation_is_checked():
    with pytest.raises(ValueError, match=r"config.tools.python.isolation='docker': expected "
                                         r"one of \['sandbox', 'capped_subprocess'\]"):
        PythonLimits(isolation="docker")
