"""The IsoCompute sweep's points as runs: each (n, B, seed) a GRPO run's config and workdir.

The sweep job runs them, the prereg job runs a pre-registered subset, preflight checks each
point's settings, and `point_command` prints the command that runs exactly one point.
"""
from __future__ import annotations

from jaxprefix import config_fields, run_config, storage
from jaxprefix.methods import isocompute
from jaxprefix.run_setup import allocation
from jaxprefix.run_setup.policy import base_dir


def _set(config, field: str, value) -> None:
    *sections, name = field.split(".")
    node = config
    for part in sections:
        node = node[part]
    node[name] = value


def point_overrides(config, point: isocompute.SweepPoint, seed: int, workdir: str) -> dict:
    """The config fields one sweep point sets: a GRPO run of n rollouts, B problems, M steps,
    the learning rate by the rule, evaluated by rollouts; every point starts from one base (the
    sweep's own, <workdir>/base, trained once if absent)."""
    rows = point.n * point.batch
    overrides = {"job": "rl", "method": "grpo", "seed": seed,
                 "model.path": base_dir(config, workdir), "rollout.n": point.n,
                 "train.problems_per_step": point.batch, "train.total_steps": point.steps,
                 "train.learning_rate": allocation.scaled_lr(config, rows), "eval.n": 4, "eval.ks": (1, 4),
                 "eval.every": max(1, config.isocompute.eval_every_rollouts // rows),
                 "checkpoint.every": max(1, point.steps // 4)}
    if config.train.micro_batch_size:
        overrides["train.micro_batch_size"] = allocation.micro_batch(config, rows)
    return overrides


def point_config(config, point: isocompute.SweepPoint, seed: int, workdir: str):
    c = config.copy_and_resolve_references()
    for field, value in point_overrides(config, point, seed, workdir).items():
        _set(c, field, value)
    return c


def point_workdir(runs_dir: str, point: isocompute.SweepPoint, seed: int) -> str:
    return storage.join(runs_dir, f"n{point.n}_b{point.batch}_s{seed}")


def sweep_points(config) -> list:
    iso = config.isocompute
    return isocompute.sweep_grid(iso.budgets, iso.ns, iso.batches, longest_only=True)


def runs_dir(config, workdir: str) -> str:
    return config.isocompute.runs_dir or storage.join(workdir, "runs")


def point_command(config, point: isocompute.SweepPoint, seed: int, workdir: str) -> str:
    """The command that runs one point: every field in which its config differs from what
    `isocompute.config_arg` loads (the point's settings and any override of the sweep's own)."""
    arg = config.isocompute.config_arg
    if not arg:
        raise ValueError("config.isocompute.config_arg is empty: print_only needs the --config "
                         "the printed commands start from (configs/isocompute.py sets it)")
    path, _, variant = arg.partition(":")
    fresh = dict(config_fields.leaves(run_config.from_file(path, variant)))
    wanted = dict(config_fields.leaves(point_config(config, point, seed, workdir)))
    overrides = {k: v for k, v in wanted.items() if fresh.get(k) != v}
    return isocompute.run_command(arg, overrides,
                                  point_workdir(runs_dir(config, workdir), point, seed))
