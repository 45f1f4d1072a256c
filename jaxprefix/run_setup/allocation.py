"""IsoCompute's allocation rule applied to a run: `isocompute.budget` -> n, B, M (and the lr).

The rule is a fit job's frontier.json (`isocompute.frontier_path`) or the default curve; the rl
job calls `allocated` before anything else, the sweep uses the same lr and micro-batch rules.
"""
from __future__ import annotations

import dataclasses
import math

from jaxprefix import storage
from jaxprefix.run_setup.method_settings import contexts_per_problem
from jaxprefix.methods import isocompute


def scaled_lr(config, rollouts_per_step: int) -> float:
    """The learning rate for a step of this many rollouts, by isocompute.lr_rule."""
    iso = config.isocompute
    return isocompute.scaled_lr(rollouts_per_step, base_lr=config.train.learning_rate,
                                base_batch=iso.lr_reference_rollouts, rule=iso.lr_rule)


def micro_batch(config, rows: int) -> int:
    """A micro-batch that divides a (possibly small) batch of `rows` rows."""
    return math.gcd(config.train.micro_batch_size, rows // config.train.num_minibatches)


@dataclasses.dataclass(frozen=True)
class Rule:
    """n* as a curve of the budget, the batch B, and (from a fit) FLOPs per rollout."""
    n_curve: isocompute.Sigmoid
    batch: int
    flops_per_rollout: float | None


def load_rule(config) -> Rule:
    """The allocation rule a config names: a fit job's frontier.json, or the default curve."""
    iso = config.isocompute
    if not iso.frontier_path:
        return Rule(isocompute.DEFAULT_N_CURVE, iso.batch or 64, None)
    if not storage.exists(iso.frontier_path):
        raise ValueError(f"config.isocompute.frontier_path={iso.frontier_path!r}: no such file; "
                         f"expected a fit job's frontier.json")
    allocation = storage.read_json(iso.frontier_path).get("allocation")
    if not allocation:
        raise ValueError(f"config.isocompute.frontier_path={iso.frontier_path!r}: that fit found "
                         f"no frontier (its 'reason' says why), so it holds no allocation rule")
    return Rule(isocompute.Sigmoid.from_dict(allocation["n_curve"]),
                iso.batch or int(allocation["batch"]), allocation.get("flops_per_rollout"))


def allocated(config):
    """With `isocompute.budget` > 0, a copy of `config` whose n, B and M (and learning rate, by
    `lr_rule`) come from the allocation rule; else `config` itself.

    A budget in rollouts is spent exactly: M = budget // (contexts a step * n). A budget in
    FLOPs (the run's sampling + updates) is turned into rollouts with the fit's measured FLOPs
    per rollout to choose n, and the run stops on its ledger before a step would pass it
    (`train.flops_budget`), so it spends the budget to within one step.
    """
    iso = config.isocompute
    if not iso.budget:
        return config
    if iso.budget_unit not in ("rollouts", "flops"):
        raise ValueError(f"config.isocompute.budget_unit={iso.budget_unit!r}: expected "
                         f"'rollouts' or 'flops'")
    rule = load_rule(config)
    rollout_budget = iso.budget
    if iso.budget_unit == "flops":
        if not rule.flops_per_rollout:
            raise ValueError("config.isocompute.budget_unit='flops' needs frontier_path: a fit "
                             "job's frontier.json, which measured the FLOPs per rollout")
        rollout_budget = iso.budget / rule.flops_per_rollout
    c = config.copy_and_resolve_references()
    contexts = contexts_per_problem(c, c.method)  # POPE's copies, PrefixRL's prefixes
    a = isocompute.allocate(int(rollout_budget // contexts), n_curve=rule.n_curve,
                            batch=rule.batch, n_min=iso.n_min, n_max=iso.n_max)
    rows = a.n * a.batch * contexts
    c.rollout.n, c.train.problems_per_step, c.train.total_steps = a.n, a.batch, a.steps
    c.train.learning_rate = scaled_lr(config, rows)
    if c.train.micro_batch_size:
        c.train.micro_batch_size = micro_batch(config, rows)
    if iso.budget_unit == "flops":
        c.train.flops_budget = float(iso.budget)
        c.train.total_steps = 4 * a.steps  # a cap: the ledger stops the run
    return c
