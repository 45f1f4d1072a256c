"""The RL loop: request -> sample -> reward -> advantages -> update, with eval and checkpoints.

A method (grpo, pope, prefixrl) decides what to sample each step through `RolloutRequest`s; the
loop knows nothing of papers. Everything a run needs to continue the same trajectory is
checkpointed: params, optimizer state, counters, the method's state (data order, pools,
schedules) and the running totals; the sampler's randomness is a function of (seed, step,
round), so a restart in the same workdir reproduces the run. SIGTERM (TPU preemption) finishes
the current step, saves, and returns.
"""
from __future__ import annotations

import contextlib
import dataclasses
import signal
import threading
import time
from typing import Any, Protocol

from absl import logging
import jax
from flax import nnx
import numpy as np
from tqdm.auto import tqdm

from jaxprefix import compile_log, distributed, sampling, storage
from jaxprefix.checkpoints import recovery
from jaxprefix.errors import CheckpointError
from jaxprefix.checkpoints.train_state import TrainCheckpointer
from jaxprefix.models import lora, sharding
from jaxprefix.rl import (boundaries, curves, dynamic_sampling, objectives, overlap, partial,
                          wandb_writer)
from jaxprefix.rl.eval_counts import EvalCountsWriter
from jaxprefix.rl.compute_ledger import sampling_flops, update_flops
from jaxprefix.rl.metrics import MetricsWriter
from jaxprefix.rl.loop_settings import LoopSettings, check_rows
from jaxprefix.rl.scoring import (EpisodeSource, RolloutRequest, Scored, evaluate,
                                  reward_metrics, round_seed, sample_and_score, turn_metrics)
from jaxprefix.rl.train_config import TrainConfig
from jaxprefix.rl.train_step import Learner, TrainState, frozen_fraction


class Method(Protocol):
    def next_request(self, step: int) -> RolloutRequest: ...
    def observe(self, request: RolloutRequest, rewards: np.ndarray) -> None: ...
    def eval_requests(self) -> dict[str, RolloutRequest]: ...
    def state(self) -> dict: ...
    def restore(self, state: dict) -> None: ...


# --- the learner's model ------------------------------------------------------------------

def adapted(model, adapters: lora.LoraConfig | None, seed: int, mesh=None):
    """`model` with fresh adapters (seeded by `seed`) placed on `mesh`, else `model` itself."""
    if adapters is None:
        return model
    model = lora.with_adapters(model, adapters, seed=seed)
    return model if mesh is None else sharding.shard_model(model, mesh)


def check_update_resolution(model, learning_rate: float) -> None:
    """Refuses to train weights held in a dtype too coarse for the learning rate: all-bf16 at
    lr 1e-6 (the paper's) leaves nearly every weight unchanged, and nothing else would say so.
    Refused rather than warned: the run would burn its whole budget learning nothing, and
    float32 master weights (with bf16 compute) fix it at 4 more bytes per parameter. Only the
    trained weights count: with LoRA the adapters (always f32), not the frozen base."""
    if learning_rate <= 0:
        return
    frozen = frozen_fraction(nnx.state(model, lora.trainable(model)), learning_rate)
    if frozen > 0.5:
        dtype = model.config.param_dtype
        raise ValueError(
            f"config.model.param_dtype={dtype} with config.train.learning_rate={learning_rate:g}: "
            f"{frozen:.0%} of the weights are too large for a step of {learning_rate:g} to change "
            f"them in {dtype} (it rounds away), so the run would not train; use "
            f"config.model.param_dtype=float32 (master weights; config.model.dtype stays the "
            f"compute dtype)")


# --- the loop -------------------------------------------------------------------------------

class Preempted(Exception):
    """A run stopped by SIGTERM after saving its checkpoint: rerun the same command to resume.

    Jobs raise it so that a pipeline of runs (demo, results, sweep) stops instead of starting
    the next run; main turns it into exit status 143 (128 + SIGTERM)."""


