"""The learner's settings: optimizer, batching and loss (static under jit), checked once, and the
optimizer they make (global-norm clipping, then AdamW on a warmup + constant or cosine schedule).
"""
from __future__ import annotations

import dataclasses

import optax

from jaxprefix.errors import need
from jaxprefix.models.attention import POSITION_BITS
from jaxprefix.rl import objectives

# The mesh axes a batch's rows are sharded over (models.sharding's data parallelism).
BATCH_AXES = ("data", "fsdp")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Optimizer, batching and loss settings of the learner (static under jit)."""
    learning_rate: float = 1e-6
    schedule: str = "constant"          # 'constant' | 'cosine' (after warmup)
    warmup_steps: int = 0               # in optimizer updates
    decay_steps: int = 1000             # cosine: updates from the end of warmup to the floor
    min_lr_ratio: float = 0.0
    b1: float = 0.9
    b2: float = 0.999
    adam_eps: float = 1e-8
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    num_minibatches: int = 1            # optimizer updates per pass over the rollout batch
    num_epochs: int = 1                 # passes over the rollout batch
    micro_batch_size: int = 0           # rows per gradient-accumulation step; 0 = whole minibatch
    eps_low: float = 0.2
    eps_high: float = 0.2               # > eps_low is DAPO clip-higher
    ratio: str = "token"                # 'token' | 'sequence' (GSPO)
    aggregation: str = "token_mean"
    max_len: int = 0                    # seq_mean_token_sum_norm normaliser; 0 = batch width
    kl_coef: float = 0.0                # > 0 needs batch['ref_logprobs']
    kl_kind: str = "k3"
    logprob_chunk: int = 1024           # tokens per vocabulary-projection chunk in token_logprobs
    # Log-probs (and the loss) of softmax(logits / temperature): the sampling temperature, so the
    # learner scores the distribution the rollouts came from (TRL, verl, Tunix); 1 = the raw model.
    temperature: float = 1.0
    entropy_coef: float = 0.0           # > 0: an entropy bonus, - coef * entropy (aggregated)
    # Recompute each decoder layer in the backward pass instead of keeping its activations
    # (attention scores are [rows, heads, T, T] per layer): one more forward of compute, and
    # SmolLM2-135M at 16 x 512 tokens needs 3.0 instead of 20.4 GiB of XLA temporaries.
    remat: bool = False
    # The pi_old of the ratio: 'sampler' (the log-probs the rollouts carry) or 'learner' (one
    # extra forward at the start of the update recomputes them at the weights the sampler used,
    # in the learner's numerics: the sampler's bf16 or 8-bit KV cache then drops out of the
    # ratio). tis_cap > 0 (with 'learner'): truncated importance sampling against the sampler's
    # log-probs, each token's policy-gradient term times min(pi_old / pi_sampler, tis_cap).
    # ratio_mask c > 0 (with 'learner'): IcePop, no policy-gradient term for a token whose
    # pi_old / pi_sampler leaves [1/c, c] (before TIS when both are set).
    old_logprobs: str = "sampler"
    tis_cap: float = 0.0
    ratio_mask: float = 0.0
    # Padding the update does not compute: each minibatch's rows are sorted by length into its
    # micro-batches, and each micro-batch runs at the shortest of `width_steps` equal steps of the
    # batch width that holds its last real token. Rows are left-aligned and causal, so the cut
    # padding changes no real token's log-prob: the gradient is the same (dropout masks aside).
    # Each step is one more branch compiled into the update; 1 = every micro-batch at full width.
    # Off by default: the branches cost compile time (SmolLM2 at 8 steps: a first update of 40
    # s instead of 17), which a short run never earns back; at 8 x 8 rows of up to 168 tokens
    # of 256 an update took 1.67x less time (bench/bench_cut_padding.py), so long runs set it.
    width_steps: int = 1
    # Rows packed (rl/batch_layout.pack): each minibatch's rows moved, whole, one after another
    # into as few rows of the batch width as hold them, each attending only to itself; the
    # micro-batches left empty are not computed. The update then computes about the tokens the
    # rows hold instead of rows x the batch width. The same gradient (dropout masks aside);
    # the loss must weigh tokens, not rows: ratio 'token', aggregation not seq_mean_token_mean.
    pack_rows: bool = False
    # A mixture of experts: + coef * the Switch / Qwen3-MoE load-balancing loss of the routers
    # (models.moe.load_balancing_loss), each micro-batch's over its own tokens, averaged.
    router_aux_coef: float = 0.0
    # Micro-batches whose every loss token has advantage 0 (a group whose samples all scored the
    # same) are not computed: their policy-gradient term is exactly 0, so the gradient is the
    # same. Each minibatch's rows are sorted so that those rows share micro-batches. Only where
    # nothing else in the loss (KL, entropy bonus, router loss) gives such a row a gradient
    # (`skips_zero_advantage`); their tokens then leave the entropy and ratio diagnostics.
    skip_zero_advantage: bool = True

    @property
    def skips_zero_advantage(self) -> bool:
        return (self.skip_zero_advantage and self.kl_coef == 0 and self.entropy_coef == 0
                and self.router_aux_coef == 0)

    def __post_init__(self):
        def check(ok, field, expected):
            need(ok, f"TrainConfig.{field}", getattr(self, field), expected)
        check(self.learning_rate >= 0, "learning_rate", ">= 0")
        check(self.schedule in ("constant", "cosine"), "schedule", "'constant' or 'cosine'")
        check(self.warmup_steps >= 0, "warmup_steps", ">= 0")
        check(self.decay_steps > 0, "decay_steps", "> 0")
        check(0 <= self.min_lr_ratio <= 1, "min_lr_ratio", "in [0, 1]")
        check(self.max_grad_norm > 0, "max_grad_norm", "> 0")
        check(self.num_minibatches >= 1, "num_minibatches", ">= 1")
        check(self.num_epochs >= 1, "num_epochs", ">= 1")
        check(self.micro_batch_size >= 0, "micro_batch_size", ">= 0")
        check(self.eps_low >= 0, "eps_low", ">= 0")
        check(self.eps_high >= 0, "eps_high", ">= 0")
        check(self.ratio in objectives.RATIO_LEVELS, "ratio", f"one of {objectives.RATIO_LEVELS}")
        check(self.aggregation in objectives.AGGREGATIONS, "aggregation",
             f"one of {objectives.AGGREGATIONS}")
        check(self.kl_coef >= 0, "kl_coef", ">= 0")
        check(self.kl_kind in objectives.KL_KINDS, "kl_kind", f"one of {objectives.KL_KINDS}")
        check(self.logprob_chunk > 0, "logprob_chunk", "> 0")
        check(self.temperature > 0, "temperature", "> 0")
        check(self.entropy_coef >= 0, "entropy_coef", ">= 0")
        check(self.old_logprobs in objectives.OLD_LOGPROBS, "old_logprobs",
             f"one of {objectives.OLD_LOGPROBS}")
        check(self.tis_cap >= 0, "tis_cap", ">= 0 (0: off)")
        check(self.ratio_mask == 0 or self.ratio_mask > 1, "ratio_mask",
              "0 (off) or > 1 (the band [1/c, c])")
        check(self.width_steps >= 1, "width_steps", ">= 1 (1: no trimming)")
        check(not self.pack_rows or self.ratio == "token", "pack_rows",
              "False with ratio='sequence' (GSPO's ratio is a row's own mean)")
        check(not self.pack_rows or self.aggregation != "seq_mean_token_mean", "pack_rows",
              "False with aggregation='seq_mean_token_mean' (a mean over each row's tokens)")
        check(self.router_aux_coef >= 0, "router_aux_coef", ">= 0 (0: off)")
        check(self.tis_cap == 0 or self.old_logprobs == "learner", "tis_cap",
             "0 unless old_logprobs='learner' (against the sampler's own log-probs every weight "
             "is 1)")
        check(self.ratio_mask == 0 or self.old_logprobs == "learner", "ratio_mask",
             "0 unless old_logprobs='learner' (against the sampler's own log-probs every ratio "
             "is 1)")

    def check_batch(self, batch_size: int, batch_shards: int = 1):
        """Raises unless `batch_size` rows split into minibatches and sharded micro-batches."""
        if batch_size % self.num_minibatches:
            raise ValueError(f"batch of {batch_size} rows is not divisible by "
                             f"TrainConfig.num_minibatches={self.num_minibatches}")
        minibatch = batch_size // self.num_minibatches
        micro = self.micro_batch_size or minibatch
        if minibatch % micro:
            raise ValueError(f"minibatch of {minibatch} rows is not divisible by "
                             f"TrainConfig.micro_batch_size={micro}")
        if self.pack_rows and minibatch >= 1 << (31 - POSITION_BITS):
            raise ValueError(f"TrainConfig.pack_rows=True: a minibatch of {minibatch} rows; "
                             f"expected fewer than {1 << (31 - POSITION_BITS)} (a packed row "
                             "numbers its rows in the positions' high bits)")
        if micro % batch_shards:
            raise ValueError(f"micro-batch of {micro} rows is not divisible by the mesh's batch "
                             f"axes {BATCH_AXES} ({batch_shards} devices)")


def learning_rate_schedule(train: TrainConfig) -> optax.Schedule:
    """Linear warmup from 0, then constant or cosine decay to min_lr_ratio * lr."""
    lr = train.learning_rate
    if train.schedule == "cosine":
        after = optax.cosine_decay_schedule(lr, train.decay_steps, alpha=train.min_lr_ratio)
    else:
        after = optax.constant_schedule(lr)
    if not train.warmup_steps:
        return after
    warmup = optax.linear_schedule(0.0, lr, train.warmup_steps)
    return optax.join_schedules([warmup, after], [train.warmup_steps])


def make_optimizer(config: TrainConfig) -> optax.GradientTransformation:
    """Global-norm clipping, then AdamW on the schedule."""
    return optax.chain(
        optax.clip_by_global_norm(config.max_grad_norm),
        optax.adamw(learning_rate_schedule(config), b1=config.b1, b2=config.b2,
                    eps=config.adam_eps, weight_decay=config.weight_decay))
