"""The learner's and the loop's settings, read from the config once, at the door.

    learner = validate(config, contexts_per_step=...)   # TrainConfig, every loop field checked
    loop = loop_settings(config)                        # rl/loop_settings.LoopSettings

Each error is one line naming the field. Below this, rl.loop and the learner take the typed
objects and read no config.
"""
from __future__ import annotations

import dataclasses

from jaxprefix import rewards
from jaxprefix.config_reads import unwrapped
from jaxprefix.errors import need
from jaxprefix.models import lora
from jaxprefix.rl import objectives
from jaxprefix.rl.loop_settings import (EvalSettings, LoopSettings, RewardSettings,
                                        check_rows, replays_routes)
from jaxprefix.rl.metrics import SEGMENT_ROWS
from jaxprefix.rl.train_config import TrainConfig
from jaxprefix.rl.wandb_writer import WandbSettings


def train_config(config) -> TrainConfig:
    """TrainConfig from `config.train` (its extra loop fields ignored); errors name config.train."""
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    values = {k: v for k, v in config.train.items() if k in fields}
    if not values.get("max_len") and values.get("aggregation") == "seq_mean_token_sum_norm":
        values["max_len"] = int(config.rollout.max_new_tokens)  # Dr. GRPO's constant normaliser
    # Score the distribution the rollouts were drawn from (greedy sampling: the raw model).
    sampling_t = float(config.rollout.temperature)
    if config.train.get("logprobs_at_sampling_temperature", True) and sampling_t > 0:
        values["temperature"] = sampling_t
    try:
        return TrainConfig(**values)
    except ValueError as e:
        raise ValueError(str(e).replace("TrainConfig.", "config.train.")) from None


def lora_config(config) -> lora.LoraConfig | None:
    """The adapters of `config.train.lora_rank` / `config.train.lora` (None: full fine-tuning)."""
    rank, fields = config.train.get("lora_rank", 0), config.train.get("lora", {})
    if rank == 0:
        return None
    try:
        return lora.LoraConfig(rank, **fields)
    except (TypeError, ValueError) as e:
        message = str(e).replace("LoraConfig.rank", "config.train.lora_rank")
        raise ValueError(message.replace("LoraConfig.", "config.train.lora.")) from None


def validate(config, mesh=None, contexts_per_step: int | None = None) -> TrainConfig:
    """Checks the loop's and the learner's settings before anything is loaded (the rollout
    block is its RolloutSpec's, the method's its MethodSettings': run_setup/run_settings.resolve
    makes all three); returns the learner's TrainConfig.

    contexts_per_step: the contexts a step samples, n times each (default: one per problem; a
    method with guided copies or prefixes has more)."""
    t, r = config.train, config.rollout
    need(t.advantage in objectives.ADVANTAGE_MODES, "config.train.advantage", t.advantage,
         f"one of {objectives.ADVANTAGE_MODES}")
    need(r.n >= 2, "config.rollout.n", r.n,
         f"n >= 2 samples per context: {t.advantage} advantages compare the samples of a group")
    if t.advantage == "pass_at_k":
        need(1 <= t.get("pass_k", 1) <= r.n, "config.train.pass_k", t.get("pass_k"),
             f"1 <= pass_k <= rollout.n={r.n}")
    need(t.problems_per_step >= 1, "config.train.problems_per_step", t.problems_per_step,
         ">= 1")
    need(t.total_steps >= 0, "config.train.total_steps", t.total_steps, ">= 0")
    need(t.max_refill_rounds >= 0, "config.train.max_refill_rounds", t.max_refill_rounds,
         ">= 0")
    need(t.max_staleness >= 0, "config.train.max_staleness", t.max_staleness,
         ">= 0 (0: synchronous)")
    need(t.get("wait_timeout_s", 1800.0) > 0, "config.train.wait_timeout_s",
         t.get("wait_timeout_s"), "> 0 seconds")
    need(t.max_staleness == 0 or r.max_turns == 1, "config.train.max_staleness", t.max_staleness,
         f"0 with rollout.max_turns={r.max_turns}: multi-turn episodes are sampled synchronously")
    need(not r.get("inflight_kv") or t.max_staleness > 0, "config.rollout.inflight_kv",
         r.get("inflight_kv"), "'' with train.max_staleness=0: a synchronous step's decode has "
         "no newer weights to take")
    partial_tokens = r.get("partial_tokens", 0)
    for clash, why in ((r.get("inflight_kv"), "rollout.inflight_kv: a continued row's KV is "
                        "recomputed already"),
                       (r.max_turns > 1, "rollout.max_turns > 1: episodes are sampled whole"),
                       (t.get("dynamic_sampling"), "train.dynamic_sampling: the batch is "
                        "filled with ended groups, not refilled")):
        need(not (partial_tokens and clash), "config.rollout.partial_tokens", partial_tokens,
             f"0 with {why}")
    need(config.checkpoint.every >= 1, "config.checkpoint.every", config.checkpoint.every,
         ">= 1")
    need(config.checkpoint.keep >= 1, "config.checkpoint.keep", config.checkpoint.keep, ">= 1")
    need(config.eval.every >= 0, "config.eval.every", config.eval.every, ">= 0 (0: never)")
    lora_config(config)
    reward_settings(config)
    learner_config = train_config(config)
    check_rows(learner_config, contexts_per_step or t.problems_per_step, r.n, mesh,
               problems_per_step=t.problems_per_step)
    return learner_config


