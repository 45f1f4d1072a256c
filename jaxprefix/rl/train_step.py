"""The learner: TrainState and ONE jitted update over a rollout batch (its settings and optimizer:
rl/train_config.py).

The update is a pure function of (TrainState, batch): the batch is cut into minibatches (one
optimizer step each, `num_epochs` passes), each minibatch into micro-batches whose gradients are
summed in a `lax.scan`; the loss of a micro-batch is normalised by its minibatch's totals, so the
sum is exactly the minibatch gradient. How rows are laid into micro-batches (sorted, cut to the
shortest width that holds them, skipped where every advantage is 0) is rl/batch_layout.py's. Old
log-probs come from the sampler; on the first minibatch the policy still equals the sampler's,
so `ratio/first_max_abs_dev` and `mismatch/*` measure how far sampler and learner disagree. With
`old_logprobs='learner'` the same jitted update first runs one forward over the batch to
recompute them (and reports `rollout/logprob_mismatch_mean`/`_max`); `tis_cap` then re-weights
each token by min(pi_old / pi_sampler, cap) (truncated importance sampling) and `ratio_mask`
drops the policy-gradient term of tokens whose ratio leaves [1/c, c] (IcePop). A non-finite
loss or gradient leaves params and optimizer state untouched and is counted in
`TrainState.skipped`.

Mixed precision: params and the AdamW moments stay in the model's `param_dtype` (float32 master
weights); each layer casts its weights to the compute `dtype` (bfloat16 on TPU) inside the
forward, so gradients arrive in param_dtype. The sampler gets `sampling_model`: a compute-dtype
copy of the weights, cast once per RL step.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx, struct
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxprefix.errors import need
from jaxprefix.models import lora, moe
from jaxprefix.models.scoring import token_logprobs
from jaxprefix.models.sharding import constrain_params, state_shardings
from jaxprefix.rl import batch_layout, objectives
from jaxprefix.rl.train_config import (BATCH_AXES, TrainConfig, learning_rate_schedule,
                                        make_optimizer)


@struct.dataclass
class TrainState:
    """Everything the update changes. `step`: rollout batches seen; `updates`: optimizer updates
    applied; `skipped`: updates refused for a non-finite loss or gradient."""
    params: Any
    opt_state: Any
    step: jax.Array
    updates: jax.Array
    skipped: jax.Array


def _tree_select(ok, new, old):
    return jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, old)


class Learner:
    """Owns the model's graph, the optimizer and the jitted update; state lives in TrainState.

    `model` is an nnx Decoder already placed on `mesh` (models.sharding.shard_model) or on one
    device when mesh is None. With adapters (models.lora) only they are trained, held in the
    optimizer state and checkpointed; the base stays frozen in `rest`.
    """

    def __init__(self, model: nnx.Module, config: TrainConfig, mesh=None):
        need(config.router_aux_coef == 0 or any(model.config.sparse_layers),
             "TrainConfig.router_aux_coef", config.router_aux_coef,
             "0 on a dense model (it has no router to balance)")
        self.config = config
        self.mesh = mesh
        self.compute_dtype = jnp.dtype(model.config.dtype)
        self.graphdef, params, self.rest = nnx.split(model, lora.trainable(model), ...)
        self._initial_params = params
        # The learner's own graph; the sampler's (self.graphdef, via model()) stays as loaded.
        self._train_graphdef = _remat_graph(model) if config.remat else self.graphdef
        self.optimizer = make_optimizer(config)

    @property
    def batch_shards(self) -> int:
        if self.mesh is None:
            return 1
        return self.mesh.shape["data"] * self.mesh.shape["fsdp"]

    def initial_params(self):
        """A copy of the model's initial trained weights (e.g. the frozen KL reference). With
        adapters these are the initial adapters, whose B = 0 makes the policy exactly its base:
        the reference then costs no copy of the base."""
        return jax.tree.map(lambda x: x.copy(), self._initial_params)

    def init_state(self) -> TrainState:
        """A fresh state from the model's initial weights (copied: updates donate their input)."""
        params = self.initial_params()
        with self._mesh_context():
            opt_state = self._init_optimizer()(params)
        zero = lambda: jnp.zeros((), jnp.int32)  # distinct buffers: the state is donated
        state = TrainState(params=params, opt_state=opt_state, step=zero(), updates=zero(),
                           skipped=zero())
        # Commit every leaf: the update's outputs are committed, and an uncommitted first input
        # would compile the update a second time. Leaves left on one device (counters, Adam's
        # count) are replicated over the mesh.
        return jax.device_put(state, jax.tree.map(self._placement, state))

    def _placement(self, x):
        if self.mesh is None or len(x.sharding.device_set) == self.mesh.size:
            return x.sharding
        return NamedSharding(self.mesh, P())

    def model(self, state: TrainState) -> nnx.Module:
        """The policy with `state`'s parameters (the master weights, in param_dtype; with
        adapters, the frozen base and `state`'s adapters)."""
        return nnx.merge(self.graphdef, state.params, self.rest)

    def sampling_model(self, state: TrainState, mesh=None, *,
                       detached: bool = False) -> nnx.Module:
        """The policy for the sampler: `state`'s weights cast to the compute dtype (a new bf16
        copy of f32 master weights, same shardings), or the weights themselves when they are
        already in it. Cast once per step; the sampler then reads half the bytes. Given the
        decode `mesh` (sampling.decode_mesh: the same devices, heads over 'tensor'), the copy is
        cast and laid out for it in one program, so no learner-layout copy is made. Adapters come
        folded into the (compute-dtype) base instead (lora.merged: a copy of the targeted weights,
        freed after sampling), which decodes faster than applying them per token
        (bench/bench_lora.py); LoraConfig.merged_sampling=False applies them and saves the copy.

        A `mesh` on other devices (rollout.devices: the sampler's own) gets the policy cast here
        and copied there. `detached`: no array of the result is one of `state`'s, which the next
        update donates (a sampler that runs during it needs its own)."""
        if mesh is not None and self.mesh is not None and \
                set(mesh.devices.flat).isdisjoint(self.mesh.devices.flat):
            policy = self.sampling_model(state)
            graphdef, weights = nnx.split(policy)
            return nnx.merge(graphdef, jax.device_put(weights, state_shardings(weights, mesh)))
        model = self.model(state)
        if lora.has_adapters(model):
            if model.adapters.config.merged_sampling:
                return lora.merged(model)  # the adapters folded into new arrays
            policy = model
        elif mesh is None or self.mesh is None or mesh == self.mesh:
            policy = nnx.merge(self.graphdef, _cast_floats(state.params, self.compute_dtype),
                               self.rest)
        else:
            return nnx.merge(self.graphdef, *self._sampling_copy(mesh)(state.params, self.rest))
        return _copied(policy, state.params) if detached else policy

    def lower_sampling_copy(self, state: TrainState, mesh) -> jax.stages.Lowered:
        """sampling_model's cast and reshard for the decode `mesh`, lowered for `state` (which
        may be abstract: the compile job); nothing runs."""
        return self._sampling_copy(mesh).lower(state.params, self.rest)

    @functools.lru_cache(maxsize=4)
    def _sampling_copy(self, mesh):
        shardings = (state_shardings(self._initial_params, mesh), state_shardings(self.rest, mesh))
        dtype = self.compute_dtype
        return jax.jit(lambda params, rest: (_cast_to(params, dtype), rest),
                       out_shardings=shardings)

    def place_batch(self, batch: dict) -> dict:
        """Host arrays -> device arrays sharded over the batch axes. Every process holds the whole
        global batch (the loop builds the same one everywhere) and places its own devices' rows."""
        if self.mesh is None:
            return {k: jnp.asarray(v) for k, v in batch.items()}
        sharding = NamedSharding(self.mesh, P(BATCH_AXES))

        def place(value):
            value = np.asarray(value)
            return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])
        return {k: place(v) for k, v in batch.items()}

    def logprobs(self, params, batch: dict) -> jax.Array:
        """Per-token log-probs [B, T] of batch['tokens'] under `params` (e.g. a frozen reference)."""
        with self._mesh_context():
            return _policy_logprobs(self._train_graphdef, params, self.rest, self.place_batch(batch),
                                    self.config.logprob_chunk, self.config.temperature)

    def update(self, state: TrainState, batch: dict) -> tuple[TrainState, dict]:
        """One rollout batch -> new state (the old one is donated) and scalar metrics."""
        rows = batch["tokens"].shape[0]
        self.config.check_batch(rows, self.batch_shards)
        if self.config.kl_coef > 0 and "ref_logprobs" not in batch:
            raise ValueError("TrainConfig.kl_coef > 0 needs batch['ref_logprobs']")
        with self._mesh_context():
            return _update(self._train_graphdef, self.config, self.mesh is not None, state, self.rest,
                           self.place_batch(batch))

    def memory_analysis(self, state: TrainState, batch: dict):
        """XLA's compiled memory statistics of `update` for batches shaped like `batch`; nothing
        runs. `temp_size_in_bytes` is what an update needs on top of its arguments."""
        return self.lower_update(state, self.place_batch(batch)).compile().memory_analysis()

    def lower_update(self, state: TrainState, batch: dict) -> jax.stages.Lowered:
        """The update lowered for `state` and placed `batch`, which may be abstract (sharded
        jax.ShapeDtypeStructs: abstract_state(), the compile job's batch); nothing runs."""
        self.config.check_batch(batch["tokens"].shape[0], self.batch_shards)
        with self._mesh_context():
            return _update.lower(self._train_graphdef, self.config, self.mesh is not None, state,
                                 self.rest, batch)

    def abstract_state(self) -> TrainState:
        """Shapes, dtypes and shardings of init_state()'s result, allocating nothing, for a model
        whose parameters are sharded jax.ShapeDtypeStructs (built with nnx.eval_shape)."""
        params = self._initial_params
        # The optimizer state's shardings are those init_state gets; compiling the tiny init
        # program is the faithful way to learn them. Leaves left on one device (Adam's count)
        # are replicated over the mesh, as there.
        with self._mesh_context():
            compiled = self._init_optimizer().lower(params).compile()
        replicated = NamedSharding(self.mesh, P()) if self.mesh is not None else None
        shardings = jax.tree.map(
            lambda s: s if replicated is None or len(s.device_set) == self.mesh.size else replicated,
            compiled.output_shardings)
        opt_state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                                 jax.eval_shape(self.optimizer.init, params), shardings)
        scalar = jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated)
        return TrainState(params=params, opt_state=opt_state, step=scalar, updates=scalar,
                          skipped=scalar)

    def _init_optimizer(self):
        """jit of optimizer.init with the moments sharded like the parameters (under the mesh)."""
        return jax.jit(lambda params: constrain_params(self.optimizer.init(params)))

    def _mesh_context(self):
        return contextlib.nullcontext() if self.mesh is None else jax.set_mesh(self.mesh)


