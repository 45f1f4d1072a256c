"""SFT warm starts before RL: the papers' SFT baselines (the results job's ablations).

- `oracle_examples`: the oracle solutions of the hard set (POPE reports this warm start does not
  fix RL on hard problems);
- `own_guided_examples`: the policy's own correct answers to guided prompts, asked unguided
  (POPE's baseline: the guidance distilled by SFT instead of RL);
- `trace_examples`: the rejection-sampled traces of PrefixRL's pool (PrefixRL's baseline:
  SFT on the off-policy traces, then RL).

Each example is (problem, target token ids); a row is the unguided question + target + stop.

The warm-started policy is written next to the run as an ordinary model directory (with the
policy's tokenizer files), so the RL run loads it like any base. Its update
FLOPs (6 N D over every token forwarded) are returned so that comparisons can charge them.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import optax
import tqdm
from flax import nnx

from jaxprefix.checkpoints.hf import save_pretrained
from jaxprefix import storage
from jaxprefix.rl import sft
from jaxprefix.rl.compute_ledger import update_flops

REPORT = "warm_start.json"


@dataclasses.dataclass(frozen=True)
class WarmStart:
    path: str      # the model directory RL starts from
    flops: float   # what the SFT updates cost
    report: dict


def oracle_examples(policy, problems) -> list[tuple]:
    """(problem, oracle solution tokens) of each problem."""
    for problem in problems:
        if not problem.solution:
            raise ValueError(f"problem {problem.id}: no oracle solution to train on")
    return [(p, policy.prompts.response(p.solution)) for p in problems]


def own_guided_examples(problems, answers: dict) -> list[tuple]:
    """(problem, the policy's own correct guided answer) for the problems the prefix search
    found one for (`answers`: id -> token ids, as mining's prefix search records them)."""
    return [(p, list(answers[p.id])) for p in problems if p.id in answers]


def trace_examples(problems, pool) -> list[tuple]:
    """(problem, its trace's tokens) for the problems of a PrefixRL trace pool."""
    return [(p, list(pool.traces[p.id].tokens)) for p in problems if p.id in pool.traces]


def sft_rows(policy, examples) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tokens, real-token mask, loss mask) of question + target + stop token (rl/sft.py)."""
    return sft.sft_rows(policy.prompts, policy.stop_ids[0], examples)


def run_warm_start(policy, base_path: str, examples, out_dir: str, *, epochs: int,
                   batch_size: int, learning_rate: float, warmup_fraction: float,
                   seed: int) -> WarmStart:
    """Trains a copy of `policy.model` on (problem, target) examples (or reuses out_dir)."""
    report_path = storage.join(out_dir, REPORT)
    if storage.exists(report_path):
        report = storage.read_json(report_path)
        return WarmStart(out_dir, report["flops"], report)
    if not storage.isdir(base_path):
        raise ValueError(f"warm start: the base {base_path!r} is not a model directory (a GGUF "
                         f"file cannot take the new weights); convert it to an HF directory first")
    tokens, real, loss_mask = sft_rows(policy, examples)
    model = nnx.clone(policy.model)
    rng = np.random.default_rng(seed)
    batch_size = min(batch_size, len(tokens))
    steps_per_epoch = len(tokens) // batch_size
    # A fresh Adam's first steps at the full rate jolt a trained policy (the loss rose 0.37 ->
    # 3.2 at step 2 without a warmup): the rate rises linearly over the first steps.
    warmup = max(1, round(warmup_fraction * epochs * steps_per_epoch))
    schedule = optax.join_schedules([optax.linear_schedule(0.0, learning_rate, warmup),
                                     optax.constant_schedule(learning_rate)], [warmup])
    optimizer = nnx.Optimizer(model, optax.adam(schedule), wrt=nnx.Param)
    n_params = model.config.num_params()
    flops, losses = 0.0, []
    with tqdm.tqdm(total=epochs * steps_per_epoch, desc="warm start SFT") as bar:
        for _ in range(epochs):
            order = rng.permutation(len(tokens))
            for step in range(steps_per_epoch):
                rows = order[step * batch_size:(step + 1) * batch_size]
                loss = sft.train_step(model, optimizer, jnp.asarray(tokens[rows]),
                                  jnp.asarray(real[rows]), jnp.asarray(loss_mask[rows]))
                losses.append(float(loss))
                flops += update_flops(n_params, int(real[rows].sum()))
                bar.update(1)

    save_pretrained(model, None, out_dir, tokenizer=policy.tokenizer)
    report = {"problems": len(tokens), "epochs": epochs, "steps": len(losses),
              "batch_size": batch_size, "learning_rate": learning_rate,
              "warmup_steps": warmup, "flops": flops,
              "losses": losses}
    storage.write_json(report_path, report)  # written last: it marks a finished warm start
    return WarmStart(out_dir, flops, report)
