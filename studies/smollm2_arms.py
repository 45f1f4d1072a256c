"""The arms of the smollm2_hard study (issue 67): GRPO, POPE and PrefixRL on the competent base,
each an rl run through the library's Python door (api.run) at one FLOPs budget (train.flops_budget
counts the ledger: its mining too), and the more-SFT control at the same FLOPs. Each is resumable;
<out>/arms/<arm>-s<seed>/ holds its run. Run by `python -m studies.smollm2_hard --until=arms`.
"""
from __future__ import annotations

import dataclasses
import json

from jaxprefix import run_config, variants
from jaxprefix.data import reasoning_gym_problems
from jaxprefix.models import lora
from jaxprefix.rl import sft
from studies.smollm2_hard import TASK, TEST_SEED, VERIFIER, chain_config

ARMS = ("grpo", "pope", "prefixrl")
ARM_TRAIN_SEED = 5 << 31  # the arms' training problems; their held-out set is TEST_SEED's

def arm_config(study, arm: str, seed: int):
    """The run config of one arm: smollm2_hard's LoRA GRPO steps (4 hard problems a step,
    8 samples each) on the competent base, at the hard setting, held out on fresh problems
    of that setting (TEST_SEED; the library leaves training questions out by text)."""
    s = study.s
    config = run_config.base_config()
    variants.smollm2_hard(config)
    config.model.update(source="hf", path=study.path("base"))
    config.data.update(task_config=json.dumps(chain_config(s.hard_terms, s.hard_digits)),
                       train_size=s.arm_train_size, eval_size=64, seed=ARM_TRAIN_SEED,
                       eval_seed=TEST_SEED, verifier=VERIFIER)
    config.method, config.seed = arm, seed
    config.train.update(total_steps=10_000, flops_budget=s.arm_flops)  # the budget ends it
    config.mining.update(k=16, prefix_samples=16, max_prefix_units=s.arm_prefix_units,
                         rows_per_call=s.rows_per_call,
                         dir=study.path(f"arms/mining-s{seed}"))  # each arm charged its share
    config.eval.update(every=5, n=8, ks=(1, 8), before_train=True, greedy=False)
    config.checkpoint.update(every=5, keep=2)
    if arm == "grpo":
        config.mining.train_on = "hard"
    elif arm == "pope":
        config.pope.update(guidance=s.arm_guidance, max_prefix_fraction=0.5)
    elif arm == "prefixrl":  # the base's own successes, rejection-sampled and charged
        config.prefixrl.update(samples_per_round=32, max_samples=64)
    return config

def run_arms(study) -> dict:
    """Every arm at every seed, each resumable (a rerun goes on from its checkpoint)."""
    from jaxprefix import api

    study.policy()  # base/ in place
    rows = {}
    for seed in study.s.arm_seeds:
        for arm in ARMS:
            name = f"{arm}-s{seed}"
            print(f"arm {name}")
            rows[name] = api.run(arm_config(study, arm, seed), study.path(f"arms/{name}"))
        rows[f"more_sft-s{seed}"] = more_sft(study, seed)
    return rows

def more_sft(study, seed: int) -> dict:
    """The control: the competent base SFT'd further on the worked solutions of the arms'
    training problems, for as many steps as the arms' FLOPs budget pays (6 N D), then
    sampled unguided on their held-out problems (8 samples each, the run's temperature)."""
    name = f"arms/more_sft-s{seed}.json"
    if (record := study.done(name)) is not None:
        return record
    s = study.s
    policy, config = study.policy()
    setting = chain_config(s.hard_terms, s.hard_digits)
    train = [p for p in reasoning_gym_problems(TASK, s.arm_train_size, ARM_TRAIN_SEED,
                                               **setting) if p.solution]
    rows = sft.sft_rows(policy.prompts, policy.stop_ids[0],
                        [(p, policy.prompts.response(p.solution)) for p in train])
    row_flops = 6 * policy.model.config.num_params() * float(rows[1].sum()) / len(rows[1])
    steps = max(1, int(s.arm_flops // (row_flops * 8)))
    model = lora.with_adapters(policy.model, lora.LoraConfig(rank=s.lora_rank), seed=seed)
    report = sft.train(model, rows, sft.SftSettings(steps=steps, batch_size=8,
                                                    learning_rate=3e-4, seed=seed),
                       progress=f"more SFT, seed {seed}")
    trained = {p.question for p in train}
    held_out = [p for p in reasoning_gym_problems(TASK, 64, TEST_SEED, **setting)
                if p.question not in trained]
    prober, ledger = study.prober(dataclasses.replace(policy, model=lora.merged(model)),
                                 config)
    result = prober.probe([policy.prompts.question(p) for p in held_out], held_out, 8,
                          seed=seed, description=f"more SFT, seed {seed}, held out")
    counts = result.num_correct.tolist()
    record = report | {"held_out": len(held_out), "correct_counts": counts,
                       "pass@1": sum(counts) / (8 * len(held_out)),
                       "pass@8": sum(c > 0 for c in counts) / len(held_out),
                       "eval_ledger": ledger.to_dict()}
    study.write(name, record)
    return record

def check_arms(study) -> None:
    """Each arm's config through preflight (every field read, every input checked), no run."""
    from jaxprefix.run_setup import preflight

    study.policy()
    for arm in ARMS:
        preflight.check(arm_config(study, arm, study.s.arm_seeds[0]),
                        study.path(f"arms/{arm}-check"))
        print(f"arm {arm}: preflight passed")
