"""A deterministic, per-host sharded, checkpointable iterator over problems.

Each epoch is one permutation of all problems drawn from (seed, epoch); every host draws the same
permutation and takes every `shard_count`-th problem from `shard_index`, so hosts see disjoint
problems and, since the permutation is truncated to a multiple of `shard_count`, equally many
(hosts stay in lockstep). Batches run on across epoch boundaries. The whole iterator state is two
integers, (epoch, position), saved with the checkpoint: a resumed run sees exactly the order it
would have seen. (grain offers the same; a problem list in memory needs no more than this.)
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jaxprefix.data.problem import Problem


class ProblemLoader:
    """Batches of `batch_size` problems for this host; `state()` / `restore()` for checkpoints."""

    def __init__(self, problems: Sequence[Problem], batch_size: int, seed: int = 0,
                 shard_index: int = 0, shard_count: int = 1, shuffle: bool = True):
        if batch_size < 1:
            raise ValueError(f"ProblemLoader: batch_size must be >= 1, got {batch_size}")
        if not 0 <= shard_index < shard_count:
            raise ValueError(f"ProblemLoader: expected 0 <= shard_index < shard_count, "
                             f"got {shard_index} of {shard_count}")
        if len(problems) < shard_count:
            raise ValueError(f"ProblemLoader: {len(problems)} problems cannot fill {shard_count} "
                             "host shards; expected at least one problem per host")
        self.problems = list(problems)
        self.batch_size = batch_size
        self.seed = seed
        self.shard_index = shard_index
        self.shard_count = shard_count
        self.shuffle = shuffle
        self.per_shard = len(self.problems) // shard_count
        self.epoch = 0
        self.position = 0  # index into this host's share of the current epoch
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch: int) -> np.ndarray:
        count = len(self.problems)
        if self.shuffle:
            order = np.random.default_rng([self.seed, epoch]).permutation(count)
        else:
            order = np.arange(count)
        order = order[: self.per_shard * self.shard_count]
        return order[self.shard_index::self.shard_count]

    def next_batch(self) -> list[Problem]:
        batch = []
        while len(batch) < self.batch_size:
            if self.position == self.per_shard:
                self.epoch += 1
                self.position = 0
                self._order = self._epoch_order(self.epoch)
            take = min(self.batch_size - len(batch), self.per_shard - self.position)
            indices = self._order[self.position:self.position + take]
            batch.extend(self.problems[i] for i in indices)
            self.position += take
        return batch

    def __iter__(self):
        return self

    def __next__(self) -> list[Problem]:
        return self.next_batch()

    def state(self) -> dict[str, int]:
        """JSON- and orbax-friendly state; the problem count and seed guard against a wrong restore."""
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed,
                "num_problems": len(self.problems), "shard_index": self.shard_index,
                "shard_count": self.shard_count}

    def restore(self, state: dict) -> None:
        for key in ("seed", "num_problems", "shard_count"):
            mine = self.state()[key]
            if int(state[key]) != mine:
                raise ValueError(f"ProblemLoader.restore: checkpoint has {key}={int(state[key])}, "
                                 f"this loader {mine}; the data or its sharding changed")
        epoch, position = int(state["epoch"]), int(state["position"])
        if not 0 <= position <= self.per_shard:
            raise ValueError(f"ProblemLoader.restore: position {position} outside 0..{self.per_shard}")
        self.epoch, self.position = epoch, position
        self._order = self._epoch_order(epoch)
