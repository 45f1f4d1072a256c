"""Run identity: the config that made a workdir, and the check a resume makes against it.

`<workdir>/run.json` records the whole resolved config and the code version of the run that
made the workdir. Rerunning a command resumes that run, so a resume under another config would
silently continue a different experiment (another learning rate, another n, another model whose
checkpoint does not fit). `claim` therefore compares: a change to any field that alters the
trajectory is refused, naming each field with both values; the fields of `MAY_CHANGE` (how long
and how visibly a run goes, on what hardware) may change freely, and
`--config.allow_changes=field,block,...` accepts the listed ones deliberately (the record is then
updated, with the change kept in its history).
"""
from __future__ import annotations

import datetime
import functools
import json
import os
import subprocess

from absl import logging

from jaxprefix import distributed, storage
from jaxprefix.config_reads import unwrapped
from jaxprefix.errors import ConfigError

RECORD = "run.json"
# Fields (or whole blocks) a resume may change: they steer how long a run goes, how often it
# evaluates, saves and logs, and where it runs, not which trajectory it follows. The IsoCompute
# sweep's grid is among them: a sweep point's own n, B, M and learning rate are in its fields.
SWEEP_GRID = ("isocompute.budgets", "isocompute.ns", "isocompute.batches", "isocompute.seeds",
              "isocompute.eval_every_rollouts", "isocompute.print_only", "isocompute.prereg")
# The sampler's memory and layout settings change its speed, never its rollouts.
SAMPLER_SPEED = tuple(f"rollout.{field}" for field in (
    "max_rows_in_flight", "kv_budget_gib", "memory_headroom", "page_size", "kv_reserve",
    "tensor_parallel"))
# The results and tools jobs' own blocks (which runs, seeds, regime settings) pick and size
# runs; a run reads its trajectory's fields from the blocks it sets, never from these.
MAY_CHANGE = ("train.total_steps", "eval", "checkpoint", "rewards.workers", "rewards.max_memory_mb",
              "mesh", "distributed", "workdir_lock", "storage", "metrics", "allow_changes",
              "results", "tool_study", "serve", *SAMPLER_SPEED, *SWEEP_GRID)


def flatten(tree, prefix: str = "") -> dict:
    """{'train.learning_rate': 1e-4, ...} of a (JSON) config dict."""
    out = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, name + "."))
        else:
            out[name] = value
    return out


def _covered(field: str, names) -> bool:
    """`field` is one of `names`, or inside a block of them ('eval' covers 'eval.every')."""
    return any(field == n or field.startswith(n + ".") for n in names)


def config_json(config) -> dict:
    """The resolved config as plain JSON values (tuples become lists). A copy of the record, not
    a read of its fields (config_reads: unwrapped)."""
    config = unwrapped(config)
    plain = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    return json.loads(json.dumps(plain, default=str))


@functools.lru_cache(maxsize=1)
def code_version() -> dict:
    """jaxprefix's version and, in a git checkout, its commit and whether the tree was edited."""
    import jaxprefix

    version = {"jaxprefix": getattr(jaxprefix, "__version__", "unknown")}
    root = os.path.dirname(os.path.dirname(os.path.abspath(jaxprefix.__file__)))
    try:
        def git(*args):
            return subprocess.run(["git", "-C", root, *args], capture_output=True, text=True,
                                  timeout=10, check=True).stdout.strip()
        version["commit"] = git("rev-parse", "HEAD")
        version["edited"] = bool(git("status", "--porcelain", "--untracked-files=no", "jaxprefix"))
    except (OSError, subprocess.SubprocessError):
        pass  # not a git checkout (an installed wheel): the version alone
    return version


def differences(recorded: dict, current: dict) -> dict[str, tuple]:
    """field -> (recorded value, current value) for every field both configs have that differs."""
    old, new = flatten(recorded), flatten(current)
    return {k: (old[k], new[k]) for k in sorted(old.keys() & new.keys()) if old[k] != new[k]}


def allowed_changes(recorded: dict) -> tuple[str, ...]:
    """The fields a config's JSON (config_json) lets a resume change: its allow_changes."""
    text = recorded.get("allow_changes", "") or ""
    return tuple(name.strip().removeprefix("config.") for name in text.split(",") if name.strip())


def claim(config, workdir: str) -> None:
    """Records `config` as the run of `workdir`, or checks a resume against the record.

    Raises ConfigError naming each trajectory field that changed (with both values), unless
    `config.allow_changes` lists it. Only process 0 writes; every process checks.
    """
    path = storage.join(workdir, RECORD)
    current = config_json(config)
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    if not storage.exists(path):
        if storage.exists(storage.join(workdir, "checkpoints")):
            logging.warning("%s: no %s (a workdir of an older jaxprefix); recording this config, "
                            "the earlier one cannot be checked", workdir, RECORD)
        _write(path, {"config": current, "code": code_version(), "created": now, "history": []})
        return
    record = storage.read_json(path)
    changed = differences(record["config"], current)
    allowed = MAY_CHANGE + allowed_changes(current)
    refused = {k: v for k, v in changed.items() if not _covered(k, allowed)}
    if refused:
        listed = "; ".join(f"{k}: {_show(a)} -> {_show(b)}" for k, (a, b) in refused.items())
        raise ConfigError(
            f"{workdir} was made by another config ({path}), and resuming would change the run: "
            f"{listed}; expected the same values (only {', '.join(MAY_CHANGE)} may change), or "
            f"--config.allow_changes={','.join(refused)} to continue under the new values, or "
            f"another --workdir")
    if record.get("code") != code_version():
        logging.warning("%s: resumed under code %s (made by %s)", workdir, code_version(),
                        record.get("code"))
    if changed:
        logging.info("%s: resuming with %s", workdir,
                     ", ".join(f"{k} {_show(a)} -> {_show(b)}" for k, (a, b) in changed.items()))
        record["history"].append({"time": now, "code": code_version(),
                                  "changed": {k: list(v) for k, v in changed.items()}})
        record["config"] = current
        _write(path, record)


def _show(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _write(path: str, record: dict) -> None:
    if distributed.is_primary():
        storage.write_json(path, record)
