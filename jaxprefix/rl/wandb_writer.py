"""Weights & Biases as one more metrics sink (`metrics.wandb=True`) beside metrics.jsonl and
TensorBoard.

Process 0 logs each step's record and, once, the run's whole config. The W&B run lives in
`<workdir>/wandb` and its id in `<workdir>/wandb_run_id`, so rerunning the command continues the
same W&B run. `metrics.wandb_mode='offline'` (or WANDB_MODE=offline) needs neither network nor
account; `wandb sync <workdir>/wandb/offline-run-*` uploads such a run later.
"""
from __future__ import annotations

import dataclasses
import math
import os
import uuid

import jax
import numpy as np


@dataclasses.dataclass(frozen=True)
class WandbSettings:
    """config.metrics' W&B fields, and the run's whole config as a plain dict (logged once)."""
    project: str
    mode: str = ""               # '' (W&B's default), 'online', 'offline', 'disabled'
    run_config: dict = dataclasses.field(default_factory=dict)


class WandbWriter:
    """A W&B run for `workdir`: write(step, record) per step, close() at the end."""

    def __init__(self, workdir: str, settings: WandbSettings):
        import wandb  # optional dependency: pip install wandb

        os.makedirs(workdir, exist_ok=True)
        id_file = os.path.join(workdir, "wandb_run_id")
        if os.path.exists(id_file):
            with open(id_file) as f:
                run_id = f.read().strip()
        else:
            run_id = uuid.uuid4().hex[:12]
            with open(id_file, "w") as f:
                f.write(run_id)
        self.run = wandb.init(project=settings.project, id=run_id, resume="allow", dir=workdir,
                              name=os.path.basename(os.path.abspath(workdir)),
                              mode=settings.mode or None, config=settings.run_config)

    def write(self, step: int, record: dict):
        values = {k: float(np.asarray(v)) for k, v in record.items()}
        self.run.log({k: v for k, v in values.items() if math.isfinite(v)}, step=int(step))

    def close(self):
        import wandb

        self.run.finish()
        wandb.teardown()  # waits for W&B's service to write everything out


def start(settings: WandbSettings | None, workdir: str) -> WandbWriter | None:
    """The run's W&B writer when it has W&B settings (process 0 only), else None."""
    if settings is None or jax.process_index() != 0:
        return None
    return WandbWriter(workdir, settings)
