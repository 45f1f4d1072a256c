"""The eval job: a policy on a problem set, unguided and guided, as a JSON report.

    python -m jaxprefix.main --config=configs/eval.py --workdir=/tmp/pope

evaluates the latest checkpoint in the workdir (or the configured base model when there is none)
on the held-out problems: unguided pass@k / avg@k / best@k / worst@k / maj@k, and the same with
the mined POPE prefixes when the workdir has them. Writes <workdir>/eval_report.json.
"""
from __future__ import annotations

import numpy as np

from jaxprefix import evaluation, storage
from jaxprefix.methods import pope
from jaxprefix.methods.probing import Prober


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


def run_eval(config, workdir: str) -> dict:
    from jaxprefix.jobs.mine import prefix_search, set_up
    from jaxprefix.rl.loop import restore_trained_params

    policy, sets, mining = set_up(config, workdir)
    step = restore_trained_params(policy.model, workdir, config)
    e = config.eval
    report = {"step": step, "problems": len(sets.eval),
              "unguided": evaluate_unguided(mining.prober, policy.prompts, sets.eval, n=e.n,
                                            ks=e.ks, seed=config.seed + 7)}
    prefixes_file = storage.join(mining.dir, f"{prefix_search(config)}.json")
    if storage.exists(prefixes_file):
        # Mined on the training problems: guided eval measures the training set's guided skill.
        units = storage.read_json(prefixes_file)["shortest_units"]
        hard = [p for p in sets.train if p.id in units]
        report["guided_train"] = evaluate_guided(
            mining.prober, policy.prompts, hard, units, n=e.n, ks=e.ks,
            guidance=config.pope.guidance, template=pope.TEMPLATES[config.pope.template],
            seed=config.seed + 8)
    storage.write_json(storage.join(workdir, "eval_report.json"), report,
                       default=lambda x: np.asarray(x).tolist())
    return report
