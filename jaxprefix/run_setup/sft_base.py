"""SFT of the tiny demo policy, stopped by a measured criterion: the base model of the POPE demo
(trained by the sft job, or by any job whose policy names an SFT'd base that is absent).

The base model must sit in a narrow window (docs/DEMO_TASK.md): good enough that a long oracle
prefix lets it finish a hard problem (guided success >= a floor with r steps left), not so good
that it ever solves a hard problem alone (hard pass@k = 0 for the mining k). That window moves
with seed, learning rate and machine noise, so training evaluates at regular points and keeps the
first point that meets the criterion, rather than trusting a step count.

`train_base(config, workdir)` (the sft job: `python -m jaxprefix.main --config=configs/sft.py`)
writes <workdir>/base/ (local or gs://): model.safetensors, task_tokenizer.json (the character
vocabulary), generation_config.json and config.json (an ordinary HF directory, config.json
written after the weights), then sft_report.json (every evaluation point), whose presence marks
a finished SFT. While it trains, the progress bar shows the last point's criterion figures and
<workdir>/sft_evals.json holds every point so far.
"""

from __future__ import annotations

import json
import time

import jax.numpy as jnp
import numpy as np
import optax
import tqdm
from flax import nnx

from jaxprefix.checkpoints.hf import from_pretrained, save_pretrained
from jaxprefix import key_step_probe, models, run_config, sampling, storage, tokenizers
from jaxprefix.data import tasks
from jaxprefix.errors import ConfigError
from jaxprefix.rl.compute_ledger import update_flops
from jaxprefix.rl.sft import train_step  # the masked NLL's update, every weight trained

REPORT = "sft_report.json"
EVALS = "sft_evals.json"  # in the workdir: every evaluation point so far, rewritten at each
TOKENIZER = tokenizers.CHAR_VOCAB_FILE


def task_of(config):
    """The built-in task module the SFT config trains on (config.task)."""
    return tasks.get(config.task)


def model_config(config, tokenizer) -> models.ModelConfig:
    """The tiny policy: config.model gives layers, width, heads and MLP size; llama-family, or
    with model.experts a Qwen3-MoE whose every MLP routes each token to experts_per_token
    experts of width mlp_width / experts_per_token (the dense MLP's active width)."""
    m = config.model
    task = task_of(config)
    experts = m.get("experts", 0)
    moe = {}
    if experts:
        k = m.experts_per_token
        moe = dict(model_type="qwen3_moe", qk_norm=True, num_experts=experts,
                   num_experts_per_tok=k, moe_intermediate_size=m.mlp_width // k,
                   norm_topk_prob=True)
    return models.ModelConfig(**{
        "model_type": "llama", "vocab_size": tokenizer.vocab_size, "hidden_size": m.width,
        "intermediate_size": m.mlp_width, "num_layers": m.layers, "num_heads": m.heads,
        "num_kv_heads": m.heads, "head_dim": m.width // m.heads,
        "max_position_embeddings": task.sequence_length(config.data), "eos_token_ids": (tokenizer.eos_id,),
        "pad_token_id": tokenizer.pad_id, **moe})


