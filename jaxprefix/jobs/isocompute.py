"""The sweep and fit jobs of the IsoCompute playbook (arXiv 2603.12151).

    python -m jaxprefix.main --config=configs/isocompute.py --workdir=/tmp/iso          # sweep + fit
    python -m jaxprefix.main --config=configs/isocompute.py:fit --workdir=/tmp/iso      # fit only
    python -m jaxprefix.main --config=configs/isocompute.py --config.isocompute.print_only=True

sweep: one GRPO run per (n, B) at the largest budget (a run's eval curve passes through every
smaller budget on its way), each evaluated every `eval_every_rollouts` rollouts with avg@4,
best@4 and worst@4 on held-out problems. Runs go in sequence here; `print_only` prints one
command per point for a cluster instead. fit: the paper's frontier procedure over the finished
runs (record-breaking points, a sigmoid per n, the upper envelope, log n* as a sigmoid in log C),
written to frontier.json, frontier.png and n_star.png.
"""
from __future__ import annotations

import math

from jaxprefix import storage
from jaxprefix.jobs.policy import base_dir
from jaxprefix.methods import isocompute
from jaxprefix.rl.metrics import read_metrics

REWARD = "eval/avg@4"  # the paper's validation reward


def point_config(config, point: isocompute.SweepPoint, workdir: str):
    """The GRPO run of one sweep point: n rollouts, B problems, M steps, eval by rollouts."""
    c = config.copy_and_resolve_references()
    c.job, c.method = "rl", "grpo"
    # Every point starts from one base: the sweep's own (<workdir>/base, trained once if absent).
    c.model.path = base_dir(config, workdir)
    c.rollout.n = point.n
    c.train.problems_per_step = point.batch
    c.train.total_steps = point.steps
    if c.train.micro_batch_size:  # a micro-batch must divide the point's (possibly small) batch
        rows = point.n * point.batch // c.train.num_minibatches
        c.train.micro_batch_size = math.gcd(c.train.micro_batch_size, rows)
    c.eval.update(n=4, ks=(1, 4),
                  every=max(1, config.isocompute.eval_every_rollouts // (point.n * point.batch)))
    c.checkpoint.every = max(1, point.steps // 4)
    return c


def point_workdir(runs_dir: str, point: isocompute.SweepPoint) -> str:
    return storage.join(runs_dir, f"n{point.n}_b{point.batch}")


def sweep_points(config) -> list:
    iso = config.isocompute
    return isocompute.sweep_grid(iso.budgets, iso.ns, iso.batches, longest_only=True)


def runs_dir(config, workdir: str) -> str:
    return config.isocompute.runs_dir or storage.join(workdir, "runs")


def run_sweep(config, workdir: str) -> dict:
    from jaxprefix.jobs.rl import run_rl

    points = sweep_points(config)
    if config.isocompute.print_only:
        for point in points:
            overrides = {"rollout.n": point.n, "train.problems_per_step": point.batch,
                         "train.total_steps": point.steps, "job": "rl", "method": "grpo"}
            print("python -m jaxprefix.main --config=configs/isocompute.py "
                  + " ".join(f"--config.{k}={v}" for k, v in overrides.items())
                  + f" --workdir={point_workdir(runs_dir(config, workdir), point)}")
        return {"points": len(points)}
    for point in points:
        run_rl(point_config(config, point, workdir),
               point_workdir(runs_dir(config, workdir), point))
    return run_fit(config, workdir)


def collect_runs(config, workdir: str) -> list[isocompute.Run]:
    """Each finished point's eval curve as (rollouts spent, avg@4)."""
    runs = []
    for point in sweep_points(config):
        records = [r for r in read_metrics(point_workdir(runs_dir(config, workdir), point))
                   if REWARD in r]
        if records:
            per_step = point.n * point.batch
            runs.append(isocompute.Run(point.n, point.batch,
                                       tuple(float(r["step"] * per_step) for r in records),
                                       tuple(float(r[REWARD]) for r in records)))
    return runs


def run_fit(config, workdir: str) -> dict:
    runs = collect_runs(config, workdir)
    if not runs:
        raise FileNotFoundError(f"{runs_dir(config, workdir)}: no finished sweep runs with "
                                f"{REWARD!r} in their metrics.jsonl; run the sweep job first")
    record = {"runs": [vars(r) for r in runs], "fit": None}
    try:
        fit = isocompute.fit_frontier(runs)
    except ValueError as e:  # e.g. every run flat at 0: no frontier to fit, and the file says so
        record["reason"] = str(e)
    else:
        record["fit"] = fit.to_dict()
        isocompute.plot_frontier(fit, storage.join(workdir, "frontier.png"))
        isocompute.plot_n_star(fit, storage.join(workdir, "n_star.png"))
    storage.write_json(storage.join(workdir, "frontier.json"), record)
    return record
