"""PrefixRL's controls in its regime: what separates the explanations of the SFT baseline's lead.

In PrefixRL's regime SFT on the base's own traces, then GRPO, beat PrefixRL (docs/RESULTS.md).
Two explanations fit that: (a) the base was stopped undertrained on purpose, so any SFT on
correct solutions is more base training; (b) the traces are the policy's own samples, so the SFT
meets no distribution gap (the paper's SFT baseline learns from off-policy traces). The results
job's controls test them:

- `solved_examples`: the base's own traces of as many problems it already solves (fresh problems of
  the regime's length, outside the hard and held-out sets) as the hard set's trace pool holds:
  the same kind of data as the traces baseline, on problems that are not hard; SFT on them is
  more base training with no hard problem in it (a), then GRPO, charged for their sampling;
- `other_policy_pool`: a second base of another architecture (results.other_base: depth and
  width) and SFT seed, with the first base's notation mix, mines its own traces on the same hard
  set: traces from a different policy, a distribution gap that is not a notation change (b);
  PrefixRL and SFT-then-GRPO each run on them, charged for that base's SFT and sampling.
"""
from __future__ import annotations

import json

from jaxprefix import storage
from jaxprefix.data import tasks
from jaxprefix.data.problem import Problem
from jaxprefix.run_setup import sft_base
from jaxprefix.run_setup.policy import Policy
from jaxprefix.methods import prefixrl
from jaxprefix.rl.compute_ledger import ComputeLedger
from jaxprefix.methods.prompting import TaskPrompts

OTHER_POOL, OTHER_POOL_STATS = "other_trace_pool.jsonl", "other_trace_pool_stats.json"
SOLVED_POOL, SOLVED_POOL_STATS = "solved_trace_pool.jsonl", "solved_trace_pool_stats.json"
MAX_SOLVED_BATCHES = 16  # of 4 x count fresh problems: a base that solves almost none stops


def other_policy_pool(study, train_base, other: dict) -> tuple[str, dict]:
    """(path of the second base's trace pool on the study's hard set, its stats with the FLOPs
    its rejection sampling spent); the base is trained (`train_base()`, its directory) and the
    pool mined once. `other`: its seed and shape (results.other_base), for the stats."""
    path = storage.join(study.mining.dir, OTHER_POOL)
    stats_path = storage.join(study.mining.dir, OTHER_POOL_STATS)
    if storage.exists(stats_path):
        return path, storage.read_json(stats_path)
    base = train_base()
    model, tokenizer = sft_base.load_base(base)
    policy = Policy(model, tokenizer, TaskPrompts(tokenizer), "sft")
    ledger = ComputeLedger(model.config.num_params())
    prober = study.mining.settings.probe.prober(policy, ledger, study.sets.verifier)
    p = study.settings.prefixrl
    pool = prefixrl.build_trace_pool(prober, policy.prompts, study.hard.problems,
                                     samples_per_round=p.samples_per_round,
                                     max_samples=p.max_samples, seed=study.settings.seed + 3)
    pool.save_jsonl(path, tokenizer)
    report = storage.read_json(storage.join(base, sft_base.REPORT))
    # Charged: the second base's SFT updates and its rejection sampling (the first base's SFT
    # is every run's alike).
    stats = {"flops": ledger.extra_flops + report["flops"], "sft_flops": report["flops"],
             "sampling_flops": ledger.extra_flops, "base": base, "problems": len(pool.traces),
             "samples": int(sum(pool.samples_per_problem.values())),
             "samples_found": [t.samples for t in pool.traces.values()],
             "sft_chosen_step": report["chosen_step"], "seed": other["seed"],
             "params": model.config.num_params(),
             "shape": {key: other[key] for key in ("layers", "width", "mlp_width")}}
    storage.write_json(stats_path, stats)  # written last: it marks a finished pool
    return path, stats


def solved_examples(study, count: int) -> tuple[list[tuple], dict]:
    """(problem, the base's own trace) of `count` problems the base solves, and the stats of
    finding them (the FLOPs their sampling spent): fresh problems of the regime's length, none in
    the hard or held-out sets, sampled `mining.k` times each, in batches, until `count` have a
    correct sample (or MAX_SOLVED_BATCHES have been tried: the stats say how many were found).
    Mined once per study."""
    path = storage.join(study.mining.dir, SOLVED_POOL)
    stats_path = storage.join(study.mining.dir, SOLVED_POOL_STATS)
    if not storage.exists(stats_path):
        _mine_solved(study, count, path, stats_path)
    records = [json.loads(line) for line in storage.read_text(path).splitlines() if line]
    return ([(Problem.from_json(r["problem"]), r["tokens"]) for r in records],
            storage.read_json(stats_path))


def _mine_solved(study, count: int, path: str, stats_path: str) -> None:
    s = study.settings
    task = tasks.get(s.task_source)
    taken = {p.id for p in study.hard.problems} | {p.id for p in study.sets.eval}
    ledger = ComputeLedger(study.policy.model.config.num_params())
    prober = study.mining.settings.probe.prober(study.policy, ledger, study.sets.verifier)
    k = study.mining.settings.k
    found, tried, batch = [], 0, 0
    while len(found) < count and batch < MAX_SOLVED_BATCHES:
        fresh = [p for p in task.generate(4 * count, digits=s.digits, multipliers=s.multipliers,
                                          seed=s.data_seed + 7919 + batch) if p.id not in taken]
        taken |= {p.id for p in fresh}
        tried += len(fresh)
        pool = prefixrl.build_trace_pool(prober, study.policy.prompts, fresh,
                                         samples_per_round=k, max_samples=k,
                                         seed=s.seed + 5 + batch)
        found += [(p, pool.traces[p.id].tokens) for p in fresh if p.id in pool.traces]
        batch += 1
    found = found[:count]
    storage.write_atomic(path, "".join(json.dumps({"problem": p.to_json(), "tokens": list(t)})
                                       + "\n" for p, t in found))
    storage.write_json(stats_path, {"flops": ledger.extra_flops, "problems": len(found),
                                    "tried": tried, "samples": tried * k})  # last: marks it done
