"""How many rows and contexts the sampler keeps in flight: from a row cap or a KV memory budget.

The static decode holds every context's KV and a cache of the full new-token bucket T for every
row: C x Sc + C x n x T tokens of KV (Sc the context length bucket). The continuous decode
(continuous.py) holds, on each of D row devices, K group slots of Sc context tokens in pages and
a pool of pages for the rows' own tokens; at most s rows are active there, each promised
`reserve` pages (a whole row's T / page_size by default: no row is ever preempted). K is the
groups that s rows need at once and a quarter more (_groups), so groups whose last samples run
long do not starve the queue; F = ceil(s / n) contexts (at most MAX_ADMIT) are prefilled per
admission, so one admission feeds the rows that free up over about one row's life.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np

from jaxprefix.models.paged_attention import pool_bytes_per_token

DEFAULT_PAGE_SIZE = 128
# Contexts prefilled together at most: their KV sits in temporaries until written into pages
# (8 x 2k tokens of Qwen3-4B: 0.3 GB a chip), so admitting more at once buys little and costs HBM.
MAX_ADMIT = 8


@dataclasses.dataclass(frozen=True)
class ContinuousPlan:
    """Continuous decode sizes, per block of rows (one block per row device)."""
    shards: int         # D: row devices, one scheduling block each
    row_slots: int      # s: active rows per block at most
    context_slots: int  # K: group slots per block (one context and its n rows each)
    admit: int          # F: contexts prefilled together per block
    page_size: int      # tokens per KV page
    pages: int          # KV pages per block (in every layer)
    reserve: int        # pages promised to each active row

    @property
    def rows_in_flight(self) -> int:
        return self.shards * self.row_slots

    def kv_bytes(self, context_length: int, context_bytes_per_token: int,
                 page_bytes_per_token: int) -> int:
        return self.shards * (self.context_slots * context_length * context_bytes_per_token +
                              self.pages * self.page_size * page_bytes_per_token)


def kv_bytes_per_token(config, dtype=None) -> int:
    """Bytes of one token's K and V over all layers, plus its int32 position."""
    itemsize = np.dtype(dtype or config.dtype).itemsize
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * itemsize + 4


def page_bytes_per_token(config, kv_dtype) -> int:
    """Bytes of one token's K and V over all layers in the page pool (int8: with scales)."""
    return config.num_layers * pool_bytes_per_token(config.num_kv_heads, config.head_dim,
                                                    kv_dtype)


def static_kv_tokens(num_contexts: int, n: int, context_length: int, new_bucket: int) -> int:
    return num_contexts * context_length + num_contexts * n * new_bucket


