"""This machine's limits, measured in the run that uses them, and the floors they set (issue 68).

- `read_bandwidth`: bytes a second that a sum over a large f32 array reads, on one thread and on
  every core (numpy's reduction on slices, one thread each): what streaming weights and KV costs.
- `matmul_rate`: FLOP/s of a jitted x [rows, d] times every layer's [d, f] weights (one einsum
  over the stack, each weight read once), in f32 and in bf16 x bf16 -> f32: the model's shapes.
- `sampler_floor_s`: per decode step the larger of its bytes at the bandwidth (the weights once
  for all rows, and each row's KV) and its FLOPs at the matmul rate (2 N a row, plus attention),
  summed over the steps the longest row takes, plus the prefill's 2 N per context token.
- `update_floor_s`: the update's 6 N D at the matmul rate.

    python bench/limits.py          # prints the limits and SmolLM2's floors at the GRPO bench's shape
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import statistics
import time

import numpy as np

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Limits:
    read_gbs_one: float      # GB/s a sum reads on one thread
    read_gbs_all: float      # ... on every core
    matmul_f32: float        # FLOP/s, decode shape (rows x d x f per layer)
    matmul_bf16: float
    matmul_f32_wide: float   # FLOP/s at the update's shape (many rows)
    matmul_bf16_wide: float

    def describe(self) -> str:
        return (f"read bandwidth {self.read_gbs_one:.1f} GB/s one thread, {self.read_gbs_all:.1f} "
                f"GB/s all {os.cpu_count()} cores; matmul (decode rows) f32 "
                f"{self.matmul_f32 / 1e9:.0f} GFLOP/s, bf16 {self.matmul_bf16 / 1e9:.0f}; "
                f"(update rows) f32 {self.matmul_f32_wide / 1e9:.0f}, bf16 "
                f"{self.matmul_bf16_wide / 1e9:.0f}")


def _median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up (compiles, pages in)
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def read_bandwidth(mib: int = 512, threads: int = 1, repeats: int = 5) -> float:
    """GB/s read by `threads` numpy sums over slices of one f32 array of `mib` MiB."""
    data = np.ones(mib * 2 ** 20 // 4, np.float32)
    slices = np.array_split(data, threads)
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        def run():
            return sum(pool.map(np.sum, slices))
        return data.nbytes / _median_seconds(run, repeats) / 1e9


def matmul_rate(rows: int, d: int, f: int, layers: int, dtype, repeats: int = 5) -> float:
    """FLOP/s of x [rows, d] times each of `layers` weights [d, f] in `dtype` (f32 accumulation)."""
    keys = jax.random.split(jax.random.key(0))
    x = jax.random.normal(keys[0], (rows, d), jnp.float32).astype(dtype)
    w = jax.random.normal(keys[1], (layers, d, f), jnp.float32).astype(dtype)
    dot = jax.jit(lambda x, w: jnp.einsum("rd,ldf->lrf", x, w,
                                          preferred_element_type=jnp.float32))
    seconds = _median_seconds(lambda: dot(x, w).block_until_ready(), repeats)
    return 2 * rows * d * f * layers / seconds


def measure(d: int = 576, f: int = 1536, layers: int = 30, decode_rows: int = 64,
            update_rows: int = 1024) -> Limits:
    """The limits at a model's shapes (SmolLM2-135M's by default)."""
    return Limits(
        read_bandwidth(threads=1), read_bandwidth(threads=os.cpu_count() or 1),
        matmul_rate(decode_rows, d, f, layers, jnp.float32),
        matmul_rate(decode_rows, d, f, layers, jnp.bfloat16),
        matmul_rate(update_rows, d, f, layers, jnp.float32),
        matmul_rate(update_rows, d, f, layers, jnp.bfloat16))


def sampler_floor_s(limits: Limits, *, n_params: int, weight_bytes: int, rows: int,
                    decode_steps: int, prefill_tokens: int, context: float,
                    kv_bytes_per_token: int, attention_flops_per_token_pair: int,
                    bf16: bool = False) -> float:
    """Seconds the sampler cannot go under: prefill (2 N a prefilled token at the matmul rate),
    then per decode step max(weights + the rows' KV at the all-core bandwidth, 2 N a row +
    attention at the matmul rate); a row's KV grows from its `context` (mean tokens) by one a
    step."""
    rate = limits.matmul_bf16 if bf16 else limits.matmul_f32
    wide = limits.matmul_bf16_wide if bf16 else limits.matmul_f32_wide
    bandwidth = limits.read_gbs_all * 1e9
    seconds = 2 * n_params * prefill_tokens / wide
    for step in range(decode_steps):
        kv_tokens = rows * (context + step)
        read = weight_bytes + kv_tokens * kv_bytes_per_token
        flops = 2 * n_params * rows + attention_flops_per_token_pair * kv_tokens
        seconds += max(read / bandwidth, flops / rate)
    return seconds


def update_floor_s(limits: Limits, *, n_params: int, tokens: int, bf16: bool = False) -> float:
    """6 N D at the update shape's matmul rate."""
    return 6 * n_params * tokens / (limits.matmul_bf16_wide if bf16 else limits.matmul_f32_wide)


def smollm2_shape() -> dict:
    """SmolLM2-135M's figures the floors take (f32 weights and KV)."""
    n, layers, kv_heads, head_dim, heads = 134_515_008, 30, 3, 64, 9
    return dict(n_params=n, weight_bytes=4 * n, kv_bytes_per_token=2 * layers * kv_heads * head_dim * 4,
                attention_flops_per_token_pair=4 * layers * heads * head_dim)


if __name__ == "__main__":
    limits = measure()
    print(limits.describe())
    shape = smollm2_shape()
    for bf16 in (False, True):
        if bf16:
            shape = shape | dict(weight_bytes=shape["weight_bytes"] // 2,
                                 kv_bytes_per_token=shape["kv_bytes_per_token"] // 2)
        floor = sampler_floor_s(limits, rows=64, decode_steps=128, prefill_tokens=8 * 60,
                                context=60, bf16=bf16, **shape)
        update = update_floor_s(limits, n_params=shape["n_params"], tokens=64 * 120, bf16=bf16)
        print(f"{'bf16' if bf16 else 'f32'}: sampling 8 contexts of 60 tokens x 8 rows x 128 new "
              f">= {floor:.1f} s; an update of 64 x 120 tokens >= {update:.1f} s (6 N D)")
