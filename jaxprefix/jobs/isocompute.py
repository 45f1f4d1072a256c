"""The IsoCompute playbook (arXiv 2603.12151) as jobs: sweep, fit, and runs allocated by the rule.

    python -m jaxprefix.main --config=configs/isocompute.py --workdir=/tmp/iso          # sweep + fit
    python -m jaxprefix.main --config=configs/isocompute.py:fit --workdir=/tmp/iso      # fit only
    python -m jaxprefix.main --config=configs/isocompute.py --config.isocompute.print_only=True
    python -m jaxprefix.main --config=configs/grpo.py --config.isocompute.budget=65536 \
        --config.isocompute.frontier_path=/tmp/iso/frontier.json --workdir=/tmp/allocated

sweep: one GRPO run per (n, B, seed) at the largest budget (a run's eval curve passes through
every smaller budget on its way), evaluated every `eval_every_rollouts` rollouts with avg@4,
best@4 and worst@4 on held-out problems, its learning rate scaled with n * B by `lr_rule`. Runs
go in sequence here; `print_only` prints, per point, the command that runs exactly that point.
fit: the paper's frontier procedure over the finished runs (record-breaking points, a sigmoid per
n, the upper envelope, log n* as a sigmoid in log C), per seed and on the seed-mean curves,
written to frontier.json (with the allocation rule a config can name), frontier.png, n_star.png.
`allocated(config)`: with `isocompute.budget` > 0, an rl run's n, B and M from that rule.
"""
from __future__ import annotations

import numpy as np

from jaxprefix import storage
from jaxprefix.methods import isocompute
from jaxprefix.run_setup.sweep_points import (point_command, point_config, point_workdir,
                                              runs_dir, sweep_points)
from jaxprefix.rl.metrics import read_metrics

REWARD = "eval/avg@4"  # the paper's validation reward
FRONTIER = "frontier.json"


def run_sweep(config, workdir: str) -> dict:
    from jaxprefix.jobs.rl import run_rl

    points = [(p, s) for p in sweep_points(config) for s in config.isocompute.seeds]
    if config.isocompute.print_only:
        for point, seed in points:
            print(point_command(config, point, seed, workdir))
        return {"points": len(points)}
    for point, seed in points:
        run_rl(point_config(config, point, seed, workdir),
               point_workdir(runs_dir(config, workdir), point, seed))
    return run_fit(config, workdir)


def collect_runs(config, workdir: str) -> list[tuple[int, isocompute.Run, float]]:
    """(seed, eval curve as (rollouts spent, avg@4), RL FLOPs per rollout) of each finished point."""
    runs = []
    for point in sweep_points(config):
        for seed in config.isocompute.seeds:
            directory = point_workdir(runs_dir(config, workdir), point, seed)
            records = [r for r in read_metrics(directory) if REWARD in r]
            if not records:
                continue
            per_step = point.n * point.batch
            run = isocompute.Run(point.n, point.batch,
                                 tuple(float(r["step"] * per_step) for r in records),
                                 tuple(float(r[REWARD]) for r in records))
            last = read_metrics(directory)[-1]
            runs.append((seed, run, last["flops/total"] / (last["step"] * per_step)))
    return runs


def mean_over_seeds(runs: list[isocompute.Run]) -> list[isocompute.Run]:
    """Per (n, B), the reward averaged over seeds at the compute points every seed reached."""
    by_point: dict = {}
    for run in runs:
        by_point.setdefault((run.n, run.batch), []).append(run)
    mean = []
    for (n, batch), group in sorted(by_point.items()):
        length = min(len(r.compute) for r in group)
        reward = np.mean([r.reward[:length] for r in group], axis=0)
        mean.append(isocompute.Run(n, batch, group[0].compute[:length], tuple(map(float, reward))))
    return mean


def _fit(runs) -> dict:
    try:
        return {"fit": isocompute.fit_frontier(runs).to_dict()}
    except ValueError as e:  # e.g. every run flat: no frontier to fit, and the file says so
        return {"fit": None, "reason": str(e)}


def run_fit(config, workdir: str) -> dict:
    collected = collect_runs(config, workdir)
    if not collected:
        raise FileNotFoundError(f"{runs_dir(config, workdir)}: no finished sweep runs with "
                                f"{REWARD!r} in their metrics.jsonl; run the sweep job first")
    seeds = sorted({seed for seed, _, _ in collected})
    mean = mean_over_seeds([run for _, run, _ in collected])
    record = {"runs": [vars(run) | {"seed": seed} for seed, run, _ in collected],
              "seeds": seeds, "mean_runs": [vars(run) for run in mean],
              "per_seed": {str(s): _fit([r for seed, r, _ in collected if seed == s])
                           for s in seeds},
              **_fit(mean), "allocation": None}
    if record["fit"]:
        fit = isocompute.FrontierFit.from_dict(record["fit"])
        record["allocation"] = isocompute.allocation_rule(fit, mean) | {
            "flops_per_rollout": float(np.mean([f for _, _, f in collected]))}
        isocompute.plot_frontier(fit, storage.join(workdir, "frontier.png"))
        isocompute.plot_n_star(fit, storage.join(workdir, "n_star.png"))
    storage.write_json(storage.join(workdir, FRONTIER), record)
    return record
