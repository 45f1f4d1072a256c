"""KV in pages: the layout, and a jnp reference of the attention over it.

The continuous sampler keeps every KV it decodes against in pages of `page_size` tokens: the
context of each group slot (read by the group's n rows together) and the tokens each row has
generated (pages drawn from a pool as the row grows; sampling/page_pool.py). A page table maps
a group's i-th page to its page in the pool. Every layer's pages live in the same pool (layer
l's page p at `l * pages_per_layer + p`), so a layer reads its pages straight from the pool: no
layer is sliced out, and the pool rides in the decode loop's carry, written in place. During a
forward pass the pools are read only: the new token attends to itself as a segment of its own,
and the sampler writes its keys and values into the pages after the pass.

The attention returns (output, log-sum-exp) so that it merges with the other parts (the
context, the new token) as attention.attend merges segments. On TPU the Pallas kernel
(paged_kernel.py) reads only the pages a group needs; elsewhere `reference` gathers the group's
pages and masks; tpu_attention.attend_pages picks by backend.

Pools are [Hkv, D * layers * pages_per_layer, page_size, Dh]: the D blocks of rows (one per row
device) each own a contiguous run of pages, so under a mesh a device holds its rows' pages and
its KV heads, and page ids in a table are local to the row's block.
"""
from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

MASKED = -1e30


@flax.struct.dataclass
class PagedKV:
    """A pool and G groups' view of it during one decode step. The B query rows are group-major:
    rows g * B/G .. (g + 1) * B/G - 1 read group g's pages (B/G = 1: a row's own tokens; n: a
    context's)."""
    k: jax.Array            # [Hkv, D * L * P, page_size, Dh], kv dtype
    v: jax.Array
    k_scale: jax.Array | None   # f32 [Hkv, D * L * P, page_size] for int8 pages, else None
    v_scale: jax.Array | None
    table: jax.Array        # int32 [G, pages_per_group]: the group's pages (ids in its block)
    lengths: jax.Array      # int32 [G]: its tokens in those pages (0: nothing to read)
    first_position: jax.Array   # int32 [G]: the position of its first token (sliding windows)
    pages_per_layer: int = flax.struct.field(pytree_node=False)
    name: str = flax.struct.field(pytree_node=False, default='pages')  # what it holds

    @property
    def page_size(self) -> int:
        return self.k.shape[2]

    @property
    def quantized(self) -> bool:
        return self.k_scale is not None


def empty_pool(*, kv_heads: int, head_dim: int, pages: int, page_size: int, dtype):
    """(k, v, k_scale, v_scale) of a pool of `pages` pages (all layers and blocks); int8 pools
    carry per-token scales."""
    dtype = jnp.dtype(dtype)
    shape = (kv_heads, pages, page_size, head_dim)
    scales = (jnp.ones(shape[:3], jnp.float32),) * 2 if dtype == jnp.int8 else (None, None)
    return (jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) + scales


# int8 pages: x = q * scale / 127, scale = max |x| over head_dim, per token and head.
_INT8_MAX = 127.0


def quantize(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [..., Dh] -> (int8 [..., Dh], f32 scale [...])."""
    scale = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=-1)
    safe = jnp.where(scale > 0, scale, 1.0)
    q = jnp.round(x.astype(jnp.float32) * (_INT8_MAX / safe[..., None]))
    return q.astype(jnp.int8), safe / _INT8_MAX


def reference(q, k_pages, v_pages, q_start, first_token, lengths, table, layer, *,
              pages_per_layer: int, scale: float, logit_cap: float | None = None, k_scales=None,
              v_scales=None):
    """What paged_kernel.paged_decode_attention computes, in jnp: gathers each group's pages of
    layer `layer` (all of the table, those outside the tokens masked). Same arguments and
    results; first_token only saves the kernel work."""
    del first_token
    b, hkv, g, dh = q.shape
    page_size = k_pages.shape[2]
    pages = layer * pages_per_layer + jnp.clip(table, 0, pages_per_layer - 1)  # [B, W]

    # KV heads stay the leading batch dimension throughout (pool[:, pages] is [Hkv, B, W, ...]):
    # moving them behind the rows would copy every gathered page once more (measured on CPU).
    def rows(pool):  # [Hkv, N, ps, ...] -> [Hkv, B, W * ps, ...]
        return pool[:, pages].reshape(hkv, b, -1, *pool.shape[3:])

    k, v = rows(k_pages).astype(q.dtype), rows(v_pages).astype(q.dtype)
    s = jnp.einsum('bhgd,hbnd->hbgn', q, k, preferred_element_type=jnp.float32)
    if k_scales is not None:
        s = s * rows(k_scales)[:, :, None, :]
    s = s * scale
    if logit_cap is not None:
        s = logit_cap * jnp.tanh(s / logit_cap)
    column = jnp.arange(table.shape[1] * page_size)
    seen = (column >= q_start) & (column < lengths[:, None, None])  # [G, Q, N]
    s = jnp.where(seen, s, MASKED)
    peak = s.max(axis=-1, keepdims=True)
    p = jnp.where(seen, jnp.exp(s - peak), 0.0)
    total = p.sum(axis=-1, keepdims=True)
    if v_scales is not None:
        p = p * rows(v_scales)[:, :, None, :]
    out = jnp.einsum('hbgn,hbnd->hbgd', p.astype(q.dtype), v, preferred_element_type=jnp.float32)
    some = total > 0
    out = jnp.where(some, out / jnp.where(some, total, 1.0), 0.0)
    lse = jnp.where(some, peak + jnp.log(jnp.where(some, total, 1.0)), MASKED)
    return out.swapaxes(0, 1), lse.swapaxes(0, 1)


def pool_bytes_per_token(kv_heads: int, head_dim: int, dtype) -> int:
    """Bytes one token's K and V take in a pool, per layer (with int8's scales)."""
    itemsize = np.dtype(dtype).itemsize
    return 2 * kv_heads * (head_dim * itemsize + (4 if np.dtype(dtype) == np.int8 else 0))
