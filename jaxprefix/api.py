"""The Python door: a job run from a notebook or a script, on the path `python -m jaxprefix.main`
takes (the same checks before any work, the same workdir lock, the same job functions).

    from jaxprefix import api

    def reward(completion: str, problem) -> float:      # any callable, a notebook's own too
        return float(problem.answer in completion)

    rows = api.run("configs/grpo.py:smoke", "/tmp/grpo", reward=reward,
                   overrides={"train.total_steps": 4})
    rows[-1]["reward/mean"]                              # the metrics rows, one per logged step

`config` is a config file (`path[:variant]`, as --config takes it) or a config built in Python
(run_config.from_file, then set fields); `overrides` are dotted fields as --config.<field> takes
them, a value in its Python type or its command-line text. Running the same call again resumes
from the last checkpoint. A bad input raises errors.UserError (main prints it as one line); an
interrupted run raises rl.loop.Preempted after its checkpoint.
"""
from __future__ import annotations

import ast
import copy
import importlib
import os
from collections.abc import Callable, Mapping

import ml_collections

# job name -> (module in jaxprefix.jobs, function(config, workdir))
JOBS = {
    "sft": ("sft", "run_sft"),
    "mine": ("mine", "run_mine"),
    "rl": ("rl", "run_rl"),
    "eval": ("evaluate", "run_eval"),
    "sweep": ("isocompute", "run_sweep"),
    "fit": ("isocompute", "run_fit"),
    "prereg": ("isocompute_prereg", "run_prereg"),
    "demo": ("demo", "run_demo"),
    "results": ("results", "run_results"),
    "export": ("export", "run_export"),
    "compile": ("compile", "run_compile"),
    "tools": ("tool_study", "run_tool_study"),
    "serve": ("serve", "run_serve"),
}
READ_ONLY_JOBS = ("eval", "fit")  # they write their report, never checkpoints or metrics


def default_workdir(config_arg: str) -> str:
    """runs/<config file>-<variant>: where a run without a workdir writes."""
    path, _, variant = config_arg.partition(":")
    name = os.path.splitext(os.path.basename(path))[0]
    return os.path.join("runs", f"{name}-{(variant or 'demo').split(',')[0]}")


def remote_paths(config, workdir: str) -> list[str]:
    """The workdir and every config string that is a URL (gs://...): what needs a storage backend.
    The compile job reads no data or weights (the model path only when reachable), so only its
    own config.json path counts."""
    found = [workdir]

    def visit(value):
        if isinstance(value, str):
            found.append(value)
        elif hasattr(value, "items"):
            for item in value.values():
                visit(item)
    visit(config.compile if config.job == "compile" else config)
    from jaxprefix import storage  # a placeholder the job reads was refused; the others are unread

    return [p for p in found if "://" in p and not storage.is_placeholder(p)]


