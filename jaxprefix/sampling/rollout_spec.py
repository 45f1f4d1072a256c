"""How a run samples its policy: the config's `rollout` block, parsed and checked once.

Every part that samples takes a RolloutSpec rather than reading the config: the RL loop
(`rl.scoring.sample_and_score`), mining and probing (`methods.probing.Prober`), and the compile
job's step shape (`tpu.programs.StepShape`). A new rollout knob is a field here and a keyword
where it acts. The sample count n is not in it: it is the request's (rollout.n in RL, mining.k
in mining).

Two kinds of field: those that change what is sampled (max_new_tokens, temperature, top_p,
top_k) and the memory ones, which change only how (rows in flight, the KV budget, pages, the KV
dtype, the decode's tensor-parallel width): the same seed gives the same rollouts whatever they
are. The KV budget rule is `kv_budget_bytes`, the one place it is written.
"""
from __future__ import annotations

import dataclasses

from jaxprefix.errors import need
from jaxprefix.sampling.sampler import KV_DTYPES
from jaxprefix.sampling.turns import KV_AT_SWAP

GiB = 2**30
# What a running decode does with new weights: '' never takes them (a decode, one version);
# 'keep' takes them between chunks and keeps the KV the older ones wrote (PipelineRL, prime-rl);
# 'recompute' takes them and has them compute that KV again first.
INFLIGHT_KV = ('', *KV_AT_SWAP)
# Read by a training run's loop alone (the sampler's own devices, weights into a running
# decode, partial rollouts): a job that runs no RL step leaves them unread, so preflight
# refuses them there.
LOOP_FIELDS = ('devices', 'inflight_kv', 'partial_tokens')


@dataclasses.dataclass(frozen=True)
class RolloutSpec:
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_rows_in_flight: int = 0    # 0: no cap (the KV budget decides)
    kv_budget_gib: float = 0.0     # 0: the accelerators' memory beyond memory_headroom
    memory_headroom: float = 0.16  # share of each accelerator's memory kept free
    page_size: int = 128           # tokens per KV page
    kv_reserve: float = 1.0        # share of a whole row's pages promised to each started row
    kv_dtype: str = ''             # '': the compute dtype
    tensor_parallel: int = 0       # 0: the widest that divides the heads, on TPU
    max_turns: int = 1             # assistant turns of an episode with tools (docs/TOOLS.md)
    devices: int = 0               # the sampler's own devices (0: it shares the learner's)
    inflight_kv: str = ''          # newer weights between a decode's chunks: 'keep' | 'recompute'
    partial_tokens: int = 0        # > 0: tokens a row samples a round, the rest carried (rl/partial)

    def __post_init__(self):
        def check(ok, field, expected):
            need(ok, f"config.rollout.{field}", getattr(self, field), expected)
        check(self.max_new_tokens >= 1, "max_new_tokens", ">= 1")
        check(self.temperature >= 0, "temperature", ">= 0")
        check(self.max_rows_in_flight >= 0, "max_rows_in_flight",
             ">= 0 (0: set by rollout.kv_budget_gib)")
        check(self.kv_budget_gib >= 0, "kv_budget_gib",
             ">= 0 (0: the accelerators' memory beyond rollout.memory_headroom)")
        check(0 <= self.memory_headroom < 1, "memory_headroom", "a fraction in [0, 1)")
        check(self.page_size >= 1 and self.page_size & (self.page_size - 1) == 0, "page_size",
             "a power of two (tokens per KV page)")
        check(0 < self.kv_reserve <= 1, "kv_reserve", "a fraction in (0, 1]")
        check(self.tensor_parallel >= 0, "tensor_parallel", ">= 0 (0: automatic)")
        check(self.devices >= 0, "devices", ">= 0 (0: the learner's, shared)")
        check(self.max_turns >= 1, "max_turns", ">= 1 (more than 1: episodes with the tools of "
              "config.tools, docs/TOOLS.md)")
        check(self.inflight_kv in INFLIGHT_KV, "inflight_kv",
              f"one of {INFLIGHT_KV} ('': one version a decode; 'keep' / 'recompute': newer "
              f"weights take over between chunks, the KV written so far kept / computed again)")
        check(0 <= self.partial_tokens < self.max_new_tokens, "partial_tokens",
              f"0 (off) or fewer than rollout.max_new_tokens={self.max_new_tokens} (tokens a "
              f"row samples a round; the rest of a rollout is carried)")
        check(self.kv_dtype in ("", *KV_DTYPES), "kv_dtype",
             f"'' (the compute dtype) or one of {KV_DTYPES}")

    @classmethod
    def from_config(cls, rollout, *, training: bool = False, **overrides) -> RolloutSpec:
        """The spec of a config's `rollout` block (its sample count n aside; LOOP_FIELDS only
        for a `training` run's loop)."""
        values = {f.name: rollout[f.name] for f in dataclasses.fields(cls)
                  if f.name in rollout and (training or f.name not in LOOP_FIELDS)}
        return cls(**{**values, **overrides})

    def sampler_keywords(self) -> dict:
        """sampling.generate()'s keywords, the sample count, seed and stop ids aside."""
        budget = self.kv_budget_gib
        return dict(max_new_tokens=self.max_new_tokens, temperature=self.temperature,
                    top_p=self.top_p, top_k=self.top_k,
                    max_rows_in_flight=self.max_rows_in_flight or None,
                    kv_budget_bytes=int(budget * GiB) if budget else None,
                    memory_headroom=None if budget else self.memory_headroom,
                    page_size=self.page_size, kv_dtype=self.kv_dtype or None,
                    reserve_fraction=self.kv_reserve, tensor_parallel=self.tensor_parallel)

    def kv_budget_bytes(self, hbm_bytes_per_chip: float, chips: int,
                        in_use_per_chip: float) -> int:
        """The sampler's KV budget on `chips` accelerators of that memory: kv_budget_gib, or what
        they hold beyond memory_headroom of it once `in_use_per_chip` bytes (the training state,
        the sampler's weights) are placed. generate() applies the same rule to the memory the
        devices report; the compile job applies it to a slice's chips."""
        if self.kv_budget_gib:
            return int(self.kv_budget_gib * GiB)
        free = hbm_bytes_per_chip * (1 - self.memory_headroom) - in_use_per_chip
        return int(chips * max(0.0, free))