def _copied(model: nnx.Module, params) -> nnx.Module:
    """`model` with a copy of each array it shares with `params` (the others kept as they are)."""
    shared = {id(x) for x in jax.tree.leaves(params)}
    graphdef, weights = nnx.split(model)
    return nnx.merge(graphdef, jax.tree.map(
        lambda x: x.copy() if id(x) in shared else x, weights))


@functools.partial(jax.jit, static_argnums=1)
def _cast_to(params, dtype):
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x,
                        params)


def _cast_floats(params, dtype):
    if all(x.dtype == dtype for x in jax.tree.leaves(params)
           if jnp.issubdtype(x.dtype, jnp.floating)):
        return params
    return _cast_to(params, dtype)


def frozen_fraction(params, learning_rate: float) -> float:
    """Share of the floating-point weights that an update of size `learning_rate` cannot move:
    nonzero w whose dtype's spacing around w is more than twice lr, so that w + lr rounds back to
    w (bfloat16 keeps 8 significant bits: a weight of 0.02 moves by steps of 1.2e-4). An AdamW
    step is about lr per weight, so a large share means training stalls silently."""
    leaves = [x for x in jax.tree.leaves(params) if jnp.issubdtype(x.dtype, jnp.floating)]
    frozen = total = 0
    for x in leaves:
        w = x.astype(jnp.float32)
        _, exponent = jnp.frexp(w)  # |w| = m * 2^exponent, m in [0.5, 1)
        half_spacing = jnp.ldexp(jnp.float32(jnp.finfo(x.dtype).eps / 4), exponent)
        frozen += int(jnp.sum((w != 0) & (half_spacing > learning_rate)))
        total += x.size
    return frozen / max(total, 1)


