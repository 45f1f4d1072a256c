"""jaxprefix entry point: a config file, a working directory, one job.

    python -m jaxprefix.main --config=configs/pope.py                 # the CPU demo
    python -m jaxprefix.main --config=configs/grpo.py:smoke --workdir=/tmp/grpo
    python -m jaxprefix.main --config=configs/pope.py:rl --workdir=/tmp/pope --config.train.total_steps=300

`config.job` picks the job (sft, mine, rl, eval, sweep, fit, demo, results, export,
compile); each is one function in jaxprefix/jobs/ that tests call directly. Without --workdir a
run writes to runs/<config>-<variant>. Running the same command again in the same workdir resumes from the last checkpoint. The workdir
and every path field may be local or gs:// (jaxprefix.storage).
"""
from __future__ import annotations

import importlib
import logging as std_logging  # absl's WARNING constant is its own verbosity, not a record level
import os

from absl import app, flags, logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "A configs/*.py file[:variant].",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Where checkpoints, metrics and reports go.")
flags.mark_flags_as_required(["config"])

# job name -> (module in jaxprefix.jobs, function(config, workdir))
JOBS = {
    "sft": ("sft", "run_sft"),
    "mine": ("mine", "run_mine"),
    "rl": ("rl", "run_rl"),
    "eval": ("evaluate", "run_eval"),
    "sweep": ("isocompute", "run_sweep"),
    "fit": ("isocompute", "run_fit"),
    "demo": ("demo", "run_demo"),
    "results": ("results", "run_results"),
    "export": ("export", "run_export"),
    "compile": ("compile", "run_compile"),
}


def default_workdir(config_arg: str) -> str:
    path, _, variant = config_arg.partition(":")
    name = os.path.splitext(os.path.basename(path))[0]
    return os.path.join("runs", f"{name}-{(variant or 'demo').split(',')[0]}")


class _OnlyOurInfo:
    """Keeps INFO lines of jaxprefix and drops the libraries' (orbax logs every file it writes)."""

    def filter(self, record) -> bool:
        return record.levelno >= std_logging.WARNING or f"{os.sep}jaxprefix{os.sep}" in record.pathname


def remote_paths(config, workdir: str) -> list[str]:
    """The workdir and every config string that is a URL (gs://...): what needs a storage backend."""
    found = [workdir]

    def visit(value):
        if isinstance(value, str):
            found.append(value)
        elif hasattr(value, "items"):
            for item in value.values():
                visit(item)
    visit(config)
    return [p for p in found if "://" in p]


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    logging.get_absl_handler().addFilter(_OnlyOurInfo())
    config = _CONFIG.value
    if config.job not in JOBS:
        raise app.UsageError(f"config.job={config.job!r}: expected one of {sorted(JOBS)}")
    from jaxprefix import distributed, storage

    workdir = _WORKDIR.value or default_workdir(flags.FLAGS["config"].serialize().split("=", 1)[1])
    try:  # before any work: a missing client package or bucket is a one-line error
        for path in remote_paths(config, workdir):
            storage.require_backend(path)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    distributed.initialize(config.distributed)
    logging.info("job %s, workdir %s", config.job, workdir)
    module, function = JOBS[config.job]
    run = getattr(importlib.import_module(f"jaxprefix.jobs.{module}"), function)
    from jaxprefix.rl.loop import Preempted

    try:
        run(config, workdir)
    except Preempted as e:
        logging.warning("%s", e)
        raise SystemExit(143)


if __name__ == "__main__":
    app.run(main)
