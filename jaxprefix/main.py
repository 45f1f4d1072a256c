"""jaxprefix entry point: a config file, a working directory, one job.

    python -m jaxprefix.main --config=configs/pope.py                 # the CPU demo
    python -m jaxprefix.main --config=configs/grpo.py:smoke --workdir=/tmp/grpo
    python -m jaxprefix.main --config=configs/pope.py:rl --workdir=/tmp/pope --config.train.total_steps=300

`config.job` picks the job (sft, mine, rl, eval, sweep, fit, prereg, demo, results, export,
compile, tools, serve; `describe` prints every field with its value and what it does, and runs nothing); each is one function in jaxprefix/jobs/ that tests call directly. Without --workdir a
run writes to runs/<config>-<variant>. Running the same command again in the same workdir resumes from the last checkpoint. The workdir
and every path field may be local or gs:// (jaxprefix.storage).

An anticipated failure (bad config field, data file, model, checkpoint, a workdir held by another
run, a full disk, a missing package, storage refusing a write) prints one line, `error: <what>,
<where>, <expected>`, and exits 1 (2 for a bad command line; 75 for an outage to wait out:
GCS down past config.storage.retry_deadline_s, a lost host of a multi-host run, after which the
same command resumes); a traceback means a bug, or `--verbose`.
"""
from __future__ import annotations

import logging as std_logging  # absl's WARNING constant is its own verbosity, not a record level
import os
import sys

from absl import app, flags, logging
from ml_collections import config_flags

from jaxprefix.api import JOBS, default_workdir  # the jobs and the door main shares with Python

_CONFIG = config_flags.DEFINE_config_file("config", None, "A configs/*.py file[:variant].",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Where checkpoints, metrics and reports go.")
_VERBOSE = flags.DEFINE_bool("verbose", False, "Tracebacks for anticipated failures too.")
flags.mark_flags_as_required(["config"])


class _OnlyOurInfo:
    """Keeps INFO lines of jaxprefix and drops the libraries' (orbax logs every file it writes),
    and the libraries' tracebacks of storage failures (orbax logs each from each of its save
    threads): the run retries those, or reports them in one line (storage/faults.py)."""

    def filter(self, record) -> bool:
        from jaxprefix import storage

        ours = f"{os.sep}jaxprefix{os.sep}" in record.pathname
        if not ours and record.exc_info and storage.faults.classify(record.exc_info[1]):
            return _VERBOSE.value
        return record.levelno >= std_logging.WARNING or ours


def parse_flags(argv: list[str]) -> list[str]:
    """absl's flag parsing, with a bad --config or --config.<field> reported as one line."""
    try:
        return flags.FLAGS(argv)
    except flags.Error as e:  # a value of the wrong type, a config file that raised
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        head = lines[0].rstrip(":")
        reason = lines[-1] if len(lines) > 1 else ""
        _exit_with(f"error: {head}{': ' + reason if reason else ''}", 2)
    except (AttributeError, KeyError) as e:  # ml_collections on a field the config lacks
        _exit_with(f"error: {_unknown_field(argv, e)}", 2)


def _unknown_field(argv: list[str], error: Exception) -> str:
    """`--config.trian.total_steps=1: no such config field 'trian.total_steps'; ... (nearest:
    'train.total_steps')`: the override naming a field the config lacks, and the closest names
    of that config (config_fields.nearest over its leaves)."""
    from jaxprefix import config_fields, run_config

    config_arg = next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")), "")
    try:
        names = [n for n, _ in config_fields.leaves(run_config.from_file(
            *config_arg.split(":", 1)))]
    except Exception:  # noqa: BLE001  (the config loaded before the override failed; be safe)
        names = []
    blocks = {n.rsplit(".", i)[0] for n in names for i in range(1, n.count(".") + 1)}
    for arg in argv:
        if arg.startswith("--config.") and "=" in arg:
            field = arg.split("=", 1)[0].removeprefix("--config.")
            if names and field not in names and field not in blocks:
                close = config_fields.nearest(field, names)
                hint = f" (nearest: {', '.join(repr(c) for c in close)})" if close else ""
                return (f"{arg}: no such config field {field!r}; expected a field of the config "
                        f"file (python -m jaxprefix.main --config={config_arg} "
                        f"--config.job=describe lists them){hint}")
    return f"--config: no such config field: {str(error).splitlines()[0]}"


def _exit_with(line: str, status: int):
    from tqdm import tqdm

    for bar in list(getattr(tqdm, "_instances", ())):  # an open bar would share the error's line
        bar.close()
    sys.stderr.write(line + "\n")
    sys.stdout.flush()
    sys.stderr.flush()
    # Not sys.exit: at exit Python joins every non-daemon thread, and a storage client's worker
    # stuck on the failure that stopped the run (orbax's async save, a GCS retry) would hold the
    # process open with no end; the run has nothing left to write.
    os._exit(status)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    logging.get_absl_handler().addFilter(_OnlyOurInfo())
    config = _CONFIG.value
    if config.job == "describe":  # every field, its value and what it does; nothing runs
        from jaxprefix import config_fields, run_config

        print("\n".join(config_fields.describe(config, run_config.field_docs(config))))
        return
    if config.job not in JOBS:
        raise app.UsageError(f"config.job={config.job!r}: expected one of {sorted(JOBS)}")
    from jaxprefix import api, distributed, errors
    from jaxprefix.rl.loop import Preempted

    try:
        workdir = _WORKDIR.value or default_workdir(flags.FLAGS["config"].serialize().split("=", 1)[1])
        overrides = {a.split("=", 1)[0].removeprefix("--config.") for a in sys.argv[1:]
                     if a.startswith("--config.")}
        try:
            api.execute(config, workdir, overrides)
        except Preempted as e:
            logging.warning("%s", e)
            raise SystemExit(143)
    except Exception as e:  # noqa: BLE001  (an anticipated failure is one line; a bug re-raises)
        line = errors.one_line(e)
        if line is None:
            distributed.wait_for_lost_peer()  # a collective broken by a lost host: its line
        if line is None or _VERBOSE.value:
            raise
        _exit_with(line, getattr(e, "exit_status", 1))


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)
