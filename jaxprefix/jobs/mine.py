"""The mine job: what POPE and PrefixRL compute once with the base policy, before RL
(run_setup/mining.py: the hard set, POPE's prefixes, PrefixRL's trace pool, each cached and
its compute booked apart).

    python -m jaxprefix.main --config=configs/pope.py --config.job=mine --workdir=/tmp/pope
"""
from __future__ import annotations

from jaxprefix.methods import pope
from jaxprefix.run_setup.mining import set_up


def run_mine(config, workdir: str) -> dict:
    """Computes (or reads) everything the configured method needs; returns a summary."""
    policy, sets, mining = set_up(config, workdir)
    hard = mining.hard_set()
    summary = {"hard": len(hard.problems), "candidates": len(mining.sets.train)}
    if config.method == "pope":
        found = mining.prefixes(hard)
        summary["prefix_found"] = sum(v is not None for v in found.values())
        summary["revealed_fractions"] = pope.revealed_fractions(hard.problems, found)
    if config.method == "prefixrl":
        summary["pool"] = len(mining.trace_pool(hard.problems).traces)
    summary["ledger"] = {name: ledger.to_dict() for name, ledger in mining.costs.items()}
    return summary
