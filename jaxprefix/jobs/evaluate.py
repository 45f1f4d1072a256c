"""The eval job: a policy on a problem set, unguided and guided, as a JSON report.

    python -m jaxprefix.main --config=configs/eval.py --workdir=/tmp/pope

evaluates the latest checkpoint in the workdir (or the configured base model when there is none)
on the held-out problems: unguided pass@k / avg@k / best@k / worst@k / maj@k, and the same with
the mined POPE prefixes when the workdir has them. Writes <workdir>/eval_report.json.
"""
from __future__ import annotations

import numpy as np

from jaxprefix import storage
from jaxprefix.methods import pope
from jaxprefix.studies.study import evaluate_guided, evaluate_unguided


def run_eval(config, workdir: str) -> dict:
    from jaxprefix.run_setup.mining import prefix_search, set_up
    from jaxprefix.rl.loop import restore_trained_params
    from jaxprefix.run_setup.learner_settings import lora_config, train_config

    policy, sets, mining = set_up(config, workdir)
    step = restore_trained_params(policy.model, workdir, train_config(config),
                                  lora_config(config))
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