class _Preemption:
    """Turns SIGTERM into a flag checked between steps (main thread only)."""

    def __init__(self):
        self.requested = False
        self._previous = None

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)
        return self

    def _handle(self, signum, frame):
        self.requested = True

    def __exit__(self, *exc):
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
        return False


def _state_arrays(state: TrainState) -> dict:
    return {f.name: getattr(state, f.name) for f in dataclasses.fields(state)}


def _rollout_chunks(policy, tokenizer, method: Method, settings: LoopSettings, rollout,
                    step: int, stop_ids, record_routes: bool,
                    episodes: EpisodeSource | None = None,
                    carry: partial.Carry | None = None, version: int = 0) -> list[Scored]:
    """The step's scored rollouts: the method's request, then (dynamic sampling) more requests
    while too few groups carry signal, each round seeded by (run seed, step, round). `policy`:
    the model, or sampling.LiveWeights whose newer weights take over mid-decode. With `carry`
    (rollout.partial_tokens) the step's batch of ended groups, sampled by weights `version`
    (rl/partial.py)."""
    def scored(request, round_index):
        seed = round_seed(settings.seed, step, round_index)
        return sample_and_score(policy, tokenizer, request, settings.rewards, rollout=rollout,
                                stop_ids=stop_ids, seed=seed, record_routes=record_routes,
                                episodes=episodes)

    if carry is not None:
        keywords = rollout.sampler_keywords() | {"max_new_tokens": carry.partial_tokens}

        def next_request():
            request = method.next_request(step)
            boundaries.check_contexts(request.contexts, vocab_size=policy.config.vocab_size)
            return request

        def sample(contexts, n, seed):
            return sampling.generate(policy, contexts, n=n, stop_ids=stop_ids, seed=seed,
                                     **keywords)
        batch = carry.step(next_request, sample=sample, tokenizer=tokenizer,
                           scoring=settings.rewards, version=version,
                           seed=lambda r: round_seed(settings.seed, step, r))
        method.observe(batch.request, batch.rewards)
        return [batch]
    request = method.next_request(step)
    chunks = [scored(request, 0)]
    method.observe(request, chunks[0].rewards)
    target = len(request.contexts)
    while settings.dynamic_sampling and dynamic_sampling.needs_refill(
            [c.rewards for c in chunks], target, len(chunks) - 1, settings.max_refill_rounds):
        more = method.next_request(step)
        chunks.append(scored(more, len(chunks)))
        method.observe(more, chunks[-1].rewards)
    return chunks


def _batch(chunks: list[Scored], settings: LoopSettings) -> tuple:
    """(the groups selected, the update's batch) from a step's scored rollouts: as many groups
    as the method's request had contexts."""
    target = len(chunks[0].request.contexts)
    advantages = [np.asarray(objectives.group_advantages(
        c.rewards, settings.advantage, k=settings.pass_k)) for c in chunks]
    selection = dynamic_sampling.select_groups(
        [c.rewards for c in chunks], target, drop_zero_variance=settings.dynamic_sampling)
    batch = dynamic_sampling.build_batch(
        [c.rollouts for c in chunks], advantages, selection,
        mask_truncated=settings.mask_truncated)
    return selection, batch


@dataclasses.dataclass(frozen=True)
class _StepCost:
    sampled: int          # tokens the sampler processed (contexts prefilled + generated)
    generated: int
    forwarded: int        # tokens the update forwarded and backpropagated, over its epochs
    flops_sampling: float
    flops_update: float


def _step_cost(chunks: list[Scored], batch, n_params: int, learner_config: TrainConfig,
               with_reference: bool) -> _StepCost:
    sampled = sum(c.prefilled + c.generated for c in chunks)
    real = int(batch["token_mask"].sum())
    forwarded = real * learner_config.num_epochs
    # Forward-only passes of the update: the KL reference's, the old log-probs' recompute.
    forwards = with_reference + (learner_config.old_logprobs == "learner")
    return _StepCost(sampled, sum(c.generated for c in chunks), forwarded,
                     sampling_flops(n_params, sampled),
                     update_flops(n_params, forwarded) + forwards * sampling_flops(n_params, real))