def training_batch(config, step: int, tokenizer) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tokens, real-token mask, loss mask), each [batch, the task's sequence_length], for one
    SFT step.

    The rows are the task's `sft_batch`. On carry_multiplication, lengths 1..20 and a
    `full_length_fraction` of rows with all 20 digits: with lengths uniform alone the last slot
    is trained on 5% of rows and stays far behind the first (measured: 0.07 vs 0.75 probability
    of a right step at the same point). Each step's notation is drawn at random so the policy
    writes both (PrefixRL's traces then differ from the oracle). A `hinted_fraction` of rows
    gives its first steps as a hint in the prompt, which the target copies: the policy learns to
    read guidance (POPE's 'instruction' mode).
    """
    task = task_of(config)
    rows = task.sft_batch(config.data, config.seed * 1_000_003 + step)
    tokens = np.full((len(rows), task.sequence_length(config.data)), tokenizer.pad_id, np.int32)
    loss_mask = np.zeros(tokens.shape, np.float32)
    for row, (problem, solution) in enumerate(rows):
        ids, mask = task.training_ids(problem, solution, tokenizer)
        tokens[row, :len(ids)] = ids
        loss_mask[row, :len(ids)] = mask
    return tokens, tokens != tokenizer.pad_id, loss_mask


def criterion_hard_set(config) -> list:
    """The criterion's hard problems, written in the notation the base is trained in (on
    keyed_multiplication with data.key_names_rule, key steps that name their rule)."""
    task, criterion = task_of(config), config.criterion
    named = hasattr(task, "restating_notation") and task.restating_notation(config.data)
    return task.hard_set(criterion.hard_count, seed=criterion.hard_seed,
                         **({"names_rule": True} if named else {}))


def step_accuracies(model, problems, tokenizer, task) -> tuple[float, float, float]:
    """Teacher-forced, given the oracle prefix: (the fraction of steps whose digits are all the
    argmax, the mean probability of the first step's digits, the mean probability of the
    first step's marker). A policy with per-step accuracy p solves an N-step problem about p^N
    of the time; the first step is keyed_multiplication's key step, the one the base rarely
    finds. With key steps that name their rule, the last two are P(right d c | the oracle's
    name, '>' on a hard problem) and P(that name | the question): rho and a of
    docs/results/pope/PREDICTIONS.md, whose product is about eps."""
    name, first, _, accuracy = key_step_probe.steps(model, problems,
                                                    [p.solution for p in problems], tokenizer,
                                                    task)
    return accuracy, float(first.mean()), float(name.mean())


def step_accuracy(model, problems, tokenizer, task=tasks.carry_multiplication) -> float:
    """The fraction of steps whose digits are all the argmax, teacher-forced (step_accuracies)."""
    return step_accuracies(model, problems, tokenizer, task)[0]


GUIDES = {"instruction": "hinted", "solution_prefix": "guided"}  # each task's function


def success_counts(model, problems, tokenizer, *, n: int, prefix_steps: int, seed: int,
                   guidance: str = "solution_prefix",
                   task=tasks.carry_multiplication) -> np.ndarray:
    """Successes out of n samples (temperature 1) per problem, given `prefix_steps` oracle steps
    as a hint in the prompt ('instruction') or as the start of the answer ('solution_prefix')."""
    guided = [getattr(task, GUIDES[guidance])(p, prefix_steps) for p in problems]
    contexts = [tokenizer.encode(p.question) for p in guided]
    rollouts = sampling.generate(model, contexts, n=n, max_new_tokens=task.MAX_COMPLETION_LENGTH,
                                 temperature=1.0, stop_ids=(tokenizer.eos_id,), seed=seed)
    completions = rollouts.completions(keep_stop=True)
    scores = [task.verify(tokenizer.decode(ids), guided[row // n])
              for row, ids in enumerate(completions)]
    return np.asarray(scores).reshape(len(problems), n).sum(axis=1)


def evaluate(model, hard, tokenizer, criterion, seed: int, always_sample: bool = False,
             task=tasks.carry_multiplication) -> dict:
    """The criterion measurements at one point: per-step accuracy (and the first step's
    probability), hard pass@k, guided success with r of the task's HARD_STEPS steps left.

    Sampling is skipped (None) while the teacher-forced step accuracy is under
    `criterion.sample_from_step_accuracy`: guided success with r steps left is about p^r, so
    below that gate the floor cannot be met, and the cheap forward pass saves minutes.
    """
    accuracy, first_step, marker = step_accuracies(model, hard, tokenizer, task)
    metrics = {"step_accuracy": accuracy, "first_step_probability": first_step,
               f"hard_pass@{criterion.k}": None, "hard_successes": None, "guided_success": None}
    if hard and hard[0].metadata.get("key_names_rule"):  # the restating route's a (rho: above)
        metrics["key_name_probability"] = marker
    if metrics["step_accuracy"] < criterion.sample_from_step_accuracy and not always_sample:
        return metrics
    hard_successes = success_counts(model, hard, tokenizer, n=criterion.k, prefix_steps=0,
                                    seed=seed, task=task)
    metrics[f"hard_pass@{criterion.k}"] = float((hard_successes > 0).mean())
    metrics["hard_successes"] = int(hard_successes.sum())
    metrics["guided_success"] = {}
    for steps_left in sorted({*criterion.report_steps_left, criterion.steps_left}):
        counts = success_counts(model, hard, tokenizer, n=criterion.guided_samples,
                                prefix_steps=task.HARD_STEPS - steps_left, seed=seed + steps_left,
                                guidance=criterion.guidance, task=task)
        metrics["guided_success"][str(steps_left)] = float(counts.mean() / criterion.guided_samples)
    return metrics


def meets_criterion(metrics: dict, criterion) -> bool:
    """Hard pass@k = 0 (where criterion.hard_unsolved) and guided success with `steps_left`
    steps left at least the floor."""
    return ((metrics["hard_successes"] == 0 or not criterion.hard_unsolved)
            and metrics["guided_success"][str(criterion.steps_left)] >= criterion.guided_floor)


def train_base(config, workdir: str) -> str:
    """Trains (or reuses) the base model; returns the path of <workdir>/base."""
    path = storage.join(workdir, "base")
    report_path = storage.join(path, REPORT)
    settings = config.to_dict()
    if storage.exists(report_path):
        saved = _with_defaults(storage.read_json(report_path)["config"],
                               run_config.sft_base_config().to_dict())
        saved = _with_defaults(saved, _present(ADDED_SINCE, settings))
        if saved != json.loads(json.dumps(settings)):
            raise ConfigError(f"{report_path}: a base model trained with another SFT config is "
                              f"already there; expected the same config.sft, or remove {path}, "
                              f"or use another --workdir")
        return path

    task = task_of(config)
    tokenizer = task.tokenizer()
    model = models.Decoder(model_config(config, tokenizer), rngs=nnx.Rngs(config.seed))
    schedule = optax.join_schedules(
        [optax.linear_schedule(0.0, config.lr, config.warmup_steps),
         optax.constant_schedule(config.lr)],
        [config.warmup_steps])
    optimizer = nnx.Optimizer(model, optax.adamw(schedule, weight_decay=config.weight_decay),
                              wrt=nnx.Param)
    criterion = config.criterion
    hard = criterion_hard_set(config)

    evals, chosen, chosen_state, losses, figures = [], None, None, [], {}
    tokens_trained = 0  # real tokens through the updates: the base's SFT FLOPs (6 N D)
    start = time.time()
    bar = tqdm.trange(1, config.max_steps + 1, desc="sft", dynamic_ncols=True)
    for step in bar:
        batch = training_batch(config, step, tokenizer)
        loss = train_step(model, optimizer, *map(jnp.asarray, batch))
        losses.append(float(loss))
        tokens_trained += int(batch[1].sum())
        if step % 10 == 0:
            bar.set_postfix(loss=f"{np.mean(losses[-10:]):.3f}", **figures)
        at_eval_point = step >= config.eval_start and step % config.eval_every == 0
        if not (at_eval_point or step == config.max_steps):
            continue
        metrics = {"step": step, "loss": float(np.mean(losses[-config.eval_every:])),
                   **evaluate(model, hard, tokenizer, criterion, seed=config.seed + step,
                              always_sample=step == config.max_steps, task=task),
                   "tokens_trained": tokens_trained, "seconds": round(time.time() - start, 1)}
        evals.append(metrics)
        # The criterion's figures on the bar; every point's in the workdir (and the report).
        figures = _criterion_figures(metrics, criterion)
        storage.write_json(storage.join(workdir, EVALS), evals)
        if metrics["hard_successes"] is None:
            continue
        if metrics["hard_successes"] and criterion.hard_unsolved:
            break  # past the window: more training only makes hard problems easier
        if chosen is None or _closer(metrics, chosen, criterion):
            chosen, chosen_state = metrics, nnx.clone(model)
        if meets_criterion(metrics, criterion):
            break
    bar.close()
    if chosen is None:
        last = evals[-1] if evals else None
        raise RuntimeError(f"SFT: no evaluation point had hard pass@{criterion.k} = 0 after "
                           f"sampling began (last: {last}); lower config.lr or "
                           f"criterion.sample_from_step_accuracy, or raise config.max_steps")

    shape = model_config(config, tokenizer)
    save_pretrained(chosen_state, shape, path, tokenizer=tokenizer)
    # The updates up to the chosen point (its evaluations' sampling is not counted).
    flops = update_flops(shape.num_params(), chosen["tokens_trained"])
    report = {"chosen_step": chosen["step"], "criterion_met": meets_criterion(chosen, criterion),
              "flops": flops,
              "criterion": criterion.to_dict(), "evals": evals, "train_losses": losses,
              "seconds": round(time.time() - start, 1), "config": settings}
    storage.write_json(report_path, report)
    return path


# Task fields added after bases were saved, at the value that draws nothing: a base saved
# without one is the base a config leaving it there asks for.
ADDED_SINCE = {"data": {"restated_taught": 0.0}}


def _present(fields: dict, settings: dict) -> dict:
    """The part of `fields` that `settings` has (a task's field is not another task's)."""
    return {k: _present(v, settings[k]) if isinstance(v, dict) else v
            for k, v in fields.items() if k in settings}


def _with_defaults(saved: dict, defaults: dict) -> dict:
    """A saved SFT config with the fields added since it was saved at their defaults: a base
    trained before a field existed is the base a config leaving it at its default asks for."""
    out = dict(saved)
    for name, value in json.loads(json.dumps(defaults)).items():
        if name not in out:
            out[name] = value
        elif isinstance(value, dict) and isinstance(out[name], dict):
            out[name] = _with_defaults(out[name], value)
    return out


def _criterion_figures(metrics: dict, criterion) -> dict[str, str]:
    """The last evaluation point's criterion figures, short, for the progress bar."""
    guided = (metrics["guided_success"] or {}).get(str(criterion.steps_left))
    return {"eval_step": str(metrics["step"]), "step_acc": f"{metrics['step_accuracy']:.2f}",
            f"hard_pass@{criterion.k}": "-" if metrics["hard_successes"] is None
            else f"{metrics[f'hard_pass@{criterion.k}']:.2f}",
            f"guided@{criterion.steps_left}_left": "-" if guided is None else f"{guided:.2f}"}


def is_complete(path: str) -> bool:
    """A whole base directory, else it is trained again instead of half loaded: save_pretrained
    writes config.json last, so a save cut short (a kill, a full disk) leaves none; the weights'
    headers and sizes are checked too (older jaxprefix wrote config.json first)."""
    from jaxprefix.checkpoints import hf

    if not storage.exists(storage.join(path, "config.json")):
        return False
    try:
        hf.read_hf_tensors(path)  # headers and sizes; the tensors are memory-mapped, not read
    except (OSError, ValueError):
        return False
    return True


def _closer(metrics: dict, best: dict, criterion) -> bool:
    """Among points with hard pass@k = 0, prefer the one with the higher guided success."""
    key = str(criterion.steps_left)
    return metrics["guided_success"][key] >= best["guided_success"][key]


def load_base(path: str, dtype="float32", param_dtype=None):
    """(model, tokenizer) of a base directory written by train_base (dtypes: see from_pretrained)."""
    model, _ = from_pretrained(path, dtype, param_dtype=param_dtype)
    return model, tokenizers.load(path)
