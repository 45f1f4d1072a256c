"""Supervised fine-tuning on targets given their prompts: the negative log-likelihood of the
target tokens alone, the prompt carrying no loss (as in RL).

The papers' bases are instruct models that already write solutions of the oracle's kind; a small
chat model is taught that here (docs/results/smollm2_hard: SmolLM2 on chain_sum's worked
solutions) before the methods are tried on it. A model with adapters (models/lora.py) trains
only its adapters; a model without trains every weight. The update FLOPs are counted as 6 N D
over every token forwarded (the ledger's accounting), whatever is trained.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np
import optax
import tqdm
from flax import nnx

from jaxprefix import models
from jaxprefix.models import lora
from jaxprefix.rl.compute_ledger import update_flops


@dataclasses.dataclass(frozen=True)
class SftSettings:
    """`steps` updates of `batch_size` rows (examples drawn without replacement, epoch by
    epoch, in an order the seed fixes), Adam at `learning_rate` after a linear warmup over
    `warmup_steps` (a fresh Adam's first steps at the full rate jolt a trained policy)."""
    steps: int
    batch_size: int
    learning_rate: float
    warmup_steps: int = 10
    weight_decay: float = 0.0
    seed: int = 0

    def __post_init__(self):
        for name in ("steps", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"SftSettings.{name}={getattr(self, name)}: expected >= 1")
        if not self.learning_rate > 0:
            raise ValueError(f"SftSettings.learning_rate={self.learning_rate}: expected > 0")


def sft_rows(prompts, stop_id: int, examples: Sequence[tuple]) -> tuple[np.ndarray, ...]:
    """(tokens, real-token mask, loss mask) of each (problem, target ids) example: the
    unguided question as `prompts` renders it, the target, the stop token; right-padded, the
    loss on the target and the stop token only."""
    if not examples:
        raise ValueError("sft: no examples to train on")
    rows = []
    for problem, target in examples:
        context = list(prompts.question(problem))
        target = list(target) + [stop_id]
        rows.append((context + target, [0] * len(context) + [1] * len(target)))
    width = max(len(ids) for ids, _ in rows)
    tokens = np.zeros((len(rows), width), np.int32)  # padding is masked out by `real`
    loss_mask = np.zeros(tokens.shape, np.float32)
    real = np.zeros(tokens.shape, bool)
    for i, (ids, mask) in enumerate(rows):
        tokens[i, :len(ids)], loss_mask[i, :len(ids)], real[i, :len(ids)] = ids, mask, True
    return tokens, real, loss_mask


def masked_nll(model, tokens, real, loss_mask):
    """Mean negative log-likelihood of the loss-masked tokens."""
    logprobs, _ = models.token_logprobs(model, tokens, real)
    return -(logprobs * loss_mask).sum() / jnp.maximum(loss_mask.sum(), 1.0)


@nnx.jit
def train_step(model, optimizer, tokens, real, loss_mask):
    """One update of what the model trains (its adapters where it has them); the loss."""
    trained = nnx.DiffState(0, lora.trainable(model))
    loss, grads = nnx.value_and_grad(masked_nll, argnums=trained)(model, tokens, real, loss_mask)
    optimizer.update(model, grads)
    return loss


# Batches are cut to their longest row rounded up to this many tokens: little padding computed,
# and few widths, each compiled once.
WIDTH_STEP = 32


def _trimmed(tokens, real, loss_mask, rows):
    """The rows, cut to their longest real row rounded up to WIDTH_STEP."""
    longest = int(real[rows].sum(axis=1).max())
    width = min(tokens.shape[1], -(-longest // WIDTH_STEP) * WIDTH_STEP)
    return (jnp.asarray(tokens[rows, :width]), jnp.asarray(real[rows, :width]),
            jnp.asarray(loss_mask[rows, :width]))


def train(model, rows: tuple[np.ndarray, ...], settings: SftSettings, *,
          progress: str = "SFT") -> dict:
    """Trains `model` in place on `rows` (sft_rows); returns the report: losses a step, the
    update FLOPs, the settings."""
    tokens, real, loss_mask = rows
    schedule = optax.join_schedules(
        [optax.linear_schedule(0.0, settings.learning_rate, max(1, settings.warmup_steps)),
         optax.constant_schedule(settings.learning_rate)], [max(1, settings.warmup_steps)])
    optimizer = nnx.Optimizer(model, optax.adamw(schedule, weight_decay=settings.weight_decay),
                              wrt=lora.trainable(model))
    rng = np.random.default_rng(settings.seed)
    batch = min(settings.batch_size, len(tokens))
    order: list[int] = []
    n_params = model.config.num_params()
    flops, losses = 0.0, []
    for _ in tqdm.trange(settings.steps, desc=progress):
        if len(order) < batch:
            order += rng.permutation(len(tokens)).tolist()
        picked, order = np.array(order[:batch]), order[batch:]
        loss = train_step(model, optimizer, *_trimmed(tokens, real, loss_mask, picked))
        losses.append(float(loss))
        flops += update_flops(n_params, int(real[picked].sum()))
    return {"examples": len(tokens), "losses": losses, "flops": flops,
            "settings": dataclasses.asdict(settings)}
