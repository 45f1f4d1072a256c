"""How many rows and contexts the sampler keeps in flight: from a row cap or a KV memory budget.

The static decode holds every context's KV and a cache of the full new-token bucket T for every
row: C x Sc + C x n x T tokens of KV (Sc the context length bucket). The continuous decode
(continuous.py) holds, on each of D row devices, s row slots of T tokens and K context slots of
Sc tokens: D x (s x T + K x Sc). K is twice the contexts that s rows need at once (ceil(s / n)),
so contexts whose last samples run long do not starve the queue; F = ceil(s / n) contexts are
prefilled per admission, so one admission feeds the rows that free up over about one row's life.
"""
from __future__ import annotations

import dataclasses

import jax
import numpy as np

# Of the memory the accelerators report free, the share the KV cache may take by default: the
# rest is for the sampler's activations, logits and XLA's temporaries.
DEFAULT_FREE_MEMORY_SHARE = 0.5


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Continuous decode sizes, per block of rows (one block per row device)."""
    shards: int         # D: row devices, one scheduling block each
    row_slots: int      # s: rows in flight per block
    context_slots: int  # K: contexts resident per block
    admit: int          # F: contexts prefilled together per block

    @property
    def rows_in_flight(self) -> int:
        return self.shards * self.row_slots

    def kv_tokens(self, context_length: int, new_bucket: int) -> int:
        return self.shards * (self.row_slots * new_bucket + self.context_slots * context_length)


def kv_bytes_per_token(config, dtype=None) -> int:
    """Bytes of one token's K and V over all layers, plus its int32 position."""
    itemsize = np.dtype(dtype or config.dtype).itemsize
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * itemsize + 4


def static_kv_tokens(num_contexts: int, n: int, context_length: int, new_bucket: int) -> int:
    return num_contexts * context_length + num_contexts * n * new_bucket


def _schedule(shards: int, row_slots: int, contexts_per_block: int, n: int) -> Schedule:
    feed = -(-row_slots // n)  # contexts whose samples fill the row slots
    context_slots = max(1, min(contexts_per_block, 2 * feed))
    return Schedule(shards, row_slots, context_slots, admit=min(context_slots, feed))


def plan(*, num_contexts: int, n: int, context_length: int, new_bucket: int, shards: int,
         bytes_per_token: int, max_rows_in_flight: int | None = None,
         kv_budget_bytes: int | None = None) -> Schedule | None:
    """The continuous schedule for a request, or None when every row can be in flight at once
    (the static decode: no cap given, or a cap and budget that hold all rows and contexts).

    num_contexts is the padded count (a multiple of `shards`). A cap below the row devices' count
    still keeps one row per device. Raises ValueError when the budget holds no row at all.
    """
    rows = num_contexts * n
    static_bytes = static_kv_tokens(num_contexts, n, context_length, new_bucket) * bytes_per_token
    fits = kv_budget_bytes is None or static_bytes <= kv_budget_bytes
    if fits and (max_rows_in_flight is None or max_rows_in_flight >= rows):
        return None
    if max_rows_in_flight is not None and max_rows_in_flight < 1:
        raise ValueError(f'max_rows_in_flight must be >= 1 (None: every row), got '
                         f'{max_rows_in_flight!r}')
    per_block = num_contexts // shards
    row_slots = per_block * n
    if max_rows_in_flight is not None:
        row_slots = min(row_slots, max(1, max_rows_in_flight // shards))
    if kv_budget_bytes is not None:
        def fits_budget(s):
            tokens = _schedule(shards, s, per_block, n).kv_tokens(context_length, new_bucket)
            return tokens * bytes_per_token <= kv_budget_bytes
        if not fits_budget(1):
            least = _schedule(shards, 1, per_block, n)
            need = least.kv_tokens(context_length, new_bucket) * bytes_per_token
            raise ValueError(
                f'kv_budget_bytes={kv_budget_bytes} holds no row: {shards} row device(s) x (one '
                f'row of {new_bucket} new tokens + {least.context_slots} context(s) of '
                f'{context_length} tokens) need {need} bytes')
        low, high = 1, row_slots  # the most rows that fit: bisection (fits_budget is monotone)
        while low < high:
            mid = (low + high + 1) // 2
            low, high = (mid, high) if fits_budget(mid) else (low, mid - 1)
        row_slots = low
    return _schedule(shards, row_slots, per_block, n)


def free_device_memory(devices=None) -> int | None:
    """Bytes free (limit - in use) over all the devices of a run, or None where a device reports
    nothing (CPU).

    Only this process's devices can be asked (other hosts' raise), so each process takes the
    least free memory of its own devices and, on several hosts, the least over all processes
    (one small collective): every process then plans the same schedule. The answer is that
    least share times the number of devices, the memory an evenly sharded KV cache may use.
    """
    devices = list(devices if devices is not None else jax.devices())
    local = [d for d in devices if d.process_index == jax.process_index()]
    least = _least_free(local)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        shares = multihost_utils.process_allgather(np.int64(-1 if least is None else least))
        least = None if (np.asarray(shares) < 0).any() else int(np.min(shares))
    return None if least is None else least * len(devices)


def _least_free(devices) -> int | None:
    least = None
    for device in devices:
        stats = device.memory_stats() if hasattr(device, 'memory_stats') else None
        if not stats or 'bytes_limit' not in stats:
            return None
        free = stats['bytes_limit'] - stats.get('bytes_in_use', 0)
        least = free if least is None else min(least, free)
    return least


def memory_settings(rollout, devices=None) -> dict:
    """generate()'s max_rows_in_flight and kv_budget_bytes from a config's `rollout` block:
    max_rows_in_flight 0 means no cap; kv_budget_gib 0 means DEFAULT_FREE_MEMORY_SHARE of the
    devices' free memory, or no bound where the devices report none (CPU)."""
    budget_gib = float(rollout.kv_budget_gib)
    if budget_gib:
        budget = int(budget_gib * 2**30)
    else:
        free = free_device_memory(devices)
        budget = None if free is None else int(free * DEFAULT_FREE_MEMORY_SHARE)
    return dict(max_rows_in_flight=int(rollout.max_rows_in_flight) or None,
                kv_budget_bytes=budget)