def _remat_graph(model: nnx.Module):
    """The graph of `model` with ModelConfig.remat on (a copy: `model` itself is unchanged)."""
    copy = nnx.merge(*nnx.split(model))
    copy.config = copy.config.replace(remat=True)
    return nnx.split(copy, lora.trainable(copy), ...)[0]


# --- pure functions under jit ----------------------------------------------------------------
# Module level with the graph and settings static: learners of equal models and settings share
# compiled code (a resumed run, a test suite).


def _token_logprobs(graphdef, params, rest, batch, chunk_size, temperature, router_load=False,
                    loss_tokens_only=False):
    """Log-probs and entropies of the batch's tokens; `loss_tokens_only`: at its loss tokens
    (completion_mask) alone, 0 elsewhere, which is all the loss reads."""
    model = nnx.merge(graphdef, params, rest)
    if "dropout_key" in batch:  # a training micro-batch: adapter dropout, when there is some
        lora.set_dropout_key(model, batch["dropout_key"])
    # batch["routes"] (a MoE, int [B, T, sparse layers, k]): the sampler's experts, replayed
    return token_logprobs(model, batch["tokens"], batch["token_mask"],
                          positions=batch["positions"], chunk_size=chunk_size,
                          temperature=temperature, routes=batch.get("routes"),
                          router_load=router_load,
                          wanted=batch["completion_mask"] > 0 if loss_tokens_only else None)