def execute(config: ml_collections.ConfigDict, workdir: str, overrides=frozenset()) -> None:
    """Runs `config.job` in `workdir`: checks every input first (preflight, writing nothing),
    then the job under the workdir's lock. `overrides` names the fields the command line set
    (preflight puts a variant's fields they moot back at their defaults). Raises what the job
    raises; main turns an anticipated failure into its one line."""
    if config.job not in JOBS:
        from jaxprefix.errors import ConfigError

        raise ConfigError(f"config.job={config.job!r}: expected one of {sorted(JOBS)}")
    from absl import logging

    from jaxprefix import distributed, errors, rewards, storage
    from jaxprefix.run_setup import preflight
    from jaxprefix.storage import workdir_lock

    try:
        storage.faults.set_deadline((config.get("storage") or {}).get(
            "retry_deadline_s", storage.faults.DEFAULT_DEADLINE_S))
    except ValueError as e:
        raise errors.ConfigError(str(e)) from None
    preflight.refuse_placeholders(config, workdir)  # gs://YOUR_BUCKET/...: never tried
    for path in remote_paths(config, workdir):  # a missing client package or bucket
        try:
            storage.require_backend(path)
        except ValueError as e:
            raise errors.ConfigError(str(e)) from None
    distributed.initialize(config.distributed)
    distributed.enable_compilation_cache(storage.join(storage.cache_dir(), "xla"))
    logging.info("job %s, workdir %s", config.job, workdir)
    for field in preflight.reset_mooted(config, overrides):
        logging.info("config.%s: set by the config file, not read once the command line's "
                     "changes apply; back at its default", field)
    settings = preflight.check(config, workdir)  # reads every input; writes nothing
    # every verifier worker's cap (configs/sft.py has no rewards block: it scores nothing)
    rewards.set_max_memory_mb((config.get("rewards") or {}).get(
        "max_memory_mb", rewards.pool.DEFAULT_MAX_MEMORY_MB))
    module, function = JOBS[config.job]
    job = getattr(importlib.import_module(f"jaxprefix.jobs.{module}"), function)
    kwargs = {} if settings is None else {"settings": settings}  # rl's, resolved: not again
    if config.job in READ_ONLY_JOBS:  # may read a workdir while its run goes on
        job(config, workdir, **kwargs)
    else:
        with workdir_lock.hold(workdir, workdir_lock.LockSettings.from_config(config)):
            job(config, workdir, **kwargs)


def run(config: str | ml_collections.ConfigDict, workdir: str | None = None, *,
        reward: Callable | None = None, overrides: Mapping[str, object] | None = None
        ) -> list[dict]:
    """Runs a job from Python (see the module's docstring); returns the workdir's metrics rows
    in step order (none for a job that logs no steps)."""
    from jaxprefix import run_config

    if isinstance(config, str):
        path, _, variant = config.partition(":")
        workdir = workdir or default_workdir(config)
        config = run_config.from_file(path, variant)
    elif workdir is None:
        raise TypeError("api.run: a config built in Python needs a workdir")
    config = copy.deepcopy(config)  # the caller's config stays as it was
    overrides = dict(overrides or {})
    if reward is not None:
        overrides["data.verifier"] = register_reward(reward)
    try:
        for field, value in overrides.items():
            set_field(config, field, value)
        execute(config, workdir, frozenset(overrides))
    finally:  # the reward is this run's: the process's verifiers are as they were
        if reward is not None:
            from jaxprefix import rewards

            rewards.unregister(overrides["data.verifier"])
    from jaxprefix import storage
    from jaxprefix.rl.metrics import read_metrics

    has_rows = storage.exists(storage.join(workdir, "metrics.jsonl"))
    return read_metrics(workdir) if has_rows else []


def register_reward(fn: Callable) -> str:
    """Registers `fn(completion, problem) -> float` as a verifier; returns its name. A function
    worker processes can import runs in them; any other (a notebook's, a closure) in this
    process, under the same per-answer timeout."""
    from jaxprefix import rewards

    name = f"python:{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"
    try:
        rewards.register(name, fn, overwrite=True)
    except ValueError:  # not importable by a worker
        rewards.register(name, fn, in_process=True, overwrite=True)
    return name


def set_field(config: ml_collections.ConfigDict, field: str, value) -> None:
    """config.<field> = value, a value given as command-line text parsed to the field's type."""
    from jaxprefix.errors import ConfigError

    *blocks, leaf = field.split(".")
    node = config
    for block in blocks:
        if block not in node:
            raise ConfigError(f"overrides[{field!r}]: no config block {block!r}")
        node = node[block]
    if leaf not in node:
        raise ConfigError(f"overrides[{field!r}]: no such config field")
    current = node[leaf]
    if isinstance(value, str) and current is not None and not isinstance(current, str):
        try:
            value = ast.literal_eval({"true": "True", "false": "False"}.get(value, value))
        except (ValueError, SyntaxError):
            raise ConfigError(f"overrides[{field!r}]={value!r}: expected a value of type "
                              f"{type(current).__name__}") from None
    try:
        node[leaf] = value
    except TypeError as e:
        raise ConfigError(f"overrides[{field!r}]={value!r}: {e}") from None

