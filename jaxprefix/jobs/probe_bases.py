"""The key-step probe of trained SFT bases: where each sits on POPE's overlap axis.

    python -m jaxprefix.jobs.probe_bases runs/eps_taught0/base runs/eps_taught0.05/base \
        --out docs/results/pope_eps/bases.json

Teacher-forced on the bases' hard problems (keyed_multiplication, rule '>', 8 digits; 256 of
them from the SFT criterion's seed): the probe (jaxprefix/key_step_probe.py), and success given
the key three ways: the key step given in the prompt's hint slots (the value hint: what the SFT
criterion's guided success samples) and written by the policy itself under each rule's name (what
an unguided rollout, or one after the restating hint, must do). One table row per base.
"""
from __future__ import annotations

import argparse
import json

from jaxprefix import key_step_probe, storage
from jaxprefix.data.tasks import keyed_multiplication as task
from jaxprefix.run_setup.sft_base import REPORT, load_base

PROBLEMS = 256


def probe_base(path: str) -> dict:
    """The figures of one base directory (written by the sft job, with data.key_names_rule)."""
    report = storage.read_json(storage.join(path, REPORT))
    sft = report["config"]
    if not sft["data"].get("key_names_rule"):
        raise ValueError(f"{path}: a base trained without data.key_names_rule; expected the "
                         f"restating notation (configs/results.py:eps trains its bases with it)")
    model, tokenizer = load_base(path)
    hard = task.hard_set(PROBLEMS, seed=sft["criterion"]["hard_seed"], names_rule=True)
    row = {"base": path, "second_rule_taught": sft["data"].get("second_rule_taught", 0.0),
           "chosen_step": report["chosen_step"],
           **key_step_probe.probe(model, hard, tokenizer, task).metrics("")}
    ways = {"hint_slots": [(task.hinted(p, 1), p.solution) for p in hard]}
    ways |= {f"own_{name}": [(p, name + p.solution[1:]) for p in hard]
             for name in (task.FIRST, task.SECOND)}
    for way, pairs in ways.items():
        _, digits, carry, _ = key_step_probe.steps(model, [p for p, _ in pairs],
                                                   [s for _, s in pairs], tokenizer, task)
        row[f"key_digits_{way}"] = float(digits.mean())
        row[f"carry_given_key_{way}"] = float(carry.mean())
    return row


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bases", nargs="+", help="base directories (local or gs://)")
    parser.add_argument("--out", default="", help="write the rows here as JSON")
    args = parser.parse_args(argv)
    rows = [probe_base(path) for path in args.bases]
    for row in rows:
        print(json.dumps({k: (f"{v:.3g}" if isinstance(v, float) else v) for k, v in row.items()}))
    if args.out:
        storage.write_json(args.out, rows)


if __name__ == "__main__":
    main()