@functools.partial(jax.jit, static_argnums=(0, 4, 5))
def _policy_logprobs(graphdef, params, rest, batch, chunk_size, temperature):
    return _token_logprobs(graphdef, params, rest, batch, chunk_size, temperature)[0]


def _micro_loss(graphdef, c: TrainConfig, micro_batches: int, params, rest, micro, totals):
    balance = c.router_aux_coef > 0
    logp, entropy, *load = _token_logprobs(graphdef, params, rest, micro, c.logprob_chunk,
                                           c.temperature, router_load=balance,
                                           loss_tokens_only=True)
    mask = micro["completion_mask"]
    loss, stats = objectives.policy_loss(
        logp, micro["old_logprobs"], micro["advantages"], mask, eps_low=c.eps_low,
        eps_high=c.eps_high, ratio=c.ratio, aggregation=c.aggregation, max_len=c.max_len or None,
        ref_logp=micro.get("ref_logprobs"), kl_coef=c.kl_coef, kl_kind=c.kl_kind,
        sampler_logp=micro.get("sampler_logprobs"), tis_cap=c.tis_cap,
        ratio_mask=c.ratio_mask, **totals)
    if c.entropy_coef:
        loss = loss - objectives.entropy_bonus(entropy, mask, c.entropy_coef, c.aggregation,
                                               max_len=c.max_len or None, **totals)
    stats["entropy_sum"] = (jax.lax.stop_gradient(entropy) * mask).sum()
    if balance:  # the minibatch's mean over its micro-batches
        aux = moe.load_balancing_loss(load[0], micro["token_mask"].sum()) / micro_batches
        loss = loss + c.router_aux_coef * aux
        stats["router_aux_sum"] = jax.lax.stop_gradient(aux)
    return loss, stats


def _totals(c: TrainConfig, minibatch) -> dict:
    """What a minibatch's loss is normalised by (objectives.aggregate): its loss tokens and
    rows, taken before its rows are packed."""
    mask = minibatch["completion_mask"]
    if c.aggregation == "seq_mean_token_mean":
        sequences = (mask.sum(-1) > 0).sum()
    else:
        sequences = mask.shape[0] * mask.shape[1]
    return {"total_tokens": mask.sum(), "total_sequences": jnp.asarray(sequences, jnp.float32)}


