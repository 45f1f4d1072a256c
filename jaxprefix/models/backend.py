"""Every choice that depends on the backend (TPU, CPU, GPU), in this one module:
  - self-attention without a cache (training, prefill; `attention_for`): tiles, the splash
    kernel (Pallas) on TPU and blockwise online softmax (blockwise_attention.py) elsewhere, as
    no [T, T] scores fit at 16k tokens; with a cache or pages (one new token per row) plain
    attention (attention.attend);
  - the sampler's decode over KV pages (`attend_pages`): the Pallas paged kernel
    (paged_kernel.py) on TPU, the jnp reference of the same layout (paged_attention.py) elsewhere;
  - the decode's layers on CPU (`unrolls_layers`): one by one on per-layer weights laid out
    output-major (Decoder.layer_weights), each layer a page pool of its own and, in the static
    decode, its KV head-major (KVSegment.head_major), where TPU scans stacked weights over one
    pool;
  - the experts' grouped matmul of a MoE layer (`grouped_matmul`): Megablox's grouped matmul
    (Pallas, jax.experimental.pallas.ops.tpu.megablox) on TPU, jax.lax.ragged_dot elsewhere.

The kernels write their costs into the name stack (SPLASH_SCOPE, PAGED_SCOPE, GMM_SCOPE), which
tpu/costing.py reads back from a compiled program for the compile job.

Splash attention (jax.experimental.pallas.ops.tpu.splash_attention) masks by index, not by
position: a causal (or causal + local) mask over the row's slots, and segment ids. Our masks are
by position (attention._visible). The two agree when the real tokens of a row sit in consecutive
slots with consecutive positions, padding (position -1) before or after them: the learner's
right-padded rows (positions 0..len-1), its packed rows (each sequence one segment id) and the
sampler's prompts. Then "causal by index, within
one segment id (1 = real token, 0 = padding)" sees exactly the keys "causal by position among
real tokens" sees, and the sliding window's position distance is the index distance. tests/
test_long_attention.py checks it with the kernel in interpret mode on CPU. Queries that also
read context segments (a suffix prefilled over a shared prompt) take the blockwise path.

The choice is lax.platform_dependent: the program lowered for TPU contains the kernel, the one
lowered for CPU or GPU the blockwise loops, whatever machine traces it (the compile job lowers
for TPU on a CPU host).
"""
from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.tpu import megablox
from jax.experimental.pallas.ops.tpu import splash_attention as splash
from jax.sharding import PartitionSpec as P

from jaxprefix.models import attention, blockwise_attention, paged_attention, paged_kernel
from jaxprefix.models.sharding import logical_spec

# MaxText's default splash tiles; a row length must be a multiple of the tile (lanes: 128).
_TILE = 512
_MIN_TILE = 128
# The forward's FLOPs ride in the name stack, so the compiled HLO's op_name of every splash
# kernel (forward and backward) tells the compile job what XLA's cost analysis cannot see.
SPLASH_SCOPE = 'splash_fwd_flops_{}'
# What a paged kernel's pages hold and the bytes per token it reads, likewise.
PAGED_SCOPE = 'paged_{}_token_bytes_{}'


def platform_of(params) -> str:
    """The platform the parameters live on (abstract ones: that of their sharding's devices)."""
    for leaf in jax.tree.leaves(params):
        sharding = getattr(leaf, 'sharding', None)
        if sharding is not None:
            return next(iter(sharding.device_set)).platform
    return jax.default_backend()


def unrolls_layers(platform: str) -> bool:
    """Whether the decode runs its layers one by one on per-layer weights
    (Decoder.extend(layer_weights=)), each layer with a page pool of its own
    (PageLayout.per_layer): on CPU, whose XLA copies a stacked weight's layer slice, and a
    layer's part of a shared pool, out before each matmul (it doubled a SmolLM2 n=1 decode
    step). The per-layer weights are laid out output-major, so each matmul takes the weight as
    its left operand: XLA's CPU dot (YNNPACK) runs a step of 8 rows 1.6x faster so, 1 row as
    fast. The static decode's KV is held likewise, per layer and head-major
    (KVSegment.head_major), as the attention dots read it. TPU fuses the slice: its decode scans
    the stacked weights over one pool."""
    return platform == 'cpu'


