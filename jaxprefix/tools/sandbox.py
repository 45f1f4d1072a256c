"""Where model-written code runs: a bubblewrap (bwrap) sandbox around a capped interpreter.

    limits = PythonLimits()                      # isolation="sandbox": bwrap, or refused
    unavailable(limits.bwrap)                    # "" where a sandbox starts (probed once)
    ran = run("print(1)", limits)                # Ran(returncode=0, text="1\n", stopped="")

Each call runs `python -I -S -u` (unbuffered: its output and its traceback in the order they
were written) in a fresh temporary directory with an empty environment, under
RLIMIT_CPU, RLIMIT_AS, RLIMIT_FSIZE (its merged stdout and stderr go to an unnamed file: a flood
stops at the cap) and RLIMIT_CORE 0, killed at a wall-clock timeout. With isolation="sandbox"
(the default) bwrap puts it in namespaces of its own (docs/TOOLS.md, "The sandbox"):

  --unshare-net                      no network: only a loopback of its own, nothing listening
  --unshare-pid --proc /proc         its own pid namespace: no other process is visible; when
  --die-with-parent                  its first process exits or this one dies, all of its
                                     processes are killed (a setsid'd grandchild too)
  --unshare-ipc --unshare-uts        no shared memory or hostname of the host's
  --new-session                      no terminal to inject keystrokes into (TIOCSTI)
  --ro-bind /usr, the interpreter's  the filesystem: the system's programs and libraries and
  prefix; --remount-ro /             the interpreter, read-only; nothing else of the host
  --bind TEMPDIR /tmp                (no /home, /root, /etc, /work); writable: its own /tmp
  --cap-drop ALL                     no capability survives into the code

A prelude then caps its processes (RLIMIT_NPROC = `processes`: a fork bomb fails at the cap)
and, where this process is root, switches to a uid of the call's own: the kernel never applies
RLIMIT_NPROC to uid 0, so only for that the sandbox keeps CAP_SETUID/CAP_SETGID, which the
switch drops. As another user bwrap makes a user namespace (--unshare-user, --disable-userns:
no nested one), in which the cap counts only the call's own processes.

`run` classifies what stopped a call (`Ran.stopped`): a refusal of the sandbox (REFUSALS: the
network, a read-only filesystem, a path it hides, the process cap), read off the error the
code died of, or a cap that ended it (KILLS). isolation="capped_subprocess" keeps the caps
without the sandbox (the code sees the network and every file its user can read) and is only
what a user asks for by that name.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile

ISOLATIONS = ("sandbox", "capped_subprocess")
# What the sandbox refused the code, read off the error it died of.
REFUSALS = ("network", "read_only", "hidden", "processes")
# What a cap ended: the wall clock, CPU seconds, the address space, output bytes, a SIGKILL
# (the hard CPU cap, or the kernel out of memory).
KILLS = ("timeout", "cpu", "memory", "output", "killed")

# The first uid of the calls' own uids (root only): far above any account's, one per call.
_FIRST_UID = 1_000_000_000
_calls = itertools.count()
# Runs in the sandbox before the code: the process cap, the uid switch, then the code itself,
# in an empty environment (bwrap sets PWD).
_PRELUDE = ("import os, resource, sys\n"
            "processes, uid = int(sys.argv[1]), int(sys.argv[2])\n"
            "resource.setrlimit(resource.RLIMIT_NPROC, (processes, processes))\n"
            "if uid:\n"
            "    os.setgroups([]); os.setgid(uid); os.setuid(uid)\n"
            "os.chdir('/tmp')\n"
            "os.execve(sys.executable,\n"
            "          [sys.executable, '-I', '-S', '-u', '-c', sys.argv[3]], {})\n")


@dataclasses.dataclass(frozen=True)
class PythonLimits:
    """One call's caps (CPU seconds, address space in MiB, wall seconds, output bytes,
    processes at once: the sandbox's) and its isolation: 'sandbox' (bwrap, the binary `bwrap`)
    or 'capped_subprocess' (the caps alone)."""
    cpu_s: int = 2
    memory_mb: int = 512
    wall_s: float = 5.0
    output_bytes: int = 16_384
    processes: int = 32
    isolation: str = "sandbox"
    bwrap: str = "bwrap"

    def __post_init__(self):
        for name in ("cpu_s", "memory_mb", "wall_s", "output_bytes", "processes"):
            if not getattr(self, name) > 0:
                raise ValueError(f"config.tools.python.{name}={getattr(self, name)!r}: "
                                 f"expected > 0")
        if self.isolation not in ISOLATIONS:
            raise ValueError(f"config.tools.python.isolation={self.isolation!r}: expected one of "
                             f"{list(ISOLATIONS)}")


@dataclasses.dataclass(frozen=True)
class Ran:
    """A call's exit status (negative: the signal), its output (cut at the cap) and what
    stopped it ('' nothing; else one of REFUSALS or KILLS)."""
    returncode: int
    text: str
    stopped: str = ""


@functools.lru_cache(maxsize=None)
def unavailable(bwrap: str = "bwrap") -> str:
    """Why no sandbox starts with the binary `bwrap` ('' where one does): probed once, by
    running a program in it."""
    if shutil.which(bwrap) is None:
        return f"{bwrap!r} not found (Debian/Ubuntu: apt-get install bubblewrap)"
    ran = run("print('sandboxed')", PythonLimits(wall_s=30.0, bwrap=bwrap), probe=False)
    if ran.returncode == 0 and ran.text == "sandboxed\n":
        return ""
    lines = ran.text.strip().splitlines() or [f"exit status {ran.returncode}"]
    return f"{bwrap} fails here: {lines[-1]}"


def command(code: str, workdir: str, limits: PythonLimits, uid: int) -> list[str]:
    """The bwrap command line running `code` in the sandbox, `workdir` its /tmp; `uid` the
    call's own uid (root) or 0 (another user: the user namespace's)."""
    python, prefix = os.path.realpath(sys.executable), os.path.realpath(sys.base_prefix)
    argv = [limits.bwrap, "--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts",
            "--unshare-cgroup-try", "--die-with-parent", "--new-session", "--cap-drop", "ALL"]
    argv += (["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"] if uid else
             ["--unshare-user", "--disable-userns"])
    for path in ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64"):
        if os.path.islink(path):  # merged /usr: /lib -> usr/lib
            argv += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            argv += ["--ro-bind", path, path]
    # The loader's cache alone of /etc: where a shared libpython lies (/usr/local/lib).
    argv += ["--perms", "0755", "--dir", "/etc",
             "--ro-bind-try", "/etc/ld.so.cache", "/etc/ld.so.cache"]
    binary_dir = os.path.dirname(python)
    for root in [prefix] + ([] if binary_dir.startswith(prefix + "/") else [binary_dir]):
        if root != "/usr" and not root.startswith("/usr/"):
            # Its parents are made traversable: a prefix under /root (pyenv) is one's own.
            for parent in _parents(root):
                argv += ["--perms", "0755", "--dir", parent]
            argv += ["--ro-bind", root, root]
    argv += ["--bind", workdir, "/tmp", "--proc", "/proc", "--dev", "/dev", "--remount-ro", "/"]
    return argv + [python, "-I", "-S", "-c", _PRELUDE, str(limits.processes), str(uid), code]


def _parents(path: str) -> list[str]:
    """The directories above `path`, outermost first, '/' left out."""
    parent = os.path.dirname(path)
    return [] if parent in ("/", "") else _parents(parent) + [parent]


def _caps(limits: PythonLimits):
    """The child's caps, set between fork and exec (the parent is not touched)."""
    def apply():
        resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s + 1))
        memory = limits.memory_mb * 2 ** 20
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
        resource.setrlimit(resource.RLIMIT_FSIZE, (limits.output_bytes, limits.output_bytes))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    return apply


