"""PrefixRL's controls in its regime: what separates the explanations of the SFT baseline's lead.

In PrefixRL's regime SFT on the base's own traces, then GRPO, beat PrefixRL (docs/RESULTS.md).
Two explanations fit that: (a) the base was stopped undertrained on purpose, so any SFT on
correct solutions is more base training; (b) the traces are the policy's own samples, so the SFT
meets no distribution gap (the paper's SFT baseline learns from off-policy traces). The results
job's controls test them:

- `more_sft_examples`: oracle solutions, each step's notation drawn as the base's own SFT draws
  it, of as many problems outside the hard set as the trace pool holds: more base training with
  no hard problem in it (a), then GRPO;
- `other_policy_pool`: a second base (another SFT seed and another notation mix) mines its own
  traces on the same hard set: traces from a different policy, a real distribution gap for the
  first base (b); PrefixRL and SFT-then-GRPO each run on them, charged for that sampling.
"""
from __future__ import annotations

import random

from jaxprefix import storage
from jaxprefix.data import tasks
from jaxprefix.jobs import sft
from jaxprefix.jobs.mine import make_prober
from jaxprefix.jobs.policy import Policy
from jaxprefix.methods import prefixrl
from jaxprefix.rl.compute_ledger import ComputeLedger
from jaxprefix.methods.prompting import TaskPrompts

OTHER_POOL, OTHER_POOL_STATS = "other_trace_pool.jsonl", "other_trace_pool_stats.json"


def other_base_config(study):
    """The second base's SFT config: the study's, with results.other_base's seed and notation
    mix (tens_first: the share of steps written '^', 0.5 in the first base), sampled every 50
    steps from the start of evaluation: with the first base's gate (step accuracy 0.3) this
    one solved a hard problem at its first sampled point (step 625), leaving no point to keep;
    it is kept at its last point before that (any policy with traces serves here)."""
    c = study.config.sft.copy_and_resolve_references()
    other = study.config.results.other_base
    c.seed = other.seed
    c.data.tens_first = other.tens_first
    c.eval_every = 50
    c.criterion.sample_from_step_accuracy = 0.0
    return c


def other_policy_pool(study, workdir: str) -> tuple[str, dict]:
    """(path of the second base's trace pool on the study's hard set, its stats with the FLOPs
    its rejection sampling spent); the base is trained and the pool mined once."""
    path = storage.join(study.mining.dir, OTHER_POOL)
    stats_path = storage.join(study.mining.dir, OTHER_POOL_STATS)
    if storage.exists(stats_path):
        return path, storage.read_json(stats_path)
    base = sft.run_sft(other_base_config(study), storage.join(workdir, "other_base"))
    model, tokenizer = sft.load_base(base)
    policy = Policy(model, tokenizer, TaskPrompts(tokenizer), "sft")
    ledger = ComputeLedger(model.config.num_params())
    prober = make_prober(study.config, policy, ledger, study.sets.verifier)
    p = study.config.prefixrl
    pool = prefixrl.build_trace_pool(prober, policy.prompts, study.hard.problems,
                                     samples_per_round=p.samples_per_round,
                                     max_samples=p.max_samples, seed=study.config.seed + 3)
    pool.save_jsonl(path, tokenizer)
    report = storage.read_json(storage.join(base, sft.REPORT))
    stats = {"flops": ledger.extra_flops, "base": base, "problems": len(pool.traces),
             "samples": int(sum(pool.samples_per_problem.values())),
             "samples_found": [t.samples for t in pool.traces.values()],
             "sft_chosen_step": report["chosen_step"],
             "tens_first": study.config.results.other_base.tens_first,
             "seed": study.config.results.other_base.seed}
    storage.write_json(stats_path, stats)  # written last: it marks a finished pool
    return path, stats


def more_sft_examples(study, count: int, seed: int) -> list[tuple]:
    """(problem, oracle solution tokens) of `count` fresh problems of the regime's length,
    none in the training hard set or the held-out set, each step's notation drawn as the base's
    SFT draws it (the base's own training distribution, at this length)."""
    task = tasks.get(study.config.data.source)
    taken = {p.id for p in study.hard.problems} | {p.id for p in study.sets.eval}
    data = study.config.data
    rng = random.Random(seed)
    examples, attempt = [], 0
    while len(examples) < count:
        fresh = task.generate(count, digits=tuple(data.digits),
                              multipliers=tuple(data.multipliers), seed=seed * 1000 + attempt)
        for problem in fresh:
            if problem.id not in taken and len(examples) < count:
                taken.add(problem.id)
                solution = task.sample_solution(problem, rng, study.config.sft.data.tens_first)
                examples.append((problem, study.policy.prompts.response(solution)))
        attempt += 1
    return examples
