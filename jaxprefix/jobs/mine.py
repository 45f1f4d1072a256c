"""The mine job: what POPE and PrefixRL compute once with the base policy, before RL
(run_setup/mining.py: the hard set, POPE's prefixes, PrefixRL's trace pool, each cached and
its compute booked apart).

    python -m jaxprefix.main --config=configs/pope.py --config.job=mine --workdir=/tmp/pope
"""
from __future__ import annotations

from jaxprefix.run_setup.method_settings import MethodSettings
from jaxprefix.run_setup.mining import set_up


def run_mine(config, workdir: str) -> dict:
    """Computes (or reads) everything the configured method needs; returns a summary."""
    policy, sets, mining = set_up(config, workdir)
    hard = mining.hard_set()
    summary = {"hard": len(hard.problems), "candidates": len(mining.sets.train)}
    method = MethodSettings.from_config(config)
    summary |= method.spec.mined_summary(method.options, mining, hard)
    summary["ledger"] = {name: ledger.to_dict() for name, ledger in mining.costs.items()}
    return summary