def routing_replay(config, mixture_of_experts: bool) -> bool:
    """Whether the sampler records a MoE's experts and the learner replays them
    (config.train.routing_replay), one-turn rows and multi-turn episodes alike (each episode's
    sequence carries its tokens' experts: tools/episodes.py); a dense model refuses it and
    router_aux_coef when set."""
    t = config.train
    value = t.get("routing_replay", "auto")
    need(value in ("auto", "on", "off"), "config.train.routing_replay", value,
         "'auto', 'on' or 'off'")
    if not mixture_of_experts:
        need(value == "auto", "config.train.routing_replay", value,
             "'auto' on a dense model (it has no experts to replay)")
        need(not t.get("router_aux_coef", 0.0), "config.train.router_aux_coef",
             t.get("router_aux_coef"), "0 on a dense model (it has no router to balance)")
    replays = replays_routes(value, mixture_of_experts)
    partial_tokens = config.rollout.get("partial_tokens", 0)
    need(not (replays and partial_tokens), "config.rollout.partial_tokens", partial_tokens,
         "0 with routing replay on a mixture of experts (a continued row's experts are not "
         "recorded across its rounds; train.routing_replay='off' allows it)")
    return replays


def reward_settings(config) -> RewardSettings:
    """How rollouts are scored: data.verifier (or rewards.path's function) and rewards.*."""
    r = config.rewards
    return RewardSettings(verifier=rewards.verifier_name(r.get("path", ""), config.data.verifier),
                          timeout_s=r.timeout_s, workers=r.workers or None,
                          max_chars=r.max_chars)


def wandb_settings(config) -> WandbSettings | None:
    """config.metrics' W&B run (None unless metrics.wandb)."""
    m = config.get("metrics")
    if m is None or not m.wandb:
        return None
    # The whole config as the run's record: not a read of its fields (config_reads).
    return WandbSettings(project=m.wandb_project, mode=m.wandb_mode,
                         run_config=unwrapped(config).to_dict())


def eval_settings(e) -> EvalSettings:
    """config.eval's settings: the evaluation's plan, read whole even where eval.every is 0 (a
    variant's plan stays acceptable to a run that turns evaluation off)."""
    return EvalSettings(every=e.every, before_train=bool(e.get("before_train", False)),
                        greedy=bool(e.get("greedy", False)), ks=tuple(e.ks), n=e.n,
                        hard_set=bool(e.get("hard_set", False)),
                        key_step_probe=bool(e.get("key_step_probe", False)))


def loop_settings(config) -> LoopSettings:
    """The RL loop's settings (rl/loop_settings.py) of a config `validate` has checked."""
    t, e = config.train, config.eval
    return LoopSettings(
        seed=config.seed, n=config.rollout.n, total_steps=int(t.total_steps),
        rewards=reward_settings(config),
        eval=eval_settings(e),
        advantage=t.advantage, pass_k=t.get("pass_k", 1),
        dynamic_sampling=bool(t.dynamic_sampling), max_refill_rounds=t.max_refill_rounds,
        mask_truncated=bool(t.get("mask_truncated", False)),
        max_staleness=int(t.get("max_staleness", 0)),
        wait_timeout_s=float(t.get("wait_timeout_s", 1800.0)),
        flops_budget=float(t.get("flops_budget", 0.0)),
        checkpoint_every=config.checkpoint.every, checkpoint_keep=config.checkpoint.keep,
        segment_rows=config.metrics.get("segment_rows", SEGMENT_ROWS),
        adapters=lora_config(config),
        routing_replay=t.get("routing_replay", "auto"), wandb=wandb_settings(config))