def run(code: str, limits: PythonLimits = PythonLimits(), probe: bool = True) -> Ran:
    """Runs `code` under `limits`; stdout and stderr merged. With isolation='sandbox' where
    none starts (`probe`), nothing runs: an error Ran saying why."""
    sandboxed = limits.isolation == "sandbox"
    if sandboxed and probe and (why := unavailable(limits.bwrap)):
        return Ran(1, f"no sandbox: {why}")
    with tempfile.TemporaryDirectory(prefix="jaxprefix_tool_") as workdir, \
            tempfile.TemporaryFile() as output:
        uid = 0
        if sandboxed:
            if os.geteuid() == 0:
                # One uid per call (and per process of ours): their process caps are apart.
                uid = _FIRST_UID + (os.getpid() % 2 ** 16) * 2 ** 12 + next(_calls) % 2 ** 12
                os.chown(workdir, uid, uid)
            argv = command(code, workdir, limits, uid)
        else:
            argv = [sys.executable, "-I", "-S", "-u", "-c", code]
        process = subprocess.Popen(argv, cwd=workdir, env={}, stdin=subprocess.DEVNULL,
                                   stdout=output, stderr=subprocess.STDOUT,
                                   preexec_fn=_caps(limits), start_new_session=True,
                                   close_fds=True)
        try:
            returncode, timed_out = process.wait(timeout=limits.wall_s), False
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)  # bwrap with it: the sandbox's all go
            returncode, timed_out = process.wait(), True
        if sandboxed and 128 < returncode <= 128 + 64:
            returncode = 128 - returncode  # bwrap reports a signal's death as 128 + signal
        if not timed_out:  # children left running die with it
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        # Python ignores SIGXFSZ: a write past RLIMIT_FSIZE fails (EFBIG) and the file stays
        # at the cap, which is how a flood is told from output that merely fits.
        flooded = os.fstat(output.fileno()).st_size >= limits.output_bytes
        output.seek(0)
        text = output.read(limits.output_bytes).decode("utf-8", errors="replace")
    return Ran(returncode, text, _stopped(returncode, text, timed_out, flooded, sandboxed))