def _minibatch_grads(graphdef, c: TrainConfig, sharded: bool, params, rest, minibatch, totals,
                     dropout_key):
    """Summed loss, gradient and stats over the micro-batches [micro-batches, micro, ...] of one
    minibatch, and the share of them computed; each micro-batch's loss is normalised by the
    minibatch's `totals`. Micro-batch i draws its (adapter) dropout from fold_in(dropout_key, i)."""
    mask = minibatch["completion_mask"]
    # The batch width as the default max_len: a micro-batch may be cut shorter (trim_widths)
    c = dataclasses.replace(c, max_len=c.max_len or mask.shape[-1])
    loss_fn = functools.partial(_micro_loss, graphdef, c, mask.shape[0])
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    widths = batch_layout.trim_widths(mask.shape[-1], c.width_steps)

    def body(carry, xs):
        loss_sum, grad_sum, stats_sum, computed_sum = carry
        micro, index = xs
        if sharded:
            micro = jax.lax.with_sharding_constraint(micro, P(BATCH_AXES))
        micro = {**micro, "dropout_key": jax.random.fold_in(dropout_key, index)}

        def computed(micro):
            (loss, stats), grads = batch_layout.at_shortest_width(grad_fn, widths, params, rest,
                                                                  micro, totals)
            return loss, stats, constrain_params(grads), jnp.ones((), jnp.int32)

        if c.skips_zero_advantage or c.pack_rows:  # only the branch taken runs
            worth = (batch_layout.has_signal if c.skips_zero_advantage
                     else batch_layout.has_tokens)
            loss, stats, grads, done = jax.lax.cond(worth(micro), computed, skipped, micro)
        else:
            loss, stats, grads, done = computed(micro)
        return (loss_sum + loss, jax.tree.map(jnp.add, grad_sum, grads),
                _combine_stats(stats_sum, stats), computed_sum + done), None

    first = jax.tree.map(lambda x: x[0], minibatch)
    _, stats_shape = jax.eval_shape(loss_fn, params, rest, first, totals)
    zero_grads = constrain_params(jax.tree.map(jnp.zeros_like, params))
    skipped = lambda micro: (jnp.zeros((), jnp.float32), _empty_stats(stats_shape), zero_grads,
                             jnp.zeros((), jnp.int32))
    init = (jnp.zeros((), jnp.float32), zero_grads, _empty_stats(stats_shape),
            jnp.zeros((), jnp.int32))
    indices = jnp.arange(mask.shape[0])
    (loss, grads, stats, computed), _ = jax.lax.scan(body, init, (minibatch, indices))
    return loss, grads, stats, computed / mask.shape[0]