def tensor_parallel_by_default(platform: str) -> bool:
    """Whether rollout.tensor_parallel=0 decodes tensor-parallel (sampling/decode_mesh.py: the
    heads split over the chips, each reading 1 / t of the weights a step, as TPU's
    bandwidth-bound decode wants) rather than in the learner's own layout (CPU, GPU)."""
    return platform == 'tpu'


def attention_for(*, cached: bool, sliding_window: int | None):
    """The attention of a layer's new tokens over its segments. With a cache or KV pages (a
    decode step's token a row, or a row's few appended ones) plain attention
    (attention.attend). Without, the new tokens attend to each other: T x T scores, too large to materialise at 16k tokens, so tiles (`attend`:
    the splash kernel on TPU, blockwise elsewhere)."""
    if cached:
        return attention.attend
    return functools.partial(attend, sliding_window=sliding_window)


def attend(q: jax.Array, q_pos: jax.Array, segments: Sequence[attention.Segment], *, scale: float,
           window=None, logit_cap: float | None = None,
           sliding_window: int | None = None) -> jax.Array:
    """Attention of new tokens over `segments`, whose last is the new tokens' own (k, v, q_pos).

    The contract of attention.attend; `sliding_window` is the model's window size (static), for
    the kernel's mask, on models whose traced `window` may enable it layer by layer.
    """
    blockwise = functools.partial(blockwise_attention.attend, scale=scale, logit_cap=logit_cap)
    if len(segments) > 1 or not splash_fits(q.shape):
        return blockwise(q, q_pos, segments, window=window)
    k, v, _ = segments[0]

    def on_tpu(q, k, v, q_pos, window):
        return splash_attend(q, k, v, q_pos, scale=scale, logit_cap=logit_cap,
                             sliding_window=sliding_window, window=window)

    def elsewhere(q, k, v, q_pos, window):
        return blockwise(q, q_pos, [(k, v, q_pos)], window=window)

    window = jnp.asarray(np.iinfo(np.int32).max if window is None else window, jnp.int32)
    return jax.lax.platform_dependent(q, k, v, q_pos, window, tpu=on_tpu, default=elsewhere)