def _step_record(chunks: list[Scored], selection, update_metrics, cost: _StepCost, totals: dict,
                 *, step_seconds: float, update_seconds: float) -> dict[str, float]:
    """The step's metrics.jsonl row (evaluation scores are added to it on eval steps)."""
    record = reward_metrics(chunks[0]) | turn_metrics(chunks)
    for chunk in chunks:
        record.update(chunk.figures or {})
    record.update({k: float(v) for k, v in update_metrics.items()})
    record.update({
        "dynamic/zero_variance_fraction": selection.zero_variance_fraction,
        "dynamic/refill_rounds": len(chunks) - 1,
        "dynamic/trainable_groups": int(selection.trainable.sum()),
        "completion_length/mean": float(np.mean([c.rollouts.lengths.mean() for c in chunks])),
        "truncated_fraction": float(np.mean([(~c.rollouts.stopped).mean() for c in chunks])),
        "tokens/sampled": cost.sampled,
        "tokens/generated": cost.generated,
        "tokens/trained": cost.forwarded,
        "tokens/sampled_total": totals["tokens_sampled"],
        "tokens/trained_total": totals["tokens_trained"],
        "flops/sampling": cost.flops_sampling,
        "flops/update": cost.flops_update,
        "flops/total": totals["flops"],
        "time/sampling": sum(c.seconds_sampling for c in chunks),
        "time/reward": sum(c.seconds_reward for c in chunks),
        "time/update": update_seconds,
        "time/step": step_seconds,
        "throughput/tokens_per_s": (cost.sampled + cost.forwarded) / max(step_seconds, 1e-9),
        "throughput/update_tokens_per_s": cost.forwarded / max(update_seconds, 1e-9),
    })
    return record


def _resume(ckpt, state: TrainState, method: Method, totals: dict, ledger,
            resumed: dict) -> TrainState:
    """The newest checkpoint that restores (a corrupt one: the one before), with the method's
    state, the running totals and the ledger (`resumed`: the checkpoint's metadata); `state`
    itself when there is none."""
    restored = recovery.restore_newest(ckpt, _state_arrays(state))
    if restored is None:
        return state
    _, arrays, meta = restored
    resumed.update(meta)
    method.restore(meta["method"])
    totals.update(meta["totals"])
    if ledger is not None and meta.get("ledger"):
        for k, v in type(ledger).from_dict(meta["ledger"]).to_dict().items():
            setattr(ledger, k, v)
    return TrainState(**arrays)


def _book(cost: _StepCost, chunks: list[Scored], totals: dict, ledger) -> None:
    """A step's tokens and FLOPs into the running totals and the ledger."""
    totals["tokens_sampled"] += cost.sampled
    totals["tokens_trained"] += cost.forwarded
    totals["flops"] += cost.flops_sampling + cost.flops_update
    if ledger is not None:
        for c in chunks:
            ledger.record_sampling(rollouts=len(c.rollouts.lengths),
                                   prefill_tokens=c.prefilled,
                                   generated_tokens=c.generated)
        ledger.record_update(tokens=cost.forwarded)