def _stopped(returncode: int, text: str, timed_out: bool, flooded: bool,
             sandboxed: bool) -> str:
    """What stopped a call: a refusal of the sandbox (from the error the code died of), a cap,
    or nothing ('')."""
    if sandboxed and returncode != 0 and ("[Errno 11] Resource temporarily unavailable" in text
                                          or "can't start new thread" in text):
        return "processes"  # a fork or thread past RLIMIT_NPROC (a bomb: many such lines)
    if timed_out:
        return "timeout"
    if returncode == -signal.SIGXCPU:  # the soft RLIMIT_CPU
        return "cpu"
    if returncode == -signal.SIGKILL:
        return "killed"
    if flooded or returncode == -signal.SIGXFSZ:
        return "output"
    if returncode == 0:
        return ""
    if "MemoryError" in last_line(text):
        return "memory"
    return _refusal(last_line(text)) if sandboxed else ""


def _refusal(last: str) -> str:
    """The sandbox's refusal that `last` (an uncaught error's line) reports, or ''."""
    if re.search(r"ConnectionRefusedError|Network is unreachable|gaierror|"
                 r"Cannot assign requested address|\[Errno (101|111|99)\]", last):
        return "network"  # nothing listens in its network namespace, nothing routes out
    if "[Errno 30]" in last:
        return "read_only"
    found = re.search(r"(PermissionError|FileNotFoundError|NotADirectoryError): .*?'(/[^']*)'",
                      last)
    if found:
        error, path = found.groups()
        # There on the host (or, outside its own /tmp, its directory is), not in the sandbox.
        if error == "PermissionError" or os.path.lexists(path) or (
                not path.startswith("/tmp/") and os.path.isdir(os.path.dirname(path))):
            return "hidden"
    return ""


def last_line(text: str) -> str:
    """The last non-blank line of a call's output (an uncaught error's), or ''."""
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""
