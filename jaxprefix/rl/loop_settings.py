"""What the RL loop reads, typed: built once from the config at the door
(run_setup/learner_settings.loop_settings) and handed to rl.loop's train, sample_and_score and
evaluate, which read no config themselves.
"""
from __future__ import annotations

import dataclasses

from jaxprefix.models import lora
from jaxprefix.rl.metrics import SEGMENT_ROWS
from jaxprefix.rl.train_config import TrainConfig
from jaxprefix.rl.wandb_writer import WandbSettings


@dataclasses.dataclass(frozen=True)
class RewardSettings:
    """How rollouts are scored (config.data.verifier, config.rewards)."""
    verifier: str                # a registered name (a rewards file's too: rewards.verifier_name)
    timeout_s: float = 10.0      # per answer
    workers: int | None = None   # scoring processes; None: rewards.default_workers()
    max_chars: int = 0           # longer completions score 0 unread (0: no limit)


@dataclasses.dataclass(frozen=True)
class EvalSettings:
    """When and how the loop evaluates (config.eval)."""
    every: int = 0               # steps between evaluations (0: never)
    before_train: bool = False   # also at step 0, before the first update (verl's default)
    greedy: bool = False         # also one greedy sample a problem: what a user sees
    ks: tuple[int, ...] = (1,)   # the k of pass@k
    n: int = 1                   # samples a held-out problem
    hard_set: bool = False       # also the mined hard set's problems (eval/hard_*)
    key_step_probe: bool = False # the teacher-forced key-step figures (built-in tasks)


@dataclasses.dataclass(frozen=True)
class LoopSettings:
    """The loop's own settings: its length, how a step's groups become the update's batch,
    scoring, evaluation, checkpoints and metrics, the adapters trained and whether a MoE's
    routes are replayed."""
    seed: int
    n: int                                   # samples per context (config.rollout.n)
    total_steps: int
    rewards: RewardSettings
    eval: EvalSettings = EvalSettings()
    advantage: str = "grpo"                  # objectives.ADVANTAGE_MODES
    pass_k: int = 1                          # advantage 'pass_at_k'
    dynamic_sampling: bool = False           # DAPO: refill groups whose samples score alike
    max_refill_rounds: int = 0
    mask_truncated: bool = False             # completions cut at max_new_tokens get no loss
    max_staleness: int = 0                   # > 0: rl/overlap.py samples ahead
    wait_timeout_s: float = 1800.0           # the overlapped threads' deadline for each other
    flops_budget: float = 0.0                # > 0: stop before a step would pass it
    checkpoint_every: int = 25
    checkpoint_keep: int = 3
    segment_rows: int = SEGMENT_ROWS         # metrics.jsonl rows a segment
    adapters: lora.LoraConfig | None = None  # None: every weight trained
    routing_replay: str = "auto"             # 'auto' | 'on' | 'off' (checked at the door)
    wandb: WandbSettings | None = None       # None: no W&B run

    def replays_routes(self, mixture_of_experts: bool) -> bool:
        return replays_routes(self.routing_replay, mixture_of_experts)


def replays_routes(choice: str, mixture_of_experts: bool) -> bool:
    """Whether the sampler records a MoE's experts and the learner replays them, under
    train.routing_replay = `choice` ('auto' | 'on' | 'off', checked at the door)."""
    return mixture_of_experts and choice != "off"


def check_rows(learner_config: TrainConfig, contexts_per_step: int, n: int, mesh=None, *,
               problems_per_step: int | None = None) -> None:
    """A step's rows (contexts x n) split into the learner's minibatches over the row devices of
    `mesh` (none: one); the error names the fields that set them (with `problems_per_step`, its
    value too)."""
    shards = 1 if mesh is None else mesh.shape["data"] * mesh.shape["fsdp"]
    try:
        learner_config.check_batch(contexts_per_step * n, shards)
    except ValueError as e:
        problems = "" if problems_per_step is None else f"={problems_per_step}"
        raise ValueError(f"config.train.problems_per_step{problems} ({contexts_per_step} "
                         f"contexts) x config.rollout.n={n}: {e}") from None