@functools.partial(jax.jit, static_argnums=(0, 1, 2), donate_argnums=3)
def _update(graphdef, c: TrainConfig, sharded: bool, state: TrainState, rest, batch: dict):
    rows = batch["tokens"].shape[0]
    minibatch = rows // c.num_minibatches
    micro = c.micro_batch_size or minibatch
    arranged = jax.tree.map(
        lambda x: batch_layout.arrange(x, c.num_minibatches, minibatch // micro, micro), batch)
    totals = jax.vmap(functools.partial(_totals, c))(arranged)   # per minibatch
    if c.pack_rows:
        arranged = jax.vmap(functools.partial(batch_layout.pack,
                                              signal_only=c.skips_zero_advantage))(arranged)
    elif c.width_steps > 1 or c.skips_zero_advantage:
        arranged = batch_layout.sort_rows(arranged, by_length=c.width_steps > 1,
                                          by_signal=c.skips_zero_advantage)
    recomputed = {}
    if c.old_logprobs == "learner":  # before any update: state.params are the sampler's weights
        arranged, recomputed = _learner_old_logprobs(graphdef, c, sharded, state.params, rest,
                                                     arranged)
    # Minibatch visited by each optimizer update: num_epochs passes over the minibatches.
    order = jnp.tile(jnp.arange(c.num_minibatches), c.num_epochs)
    optimizer = make_optimizer(c)
    # Dropout masks: a function of (step, update, micro-batch), so a resumed run draws the same.
    step_key = jax.random.fold_in(jax.random.key(0), state.step)

    def one_update(carry, xs):
        params, opt_state, updates, skipped = carry
        position, index = xs
        mb, mb_totals = jax.tree.map(lambda x: x[index], (arranged, totals))
        loss, grads, stats, computed_share = _minibatch_grads(
            graphdef, c, sharded, params, rest, mb, mb_totals,
            jax.random.fold_in(step_key, position))
        grad_norm = optax.tree.norm(grads)
        ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        deltas, new_opt = optimizer.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, deltas)
        # A non-finite step is never written: the old params and optimizer state carry on.
        params = _tree_select(ok, new_params, params)
        opt_state = _tree_select(ok, new_opt, opt_state)
        carry = (params, opt_state, updates + ok, skipped + (~ok))
        return carry, {"loss": loss, "grad_norm": grad_norm, "ok": ok, "stats": stats,
                       "computed_share": computed_share}

    init = (state.params, state.opt_state, state.updates, state.skipped)
    (params, opt_state, updates, skipped), per_update = jax.lax.scan(
        one_update, init, (jnp.arange(order.size), order))
    new_state = TrainState(params=params, opt_state=opt_state, step=state.step + 1,
                           updates=updates, skipped=skipped)
    return new_state, {**_summarise(c, per_update, updates, skipped - state.skipped), **recomputed}


def _learner_old_logprobs(graphdef, c: TrainConfig, sharded: bool, params, rest, arranged):
    """(arranged batch, metrics): 'old_logprobs' recomputed by the learner at `params`, one
    micro-batch at a time and without dropout (as the sampler saw the policy), the sampler's
    kept as 'sampler_logprobs'; metrics: their mean and max |difference| over the loss tokens."""
    fields = ("tokens", "token_mask", "positions", "completion_mask") + (
        ("routes",) if "routes" in arranged else ())
    micros = {k: arranged[k].reshape((-1,) + arranged[k].shape[2:]) for k in fields}

    def one(micro):
        if sharded:
            micro = jax.lax.with_sharding_constraint(micro, P(BATCH_AXES))
        return _token_logprobs(graphdef, params, rest, micro, c.logprob_chunk, c.temperature,
                               loss_tokens_only=True)[0]

    sampler = arranged["old_logprobs"]
    learner = jax.lax.map(one, micros).reshape(sampler.shape)  # data to the loss, not params
    mean, largest = objectives.logprob_mismatch(sampler, learner, arranged["completion_mask"])
    metrics = {"rollout/logprob_mismatch_mean": mean, "rollout/logprob_mismatch_max": largest}
    return {**arranged, "old_logprobs": learner, "sampler_logprobs": sampler}, metrics


def _summarise(c: TrainConfig, per_update, updates, skipped_now):
    stats = per_update["stats"]
    first = jax.tree.map(lambda x: x[0], stats)
    total = {k: (v.min() if k == "ratio_min" else v.max() if k.endswith("_max") else v.sum())
             for k, v in stats.items()}
    tokens = jnp.maximum(total["tokens"], 1.0)
    ok = per_update["ok"]
    finite_mean = lambda x: jnp.where(ok, x, 0.0).sum() / jnp.maximum(ok.sum(), 1)
    metrics = objectives.finish_ratio_stats(total)
    metrics.update({
        "loss": finite_mean(per_update["loss"]),
        "grad_norm": finite_mean(per_update["grad_norm"]),
        "ratio/first_max_abs_dev": first["ratio_dev_max"],
        # the first minibatch's |log pi_learner - log pi_old| before any update: with the
        # sampler's log-probs as pi_old, the sampler-learner mismatch of each step's tokens
        "mismatch/first_logp_diff_mean": first["logp_diff_sum"] / jnp.maximum(first["tokens"], 1),
        "mismatch/first_logp_diff_max": first["logp_diff_max"],
        f"mismatch/first_past_{objectives.LOGP_DIFF_FAR}":
            first["logp_diff_far_sum"] / jnp.maximum(first["tokens"], 1),
        "entropy": total["entropy_sum"] / tokens,
        "kl": total["kl_sum"] / tokens,
        "lr": learning_rate_schedule(c)(updates),
        "updates": updates,
        "skipped_updates": skipped_now,
        "loss_tokens": total["tokens"],
        # the share of micro-batches computed (skip_zero_advantage skips the rest); every
        # minibatch has as many
        "update/computed_share": per_update["computed_share"].mean(),
    })
    if c.router_aux_coef:  # per optimizer update
        metrics["router/aux_loss"] = total["router_aux_sum"] / (c.num_minibatches * c.num_epochs)
    if c.tis_cap:
        metrics["tis/weight_mean"] = total["tis_weight_sum"] / tokens
        metrics["tis/capped_fraction"] = total["tis_capped_sum"] / tokens
    if c.ratio_mask:
        metrics["ratio_mask/masked_fraction"] = total["ratio_masked_sum"] / tokens
    return metrics


def _combine_stats(acc, new):
    return {k: (jnp.minimum(acc[k], v) if k == "ratio_min" else
                jnp.maximum(acc[k], v) if k.endswith("_max") else acc[k] + v)
            for k, v in new.items()}


def _empty_stats(shapes):
    """The identity of `_combine_stats`: every maximum is of a quantity >= 0 (ratios, their
    deviations), so 0 also reads right where no micro-batch was computed."""
    big = jnp.finfo(jnp.float32).max
    return {k: jnp.full(s.shape, big if k == "ratio_min" else 0, s.dtype)
            for k, s in shapes.items()}