def plan(*, num_contexts: int, n: int, context_length: int, new_bucket: int, shards: int,
         bytes_per_token: int, page_bytes: int | None = None,
         page_size: int = DEFAULT_PAGE_SIZE, reserve_fraction: float = 1.0,
         max_rows_in_flight: int | None = None, kv_budget_bytes: int | None = None,
         paged: bool = False) -> ContinuousPlan | None:
    """The continuous decode's plan for a request, or None when every row can be in flight at once
    (the static decode: no cap given, or a cap and budget that hold all rows and contexts).

    num_contexts is the padded count (a multiple of `shards`); bytes_per_token is a static
    decode token's KV (compute dtype), page_bytes a page token's, contexts' and rows' alike
    (default the same). A cap below the row
    devices' count still keeps one row per device. reserve_fraction: the share of a whole row's
    pages promised to each active row (below 1 more rows start, and the youngest are preempted
    when pages run out). paged: the continuous decode even when every row fits (the rows of
    multi-turn episodes leave the loop and come back: sampling/turns.py). Raises ValueError
    when the budget holds no row at all.
    """
    rows = num_contexts * n
    static_bytes = static_kv_tokens(num_contexts, n, context_length, new_bucket) * bytes_per_token
    fits = kv_budget_bytes is None or static_bytes <= kv_budget_bytes
    if fits and (max_rows_in_flight is None or max_rows_in_flight >= rows) and not paged:
        return None
    if max_rows_in_flight is not None and max_rows_in_flight < 1:
        raise ValueError(f'max_rows_in_flight must be >= 1 (None: every row), got '
                         f'{max_rows_in_flight!r}')
    if not 0 < reserve_fraction <= 1:
        raise ValueError(f'reserve_fraction must be in (0, 1], got {reserve_fraction!r}')
    page_bytes = bytes_per_token if page_bytes is None else page_bytes
    page_size = min(page_size, new_bucket)
    row_pages = new_bucket // page_size
    reserve = max(1, math.ceil(reserve_fraction * row_pages))
    per_block = num_contexts // shards
    row_slots = per_block * n
    if max_rows_in_flight is not None:
        row_slots = min(row_slots, max(1, max_rows_in_flight // shards))

    def context_bytes(s):  # group slots' context pages, in the pages' dtype
        return _groups(s, per_block, n) * context_length * page_bytes

    page_token_bytes = page_size * page_bytes
    if kv_budget_bytes is None:
        return _continuous_plan(shards, row_slots, per_block, n, page_size,
                         max(row_slots * reserve, row_pages), reserve)
    block_budget = kv_budget_bytes // shards

    def fits_budget(s):
        return context_bytes(s) + max(s * reserve, row_pages) * page_token_bytes <= block_budget
    if not fits_budget(1):
        need = shards * (context_bytes(1) + row_pages * page_token_bytes)
        raise ValueError(
            f'kv_budget_bytes={kv_budget_bytes} holds no row: {shards} row device(s) x (one '
            f'row of {new_bucket} new tokens + {_groups(1, per_block, n)} context(s) of '
            f'{context_length} tokens) need {need} bytes')
    low, high = 1, row_slots  # the most rows that fit: bisection (fits_budget is monotone)
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits_budget(mid) else (low, mid - 1)
    # Every byte the contexts leave goes to pages (rows that outgrow their reserve use them),
    # up to what every row of the block at full length would take.
    pages = min((block_budget - context_bytes(low)) // page_token_bytes, per_block * n * row_pages)
    return _continuous_plan(shards, low, per_block, n, page_size, pages, reserve)


def _groups(row_slots: int, contexts_per_block: int, n: int) -> int:
    """Group slots: those s rows need, and a quarter more (at least one) so that a group whose
    last rows run long does not hold the rest back. Each is n batch rows a decode step computes,
    active or not: more spare groups cost every step (on CPU the long-tail benchmark ran 2x
    slower with twice the groups), fewer stall the queue."""
    need = -(-row_slots // n)
    return max(1, min(contexts_per_block, need + max(1, need // 4)))


def _continuous_plan(shards, row_slots, contexts_per_block, n, page_size, pages, reserve) -> ContinuousPlan:
    context_slots = _groups(row_slots, contexts_per_block, n)
    admit = min(context_slots, -(-row_slots // n), MAX_ADMIT)
    return ContinuousPlan(shards, row_slots, context_slots, admit=admit, page_size=page_size,
                    pages=pages, reserve=reserve)


def free_device_memory(devices=None, headroom: float = 0.0) -> int | None:
    """Bytes free over all the devices of a run, keeping `headroom` of each device's memory
    limit free, or None where a device reports nothing (CPU).

    Only this process's devices can be asked (other hosts' raise), so each process takes the
    least free memory of its own devices and, on several hosts, the least over all processes
    (one small collective): every process then makes the same plan. The answer is that
    least share times the number of devices, the memory an evenly sharded KV cache may use.
    """
    devices = list(devices if devices is not None else jax.devices())
    local = [d for d in devices if d.process_index == jax.process_index()]
    least = _least_free(local, headroom)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        shares = multihost_utils.process_allgather(np.int64(-1 if least is None else least))
        least = None if (np.asarray(shares) < 0).any() else int(np.min(shares))
    return None if least is None else least * len(devices)


def _least_free(devices, headroom: float) -> int | None:
    least = None
    for device in devices:
        stats = device.memory_stats() if hasattr(device, 'memory_stats') else None
        if not stats or 'bytes_limit' not in stats:
            return None
        limit = stats['bytes_limit']
        free = max(0, int(limit * (1 - headroom)) - stats.get('bytes_in_use', 0))
        least = free if least is None else min(least, free)
    return least