def attend_pages(q: jax.Array, q_pos: jax.Array, pages: paged_attention.PagedKV, layer, *,
                 scale: float, window=None, logit_cap: float | None = None) -> attention.Partial:
    """The partial softmax of queries q [B, T, H, Dh] at positions q_pos [B, T] (a decode step:
    T = 1; a row's appended tokens: several) over the pages of layer `layer` (traced int32; a
    Python int with a pool per layer) its group reads: rows are group-major, B / G of them per
    group (attention.attend's layout), and every page lies before every query. `window`
    (traced) limits how far back a query sees.

    Under a mesh each device runs it on its groups and KV heads (shard_map): groups over the
    batch axes, KV heads and their query heads over 'tensor' when they divide it. What the
    pages hold and the kernel's bytes per token read ride in the name stack
    (`paged_<name>_token_bytes_<n>`) for the compile job.
    """
    if pages.query_slots is not None:  # some of the group-major rows: placed, then taken back
        slots, rows = pages.query_slots, pages.table.shape[0] * pages.rows_per_group
        placed = attend_pages(
            jnp.zeros((rows, *q.shape[1:]), q.dtype).at[slots].set(q, mode='drop'),
            jnp.full((rows, q_pos.shape[1]), -1, q_pos.dtype).at[slots].set(q_pos, mode='drop'),
            pages.replace(query_slots=None), layer, scale=scale, window=window,
            logit_cap=logit_cap)
        return jax.tree.map(lambda x: x[slots], placed)
    b, t, h, dh = q.shape
    k_pages, v_pages, k_scales, v_scales, layer = pages.layer(layer)
    hkv = k_pages.shape[0]
    groups = pages.table.shape[0]
    r, g = b // groups * t, h // hkv  # r: a group's queries per head (its rows' tokens)
    queries = q.reshape(groups, r, hkv, g, dh).transpose(0, 2, 1, 3, 4).reshape(
        groups, hkv, r * g, dh)
    # The first token of its group's pages each query sees: all of them, or a window's worth.
    pos = q_pos.reshape(groups, r)
    start = jnp.zeros_like(pos)
    if window is not None:
        window = jnp.minimum(window, np.iinfo(np.int32).max // 2)
        start = jnp.maximum(0, pos - window + 1 - pages.first_position[:, None])
    start = jnp.where(pos >= 0, start, pages.lengths[:, None])  # padding rows: nothing
    q_start = jnp.repeat(start, g, axis=1)[..., None]  # [G, r * g, 1]
    first_token = start.min(axis=1)
    scales = (k_scales, v_scales) if pages.quantized else ()
    kw = dict(pages_per_layer=pages.layout.pages, scale=scale, logit_cap=logit_cap)

    def local(queries, k, v, q_start, first_token, lengths, table, layer, *scales):
        sc = dict(k_scales=scales[0], v_scales=scales[1]) if scales else {}

        def on_tpu(*a):
            return paged_kernel.paged_decode_attention(*a, **kw, **sc)

        def elsewhere(*a):
            return paged_attention.reference(*a, **kw, **sc)
        token_bytes = paged_attention.pool_bytes_per_token(k.shape[0], dh, k.dtype)
        with jax.named_scope(PAGED_SCOPE.format(pages.name, token_bytes)):
            return jax.lax.platform_dependent(queries, k, v, q_start, first_token, lengths,
                                              table, layer, tpu=on_tpu, default=elsewhere)

    args = (queries, k_pages, v_pages, q_start, first_token, pages.lengths, pages.table,
            jnp.asarray(layer, jnp.int32))
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or 'tensor' not in mesh.axis_names:
        out, lse = local(*args, *scales)
    else:
        shape = dict(mesh.shape)
        rows = logical_spec(('batch',), (groups,), shape)[0]
        heads = logical_spec(('kv_heads',), (hkv,), shape)[0]
        pool = P(heads, rows, None, None)
        per_group = P(rows, heads, None, None)
        specs = (per_group, pool, pool, P(rows, None, None), P(rows), P(rows), P(rows, None), P())
        specs += (P(heads, rows, None),) * len(scales)
        out, lse = jax.shard_map(local, in_specs=specs, out_specs=(per_group, per_group),
                                 check_vma=False)(*args, *scales)

    def to_rows(x):  # [G, Hkv, r * g, ...] -> [B, T, Hkv, g, ...]
        x = x.reshape(groups, hkv, r, g, *x.shape[3:]).swapaxes(1, 2)
        return x.reshape(b, t, hkv, g, *x.shape[4:])
    lse = to_rows(lse)[..., 0]
    return attention.Partial(peak=lse, total=jnp.ones_like(lse), out=to_rows(out))


def grouped_matmul(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *, layer=None,
                   expected_rows: float | None = None, expected_groups: float | None = None,
                   every_row: bool = False) -> jax.Array:
    """[M, K] rows, sorted into consecutive groups of `group_sizes` [G], times their group's
    [K, N] of rhs [G, K, N] -> [M, N] (a MoE layer's tokens through their experts); rows past
    sum(group_sizes) give 0. With `layer` (traced int32), rhs is [L, G, K, N], every layer's
    groups, and layer `layer`'s are used where they lie: a layer sliced out of stacked weights
    is copied before a kernel call, which would double a decode step's expert reads.

    Megablox's grouped matmul (Pallas) on TPU, jax.lax.ragged_dot elsewhere. `expected_rows`
    and `expected_groups` (static: the rows in groups and the non-empty groups a call has on
    average) pick Megablox's row tile and let the compile job cost the kernel by what it moves
    (megablox_matmul); default: every row, every group. `every_row` (static): the groups cover
    every row (nothing to zero)."""
    rows = lhs.shape[0] if expected_rows is None else expected_rows
    groups = rhs.shape[-3] if expected_groups is None else expected_groups
    stacked = layer is not None
    layer = jnp.asarray(0 if layer is None else layer, jnp.int32)

    def on_tpu(lhs, rhs, group_sizes, layer):
        return megablox_matmul(lhs, rhs, group_sizes, layer=layer if stacked else None,
                               expected_rows=rows, expected_groups=groups, every_row=every_row)

    def elsewhere(lhs, rhs, group_sizes, layer):
        rhs = rhs[layer] if stacked else rhs
        return jax.lax.ragged_dot(lhs, rhs.astype(lhs.dtype), group_sizes)
    return jax.lax.platform_dependent(lhs, rhs, group_sizes, layer, tpu=on_tpu,
                                      default=elsewhere)


# Megablox tiles: rows a tile as many as a group has on average (128 to 512, MaxText's), and K
# and N blocks of at most 1024 (a [1024, 1024] bf16 block is 2 MiB; double-buffered blocks stay
# within scoped VMEM). A tile reads its rows once per N block and its group's whole [K, N].
_GMM_ROWS = (128, 256, 512)
_GMM_BLOCK = 1024
# What an average call of it moves and computes, in the name stack likewise.
GMM_SCOPE = 'grouped_matmul_bytes_{}_flops_{}'


def megablox_matmul(lhs, rhs, group_sizes, *, layer=None, expected_rows: float,
                    expected_groups: float, every_row: bool = False,
                    interpret: bool = False) -> jax.Array:
    """grouped_matmul with Megablox's kernel (jax.experimental.pallas.ops.tpu.megablox).

    The kernel visits only the row tiles of non-empty groups and reads, for each, its group's
    whole [K, N]; rows outside every group are left unwritten, so they are zeroed here (in and
    out: the backward's gradient of those rows would be unwritten too) unless `every_row` says
    there are none. A layer's groups of stacked rhs [L, G, K, N] are read in place through
    Megablox's `group_offset` (it reads group g of rhs at g - group_offset; -layer * G points
    it at the layer's; forward only: its backward would return the gradient of every layer's
    groups). What an average call moves
    and computes rides in the name stack for the compile job (tpu/costing.py's `kernel_bytes`,
    `kernel_flops`); `interpret` runs the kernel on CPU (tests)."""
    offset = None
    if layer is not None:
        offset = -jnp.asarray(layer, jnp.int32) * rhs.shape[1]
        rhs = rhs.reshape(-1, *rhs.shape[2:])
    m, k = lhs.shape
    n = rhs.shape[2]
    per_group = expected_rows / max(expected_groups, 1.0)
    tm = next((t for t in _GMM_ROWS if per_group <= t), _GMM_ROWS[-1])
    padded = -(-m // tm) * tm
    tk, tn = _gmm_block(k), _gmm_block(n)
    every_row = every_row and padded == m
    valid = (jnp.arange(padded) < group_sizes.sum())[:, None]
    if not every_row:
        lhs = jnp.where(valid, jnp.pad(lhs, ((0, padded - m), (0, 0))), 0)
    # Tiles visited on average: the groups' rows, plus a partial tile where a group starts
    # inside one; each reads its rows (once per N block) and its group's [K, N], writes its rows.
    tiles = min(padded // tm + group_sizes.shape[0] - 1,
                max(1.0, -(-expected_rows // tm) + expected_groups - 1))
    size = jnp.dtype(lhs.dtype).itemsize
    reads = tiles * (tm * k * size * -(-n // tn) + k * n * size)
    moved = round(reads + tiles * tm * n * size)
    flops = round(2 * tiles * tm * k * n)
    with jax.named_scope(GMM_SCOPE.format(moved, flops)):
        out = megablox.gmm(lhs, rhs.astype(lhs.dtype), group_sizes, lhs.dtype, (tm, tk, tn),
                           group_offset=offset, interpret=interpret)
    return out if every_row else jnp.where(valid, out, 0)[:m]


def _gmm_block(size: int) -> int:
    """The largest block of a dimension: the whole when it fits, else a multiple of 128."""
    if size <= _GMM_BLOCK:
        return size
    return next(b for b in range(_GMM_BLOCK, 0, -128) if size % b == 0)


def splash_fits(q_shape) -> bool:
    """Splash tiles need rows of a multiple of 128 slots."""
    return q_shape[1] % _MIN_TILE == 0


def splash_attend(q, k, v, q_pos, *, scale: float, logit_cap=None, sliding_window=None,
                  window=None, interpret: bool = False) -> jax.Array:
    """Self-attention of q [B, T, H, Dh] over k, v [B, T, Hkv, Dh] with the splash kernel.

    Sharded over the mesh set with jax.set_mesh (rows over the batch axes, heads over 'tensor'
    when both head counts divide), one kernel per device under shard_map. `window` (traced
    scalar) switches a layer to the sliding mask when it is below the int32 maximum.
    `interpret` runs the kernel on CPU (tests).
    """
    mesh = jax.sharding.get_abstract_mesh()
    kernel = functools.partial(_splash_local, scale=scale, logit_cap=logit_cap,
                               sliding_window=sliding_window, interpret=interpret)
    window = jnp.asarray(np.iinfo(np.int32).max if window is None else window, jnp.int32)
    if mesh.empty:
        return kernel(q, k, v, q_pos, window)
    mesh_shape = dict(mesh.shape)
    q_spec = logical_spec(('batch', None, 'act_heads', None), q.shape, mesh_shape)
    kv_spec = logical_spec(('batch', None, 'act_heads', None), k.shape, mesh_shape)
    if q_spec[2] != kv_spec[2]:  # KV heads not divisible like the query heads: keep heads whole
        q_spec = kv_spec = P(q_spec[0], None, None, None)
    rows = P(q_spec[0], None)
    return jax.shard_map(kernel, in_specs=(q_spec, kv_spec, kv_spec, rows, P()),
                         out_specs=q_spec, check_vma=False)(q, k, v, q_pos, window)


def _splash_local(q, k, v, q_pos, window, *, scale, logit_cap, sliding_window, interpret):
    """The kernel on one device's rows and heads: [b, T, h, Dh] in and out."""
    b, t, h, dh = q.shape
    tile = _tile(t)
    sizes = splash.BlockSizes(block_q=tile, block_kv=tile, block_kv_compute=tile,
                              block_q_dkv=tile, block_kv_dkv=tile, block_kv_dkv_compute=tile,
                              block_q_dq=tile, block_kv_dq=tile)

    def run(mask: splash.Mask, visited: float):
        kernel = splash.make_splash_mha(
            splash.MultiHeadMask([mask] * h), block_sizes=sizes, head_shards=1, q_seq_shards=1,
            attn_logits_soft_cap=logit_cap, interpret=interpret)
        # 0 = padding; a packed row's sequences 1, 2, ... (attention.packed_positions)
        segment = jnp.where(q_pos >= 0, (q_pos >> attention.POSITION_BITS) + 1, 0)
        flops = round(dense_attention_flops(b, t, h, dh) * visited)

        def one_row(q, k, v, segment):  # [T, h, Dh] -> the kernel's heads-major [h, T, Dh]
            heads_first = lambda x: jnp.swapaxes(x, 0, 1)
            out = kernel(heads_first(q * jnp.asarray(scale, q.dtype)), heads_first(k),
                         heads_first(v), segment_ids=splash.SegmentIds(segment, segment))
            return heads_first(out)

        with jax.named_scope(SPLASH_SCOPE.format(flops)):
            return jax.vmap(one_row)(q, k, v, segment)

    causal = splash.CausalMask((t, t))
    if sliding_window is None or sliding_window >= t:
        return run(causal, _visited_fraction(t, tile, None))
    local = splash.LocalMask((t, t), window_size=(sliding_window - 1, 0), offset=0)
    return jax.lax.cond(window < t, lambda: run(local, _visited_fraction(t, tile, sliding_window)),
                        lambda: run(causal, _visited_fraction(t, tile, None)))


def _tile(length: int) -> int:
    tile = _TILE
    while length % tile:
        tile //= 2
    return tile


def _visited_fraction(length: int, tile: int, window: int | None) -> float:
    """Fraction of [tile x tile] blocks the kernel computes under a causal (+ local) mask."""
    n = length // tile
    first_q = np.arange(n)[:, None] * tile
    first_k = np.arange(n)[None, :] * tile
    visited = first_k <= first_q + tile - 1
    if window is not None:
        visited &= (first_q - (first_k + tile - 1)) < window
    return float(visited.mean())


def dense_attention_flops(rows: int, length: int, heads: int, head_dim: int) -> float:
    """QK^T and PV FLOPs of `rows` rows of `length` tokens, every [T, T] score computed."""
    return 4.0 * rows * length * length * heads * head_dim
