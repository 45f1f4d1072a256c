"""Comparing methods from one base policy: what the demo and the results job share.

Every method starts from the same base, trains on the same mined hard set, samples the same
rollouts per step (POPE's batch sets the size: its problems times guided + unguided copies), and
is evaluated unguided on the same held-out problems with the same seed, before and after.
"""
from __future__ import annotations

import dataclasses

from jaxprefix.jobs.evaluate import evaluate_unguided
from jaxprefix.jobs.mine import Mining, make_prober, set_up
from jaxprefix.jobs.policy import base_dir
from jaxprefix.jobs.method_settings import contexts_per_problem
from jaxprefix.rl.compute_ledger import ComputeLedger


@dataclasses.dataclass
class Study:
    config: object
    workdir: str
    policy: object
    sets: object
    mining: Mining

    @classmethod
    def prepare(cls, config, workdir: str, *, prefixes: bool = True,
                trace_pool: bool = False) -> "Study":
        """Base policy (trained if absent), problem sets, hard set [, POPE prefixes] [, trace
        pool]."""
        policy, sets, mining = set_up(config, workdir)
        hard = mining.hard_set()
        if prefixes:
            mining.prefixes(hard)
        if trace_pool:
            mining.trace_pool(hard.problems)
        return cls(config, workdir, policy, sets, mining)

    @property
    def hard(self):
        return self.mining.hard_set()

    def evaluate(self, model, description: str = "eval", problems=None,
                 n: int | None = None) -> dict:
        """Unguided pass@k and friends on `problems` (default: the held-out ones), eval.n samples
        each; one seed for every model."""
        e = self.config.eval
        prober = make_prober(self.config, dataclasses.replace(self.policy, model=model),
                             ComputeLedger(model.config.num_params()), self.sets.verifier)
        problems = self.sets.eval if problems is None else problems
        ks = e.ks if n is None else [k for k in e.ks if k <= n]
        return evaluate_unguided(prober, self.policy.prompts, problems, n=n or e.n, ks=ks,
                                 seed=self.config.seed + 7, description=description)

    def run_config(self, method: str, seed: int | None = None):
        """One method's RL config from the shared base and mining, at POPE's rollouts per step."""
        config = self.config
        c = config.copy_and_resolve_references()
        c.job, c.method = "rl", method
        c.seed = config.seed if seed is None else seed
        c.model.path = base_dir(config, self.workdir)
        c.mining.dir = self.mining.dir
        contexts = config.train.problems_per_step * contexts_per_problem(config, "pope")
        if method != "pope":
            c.train.problems_per_step = max(1, contexts // contexts_per_problem(config, method))
        return c