def _steps_in_budget(flops_budget: float, cost: _StepCost, totals: dict) -> int:
    """How many more steps like this one the FLOPs budget leaves (0 once it is spent); marks
    the totals spent when the next such step would pass it."""
    step_flops = cost.flops_sampling + cost.flops_update
    if totals["flops"] + step_flops > flops_budget:
        totals["budget_spent"] = True
    return 0 if totals.get("budget_spent") else int((flops_budget - totals["flops"]) // step_flops)


def train(settings: LoopSettings, workdir: str, *, method: Method, model, tokenizer,
          learner_config: TrainConfig,
          rollout: sampling.RolloutSpec, contexts_per_step: int, stop_ids=(), mesh=None,
          sampler_mesh=None, ledger=None, probe=None, episodes: EpisodeSource | None = None,
          progress: bool = True) -> dict[str, Any]:
    """Runs RL from the latest checkpoint in `workdir` (or from `model`) to settings.total_steps.

    settings, learner_config, rollout, contexts_per_step: the run's resolved settings (the
      loop's, the learner's, the sampler's and the method's contexts a step: run_setup/
      run_settings.resolve); only the step's rows against `mesh` are checked here.
    sampler_mesh: the sampler's own devices (rollout.devices > 0; None: it shares `mesh`); the
      weights are copied there after each update.
    model: the policy's initial weights (an nnx Decoder placed on `mesh`), also the KL reference;
      with settings.adapters the frozen base that adapters are trained on.
    ledger: an optional compute_ledger.ComputeLedger, updated and checkpointed with the run.
    probe: an optional function of the sampling model, called at each evaluation; its figures
      join the step's record (the rl job's key-step probe, eval.key_step_probe).
    episodes: the run's episode source (scoring.episode_source: tool episodes, or an external
      environment's against the policy served live on 127.0.0.1); every request, training and
      evaluation, is then sampled as its episodes. None: one turn a row.
    Returns {'step', 'preempted', 'metrics' (the last step's record)}.
    """
    check_rows(learner_config, contexts_per_step, settings.n, mesh)
    replay = settings.replays_routes(any(model.config.sparse_layers))
    # with LoRA: the frozen base plus fresh adapters
    model = adapted(model, settings.adapters, settings.seed, mesh)
    check_update_resolution(model, learner_config.learning_rate)
    learner = Learner(model, learner_config, mesh)
    # The sampler's weights are cast and laid out for decoding (heads over 'tensor' on TPU) in
    # one program a step; generate() then finds them in place.
    decode = None if mesh is None else sampling.decode_layout(mesh, model.config,
                                                              rollout.tensor_parallel)
    # The sampler's own devices (rollout.devices > 0), laid out for decoding there.
    sampler_decode = decode if sampler_mesh is None else sampling.decode_layout(
        sampler_mesh, model.config, rollout.tensor_parallel)
    ahead = settings.max_staleness  # > 0: rl/overlap.py samples ahead
    n_params = model.config.num_params()
    ckpt = TrainCheckpointer(f"{workdir}/checkpoints", max_to_keep=settings.checkpoint_keep)
    totals = {"tokens_sampled": 0, "tokens_trained": 0, "flops": 0.0}
    resumed: dict = {}
    state = _resume(ckpt, learner.init_state(), method, totals, ledger, resumed)
    start = int(state.step)
    # An evaluation before the first step is the run's step 0: a fresh start rewrites it.
    before = start == 0 and settings.eval.every and settings.eval.before_train
    resume_step = start if before else start + 1
    writer = MetricsWriter(workdir, resume_step=resume_step, segment_rows=settings.segment_rows)
    counts_writer = EvalCountsWriter(workdir, resume_step=resume_step,
                                     segment_rows=settings.segment_rows)
    tracker = wandb_writer.start(settings.wandb, workdir)  # None unless metrics.wandb
    ref_params = learner.initial_params() if learner_config.kl_coef > 0 else None

    # Partial rollouts: the groups sampled and not yet trained, carried from step to step.
    carry = None
    if rollout.partial_tokens:
        if episodes is not None or replay:  # refused at the door; a guard for direct callers
            raise ValueError("partial rollouts sample one turn a row with no routes to replay")
        carry = partial.Carry(rollout.partial_tokens, rollout.max_new_tokens)
        carry.restore(resumed.get("partial"))

    def save(step, final=False):
        # Sampling ahead: the sampler first samples all it may (the method's state then matches
        # the rollouts it holds), which are saved with it.
        in_flight = overlap.encode_in_flight(sampler.settle()) if sampler else None
        meta = {"method": method.state(), "totals": totals, "seed": settings.seed,
                "ledger": ledger.to_dict() if ledger is not None else None,
                "in_flight": in_flight, "partial": carry.state() if carry else None}
        # final: the run's last save is complete before it returns (made again if GCS failed it)
        ckpt.save(step, _state_arrays(state), meta, wait=final)

    total = settings.total_steps
    # A FLOPs budget (IsoCompute allocations) ends the run before a step like the last one
    # would pass it; a run that stopped so stays stopped when resumed.
    flops_budget = settings.flops_budget
    if totals.get("budget_spent"):
        total = start
    record: dict[str, Any] = {}
    bar = tqdm(total=total, initial=start, desc="rl", unit="step", disable=not progress)
    preempted = False

    def sampler_policy(state):
        return learner.sampling_model(state, sampler_decode, detached=ahead > 0)

    def sample_step(policy, step):
        return _rollout_chunks(policy, tokenizer, method, settings, rollout, step, stop_ids,
                               replay, episodes, carry,
                               overlap.sampling_version(step, ahead, start))

    sampler, publish_seconds = None, 0.0
    if ahead and start < total:
        sampler = overlap.AheadSampler(
            sample_step, max_staleness=ahead, start=start, total=total,
            in_flight=overlap.decode_in_flight(resumed.get("in_flight")),
            inflight_kv=rollout.inflight_kv, wait_s=settings.wait_timeout_s)
        sampler.publish(start, sampler_policy(state))
    # However the loop ends, the sampler thread stops after the step it is sampling.
    closing = contextlib.closing(sampler) if sampler else contextlib.nullcontext()
    with _Preemption() as preemption, ckpt, closing:
        def evaluated(step) -> dict:
            """The step's evaluation figures (eval counts written); its policy freed after."""
            eval_start = time.perf_counter()
            policy = learner.sampling_model(state, decode)
            # not a wait on the sampler thread: its deadline for new weights pauses meanwhile
            with sampler.evaluating() if sampler else contextlib.nullcontext():
                scores, counts = evaluate(policy, tokenizer, method, settings, rollout=rollout,
                                          step=step, stop_ids=stop_ids, episodes=episodes)
            counts_writer.write(step, counts)
            return scores | (probe(policy) if probe else {}) | {
                "time/eval": time.perf_counter() - eval_start}

        if before:
            writer.write(0, evaluated(0))
            _draw_curves(writer)
        compile_log.install()
        for step in range(start, total):
            step_start = time.perf_counter()
            compiled_before = compile_log.totals()
            if sampler is None:
                policy = sampler_policy(state)  # cast (and laid out) once a step
                chunks = sample_step(policy, step)
                del policy  # the sampler's compute-dtype copy: free before the update
                waited = time.perf_counter() - step_start
                sampled = overlap.Sampled(step, step, chunks, waited)
            else:  # sampled with older weights, maybe while the last update ran
                sampled, waited = sampler.take(step)
            chunks = sampled.chunks
            selection, batch = _batch(chunks, settings)
            update_start = time.perf_counter()
            if ref_params is not None:
                batch["ref_logprobs"] = np.asarray(learner.logprobs(ref_params, batch))
            boundaries.check_batch(batch)
            state, update_metrics = learner.update(state, batch)
            update_metrics = distributed.to_host(update_metrics)
            update_seconds = time.perf_counter() - update_start

            cost = _step_cost(chunks, batch, n_params, learner_config, ref_params is not None)
            _book(cost, chunks, totals, ledger)
            record = _step_record(chunks, selection, update_metrics, cost, totals,
                                  step_seconds=time.perf_counter() - step_start,
                                  update_seconds=update_seconds)
            record.update(overlap.step_metrics(sampled, waited, publish_seconds))
            compiled = compile_log.totals().minus(compiled_before)
            record.update(compiled.metrics())
            if step == start:  # a fresh process compiles, or reads the persistent cache
                logging.info("step %d took %.1f s, of which %s", step + 1,
                             record["time/step"], compiled.describe())
            done = step + 1
            if flops_budget:  # the bar counts the steps the budget leaves, not total_steps
                bar.total = min(total, done + _steps_in_budget(flops_budget, cost, totals))
            last = done == total or totals.get("budget_spent", False)
            if settings.eval.every and (done % settings.eval.every == 0 or last):
                record.update(evaluated(done))
            writer.write(done, record)
            if "time/eval" in record:
                _draw_curves(writer)
            if tracker is not None:
                tracker.write(done, record)
            bar.update(1)
            bar.set_postfix(reward=f"{record['reward/mean']:.3f}", loss=f"{record['loss']:.4f}")
            if done % settings.checkpoint_every == 0 or last or preemption.requested:
                save(done, final=last or preemption.requested)
            if sampler is not None and not last:  # the new weights, for the steps they sample
                published = time.perf_counter()
                sampler.publish(done, sampler_policy(state))
                publish_seconds = time.perf_counter() - published
            if preemption.requested:
                preempted = True
                break
            if last:
                break
    bar.close()
    writer.close()
    if tracker is not None:
        tracker.close()
    return {"step": int(state.step), "preempted": preempted, "metrics": record,
            "state": state, "learner": learner}


def _draw_curves(writer: MetricsWriter) -> None:
    """<workdir>/curves.png redrawn after an evaluation, by the process that writes metrics."""
    if writer.enabled:
        writer.flush()
        curves.plot_run(writer.workdir)


def restore_trained(model, workdir: str, learner_config: TrainConfig,
                    adapters: lora.LoraConfig | None, mesh=None, step: int | None = None):
    """(step, policy) of a checkpoint of `workdir` (`step`; None: the latest that restores):
    `model` with the checkpointed weights (with `adapters`, a copy of `model` carrying the
    trained ones), or (None, model) when the workdir has no checkpoint. `model` itself is left
    as it is."""
    ckpt = TrainCheckpointer(f"{workdir}/checkpoints")
    trained = model
    try:
        if step is not None and step not in ckpt.all_steps():
            raise CheckpointError(f"{ckpt.directory} has no step {step}: it holds "
                                  f"{ckpt.all_steps() or 'none'}")
        if ckpt.latest_step() is not None:
            learner = Learner(adapted(model, adapters, 0, mesh), learner_config, mesh)
            like = _state_arrays(learner.init_state())
            if step is None:
                step, arrays, _ = recovery.restore_newest(ckpt, like, move_aside=False)
            else:
                recovery.check_fits(storage.join(ckpt.directory, str(step)), like)
                arrays, _ = ckpt.restore(like, step)
            trained = nnx.merge(learner.graphdef, arrays["params"], learner.rest, copy=True)
    finally:
        ckpt.close()
    return step, trained


def restore_trained_params(model, workdir: str, learner_config: TrainConfig,
                           adapters: lora.LoraConfig | None, mesh=None) -> int | None:
    """Loads the latest checkpointed policy of `workdir` into `model` (in place; trained adapters
    folded into its weights); returns its step, or None (model untouched) without a checkpoint."""
    step, trained = restore_trained(model, workdir, learner_config, adapters, mesh)
    if step is not None:
        load_trained(model, trained)
    return step


def load_trained(model, trained) -> None:
    """Puts the weights of `trained` (a restore_trained policy) into `model`, in `model`'s dtypes,
    its adapters folded in (W + s A B)."""
    if lora.has_adapters(trained):
        trained = lora.merged(trained)
    nnx.update(model, jax.tree.map(lambda new, old: new.astype(old.dtype),
                                   nnx.state(trained, nnx.Param), nnx.state(model, nnx.Param)))
