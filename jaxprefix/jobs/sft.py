"""The sft job: the demo's tiny base policy, trained until a measured criterion holds
(run_setup/sft_base.py).

    python -m jaxprefix.main --config=configs/sft.py --workdir=/tmp/demo

writes <workdir>/base/ (an HF directory with the task's character vocabulary) and its
sft_report.json; a finished base is reused.
"""
from __future__ import annotations

from jaxprefix.run_setup import sft_base


def run_sft(config, workdir: str) -> str:
    """Trains (or reuses) the base model; returns the path of <workdir>/base."""
    return sft_base.train_base(config, workdir)
