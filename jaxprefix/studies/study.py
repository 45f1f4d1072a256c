"""Comparing methods from one base policy: what the demo and the results job share, and the
held-out evaluation they (and the eval job) measure a policy by.

Every method starts from the same base, trains on the same mined hard set, samples the same
rollouts per step (POPE's batch sets the size: its problems times guided + unguided copies), and
is evaluated unguided on the same held-out problems with the same seed, before and after.
"""
from __future__ import annotations

import dataclasses

from jaxprefix import evaluation, storage
from jaxprefix.methods import pope, prefixrl
from jaxprefix.methods.probing import Prober
from jaxprefix.rl.compute_ledger import ComputeLedger
from jaxprefix.run_setup.mining import Mining
from jaxprefix.run_setup.study_settings import StudySettings


def evaluate_unguided(prober: Prober, prompts, problems, *, n: int, ks, seed: int,
                      description: str = "eval") -> dict:
    """pass@k and friends of the policy on `problems`, asked plainly, n samples each."""
    result = prober.probe([prompts.question(p) for p in problems], problems, n, seed=seed,
                          description=description)
    return (evaluation.summarize(result.correct, ks)
            | {"verifier_failures": result.verifier_failures,
               # Per problem, for intervals over problems and per-group tables (statistics.py).
               "correct_counts": [int(c) for c in result.num_correct],
               "groups": problem_groups(problems)})


GROUP_KEYS = ("multiplier", "digits")  # the built-in tasks' difficulty knobs


def problem_groups(problems) -> dict:
    """Per difficulty knob found in every problem's metadata, each problem's value."""
    return {key: [p.metadata[key] for p in problems] for key in GROUP_KEYS
            if problems and all(key in p.metadata for p in problems)}


def evaluate_guided(prober: Prober, prompts, problems, prefix_units: dict, *, n: int, ks,
                    guidance: str, template: str, seed: int) -> dict:
    """The same with each problem's POPE prefix (problems without one are left out)."""
    chosen = [p for p in problems if prefix_units.get(p.id)]
    if not chosen:
        return {}
    pairs = [pope.guided_context(prompts, p, prefix_units[p.id], guidance=guidance,
                                 template=template) for p in chosen]
    result = prober.probe([c for c, _ in pairs], chosen, n, seed=seed,
                          response_prefixes=[r for _, r in pairs], description="eval guided")
    return evaluation.summarize(result.correct, ks) | {"problems": len(chosen)}



CUT = "cut.json"  # on_problems_all_guide's counts, in the cut's mining directory


@dataclasses.dataclass
class Study:
    """One base policy, its problem sets and its mining, and how a study evaluates: made by a
    job from its config (`Study(StudySettings.from_config(config), workdir, *set_up(config,
    workdir))`), which derives each arm's run config itself (run_setup/study_arms.arm_config)."""
    settings: StudySettings
    workdir: str
    policy: object
    sets: object
    mining: Mining

    @property
    def hard(self):
        return self.mining.hard_set()

    def prefix_search(self, search: pope.PopeSettings | None = None) -> dict:
        """The hard set's prefix search with `search` (default: the study's POPE settings)."""
        return self.mining.prefix_search(self.hard, search or self.settings.pope)

    def trace_pool(self, problems=None) -> prefixrl.TracePool:
        """The study's trace pool (its PrefixRL settings) of `problems` (default: the hard set)."""
        return self.mining.trace_pool(self.hard.problems if problems is None else problems,
                                      self.settings.prefixrl)

    def on_problems_all_guide(self, searches) -> "Study":
        """The study cut down to the hard problems that every prefix search of `searches` (the
        guiding POPE arms' PopeSettings) solves, so every arm, GRPO's too, trains on one problem
        set: a mining directory beside this one (<dir>_all_guide) holds the cut and, in CUT,
        its counts."""
        hard = self.hard
        found = {}
        for search in searches:
            units = self.mining.prefixes(hard, search)
            found[search.search_name] = set(pope.guided_units(hard.problems, units, search))
        kept = set.intersection(*found.values()) if found else {p.id for p in hard.problems}
        directory = self.mining.dir.rstrip("/") + "_all_guide"
        mining = self.mining.restricted(kept, directory)
        storage.write_json(storage.join(directory, CUT),
                           {"hard": len(hard.problems), "kept": len(kept),
                            "found": {name: len(ids) for name, ids in found.items()}})
        return dataclasses.replace(self, mining=mining)

    def evaluate(self, model, description: str = "eval", problems=None,
                 n: int | None = None) -> dict:
        """Unguided pass@k and friends on `problems` (default: the held-out ones), eval.n samples
        each; one seed for every model."""
        s = self.settings
        prober = self.mining.settings.probe.prober(
            dataclasses.replace(self.policy, model=model), ComputeLedger(model.config.num_params()),
            self.sets.verifier)
        problems = self.sets.eval if problems is None else problems
        ks = s.eval_ks if n is None else [k for k in s.eval_ks if k <= n]
        return evaluate_unguided(prober, self.policy.prompts, problems, n=n or s.eval_n, ks=ks,
                                 seed=s.seed + 7, description=description)
