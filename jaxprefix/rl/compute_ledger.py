"""What a run spends, in FLOPs: 2 N D to sample or score D tokens, 6 N D to train on them, and
the ledger that sums them over a run (checkpointed with it).

Every sampled and trained token of a run is booked here: the RL loop's rollouts and updates,
and everything sampled outside them (hard-set mining, prefix searches, trace pools, evaluation)
as `extra`, so a compute-matched comparison pays for PrefixRL's rejection sampling and POPE's
mining. IsoCompute's allocation and frontier fit (methods/isocompute.py) read these totals.
"""
from __future__ import annotations

import dataclasses
from typing import Mapping


def sampling_flops(num_params: int, tokens: int) -> float:
    """Forward FLOPs of producing or scoring `tokens` tokens: 2 N D."""
    return 2.0 * num_params * tokens


def update_flops(num_params: int, tokens: int) -> float:
    """Forward + backward FLOPs of training on `tokens` tokens: 6 N D."""
    return 6.0 * num_params * tokens



@dataclasses.dataclass
class ComputeLedger:
    """Running totals of what a run spent; saved in checkpoints via to_dict/from_dict.

    `sampled_tokens` counts every token the sampler processed (prefilled context + generated), so
    a shared prompt prefilled once counts once. `extra_*` is compute spent outside the RL loop
    that a compute-matched comparison must still pay for, e.g. PrefixRL's rejection sampling.
    """

    n_params: int
    rollouts: int = 0
    sampled_tokens: int = 0
    trained_tokens: int = 0
    sampling_flops: float = 0.0
    update_flops: float = 0.0
    extra_rollouts: int = 0
    extra_flops: float = 0.0

    def __post_init__(self):
        if int(self.n_params) <= 0:
            raise ValueError(f'ComputeLedger.n_params must be a positive parameter count, '
                             f'got {self.n_params!r}')

    def record_sampling(self, *, rollouts: int, prefill_tokens: int, generated_tokens: int):
        tokens = int(prefill_tokens) + int(generated_tokens)
        self.rollouts += int(rollouts)
        self.sampled_tokens += tokens
        self.sampling_flops += sampling_flops(self.n_params, tokens)

    def record_update(self, *, tokens: int):
        """`tokens`: every token the update forwards (context + completion), masked or not."""
        self.trained_tokens += int(tokens)
        self.update_flops += update_flops(self.n_params, tokens)

    def record_extra_sampling(self, *, rollouts: int, tokens: int):
        self.extra_rollouts += int(rollouts)
        self.extra_flops += sampling_flops(self.n_params, tokens)

    @property
    def total_flops(self) -> float:
        return self.sampling_flops + self.update_flops + self.extra_flops

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping) -> 'ComputeLedger':
        names = {f.name for f in dataclasses.fields(cls)}
        if set(d) - names or 'n_params' not in d:
            raise ValueError(f'ComputeLedger.from_dict: expected n_params and fields among '
                             f'{sorted(names)}, got {sorted(d)}')
        cast = {f.name: float if f.type == 'float' else int for f in dataclasses.fields(cls)}
        return cls(**{k: cast[k](v) for k, v in d.items()})
