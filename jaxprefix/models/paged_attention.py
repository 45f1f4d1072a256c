"""KV in pages: the layout (`PageLayout`), and a jnp reference of the attention over it.

The continuous sampler keeps every KV it decodes against in pages (sampling/page_pool.py): the
context of each group slot, read by the group's n rows together, and the tokens each row has
generated. A page table maps a group's i-th page to its page in the pool; `PageLayout` says
where that page lies, and the sampler's pools, the writes into them, the views a decode step
reads, this reference and the kernel all take it from there. During a forward pass the pools
are read only: the new token attends to itself as a segment of its own, and the sampler writes
its keys and values into the pages before the next step's pass.

The attention returns (output, log-sum-exp) so that it merges with the other parts (the
context, the new token) as attention.attend merges segments. On TPU the Pallas kernel
(paged_kernel.py) reads only the pages a group needs; elsewhere `reference` reads the layer's
pages where they lie, up to the highest one in use, against their owner group's queries;
backend.attend_pages picks by backend.

`PageLayout` says a pool's shape and where each page lies; the sampler's pools, the writes into
them, the views a decode step reads, this reference and the kernel all take it from there.
Where the decoder unrolls its layers (CPU) each layer has a pool of its own (`per_layer`):
XLA:CPU copies a layer's part out of a shared pool before its dots, a fifth of a long-tail
decode step.
"""
from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

MASKED = -1e30


def page_row(layer, page, pages_per_layer: int):
    """Where page `page` of `layer` lies in a block's run of a pool array: layer-major."""
    return layer * pages_per_layer + page


@dataclasses.dataclass(frozen=True)
class PageLayout:
    """One pool's shape, and where each page of it lies: the one owner of the page arithmetic.

    A pool holds `pages` pages a layer for each of `blocks` blocks of rows, each page
    `page_size` tokens of every KV head. Its arrays are [kv_heads, blocks * L * pages,
    page_size, head_dim] (int8: with f32 scales [kv_heads, blocks * L * pages, page_size]),
    block-major, so that under a mesh a device holds its block's run. Within a block's run the
    pages are layer-major: page p of layer l is row `page_row(l, p, pages)`, so a layer reads
    its pages straight from the pool (no layer is sliced out) and the pool rides in the decode
    loop's carry, written in place. L is every layer (one array: `per_layer` False, TPU) or 1
    (one array per layer, where the decoder unrolls its layers: XLA:CPU copies a layer's part
    out of a shared pool before its dots, a fifth of a long-tail decode step). Page ids in a
    table are local to their block. Static: hashable, jit-safe."""
    kv_heads: int
    head_dim: int
    layers: int
    blocks: int
    pages: int         # per layer and block
    page_size: int     # tokens per page
    dtype: str         # the pages' dtype (int8: quantized, with per-token scales)
    per_layer: bool = False

    @property
    def arrays(self) -> int:
        """How many arrays the pool is: one, or one per layer."""
        return self.layers if self.per_layer else 1

    @property
    def layers_per_array(self) -> int:
        return 1 if self.per_layer else self.layers

    @property
    def quantized(self) -> bool:
        return np.dtype(self.dtype) == np.int8

    def array_shape(self) -> tuple[int, int, int, int]:
        return (self.kv_heads, self.blocks * self.layers_per_array * self.pages, self.page_size,
                self.head_dim)

    def array_of(self, layer: int) -> tuple[int, int]:
        """(the array holding `layer`, the layer's index within it); `layer` a Python int."""
        return (layer, 0) if self.per_layer else (0, layer)

    def index(self, layer_in_array, page):
        """The row of page `page` of a layer (its index in its array) within a block's run."""
        return page_row(layer_in_array, page, self.pages)

    def empty(self) -> list[tuple]:
        """(k, v, k_scale, v_scale) of each array, zeroed (int8 scales 1)."""
        shape = self.array_shape()
        dtype = jnp.dtype(self.dtype)
        scales = (jnp.ones(shape[:3], jnp.float32),) * 2 if self.quantized else (None, None)
        return [(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) + scales
                for _ in range(self.arrays)]


@flax.struct.dataclass
class PagedKV:
    """A pool and G groups' view of it during one decode step. The B query rows are group-major:
    rows g * B/G .. (g + 1) * B/G - 1 read group g's pages (B/G = 1: a row's own tokens; n: a
    context's), or, with query_slots, row i is the group-major row query_slots[i]. The pool is
    one array of every layer's pages, or one array per layer."""
    k: tuple                # ([Hkv, D * L * P, page_size, Dh],) or L x [Hkv, D * P, ...], kv dtype
    v: tuple
    k_scale: tuple | None   # f32 [Hkv, ..., page_size] for int8 pages, else None
    v_scale: tuple | None
    table: jax.Array        # int32 [G, pages_per_group]: the group's pages (ids in its block)
    lengths: jax.Array      # int32 [G]: its tokens in those pages (0: nothing to read)
    first_position: jax.Array   # int32 [G]: the position of its first token (sliding windows)
    layout: PageLayout = flax.struct.field(pytree_node=False)
    name: str = flax.struct.field(pytree_node=False, default='pages')  # what it holds
    # Query rows that are some of the group-major rows (a decode step over the rows in flight
    # alone): row i is group-major row query_slots[i] of G * rows_per_group.
    query_slots: jax.Array | None = None   # int32 [B]
    rows_per_group: int = flax.struct.field(pytree_node=False, default=0)

    @property
    def page_size(self) -> int:
        return self.layout.page_size

    def layer(self, index):
        """(k, v, k_scale, v_scale, layer within them) of layer `index`: with a pool per layer,
        index is a Python int (the decoder's unrolled loop) and picks the layer's arrays."""
        if self.layout.per_layer:
            array, within = self.layout.array_of(index)
        else:  # a traced index (the decoder's scan) into the one array
            array, within = 0, index
        pick = lambda x: None if x is None else x[array]
        return pick(self.k), pick(self.v), pick(self.k_scale), pick(self.v_scale), within

    @property
    def quantized(self) -> bool:
        return self.k_scale is not None


# int8 pages: x = q * scale / 127, scale = max |x| over head_dim, per token and head.
_INT8_MAX = 127.0


def quantize(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [..., Dh] -> (int8 [..., Dh], f32 scale [...])."""
    scale = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=-1)
    safe = jnp.where(scale > 0, scale, 1.0)
    q = jnp.round(x.astype(jnp.float32) * (_INT8_MAX / safe[..., None]))
    return q.astype(jnp.int8), safe / _INT8_MAX


# The reference reads each group's pages this many tokens' worth at a time (a page at least),
# as far as its longest group's tokens go.
BLOCK_TOKENS = 64


def reference(q, k_pages, v_pages, q_start, first_token, lengths, table, layer, *,
              pages_per_layer: int, scale: float, logit_cap: float | None = None, k_scales=None,
              v_scales=None):
    """What paged_kernel.paged_decode_attention computes, in jnp. Same arguments and results;
    first_token only saves the kernel work.

    Group by group, as the kernel reads: a loop over the tables' columns, the pages of
    every group at a time (BLOCK_TOKENS' worth, gathered where they lie), until the longest group's last token,
    each block merged into the groups' softmax as it comes (online: the running peak, total
    and output rescaled). So a step reads the pages in use of the groups it has, whatever the
    pool's size, and no page is scattered back to its group.
    """
    del first_token
    groups, hkv, queries, dh = q.shape
    page_size = k_pages.shape[2]
    block = max(1, BLOCK_TOKENS // page_size)  # pages
    width = -(-table.shape[1] // block) * block
    table = jnp.pad(jnp.clip(table, 0, pages_per_layer - 1), ((0, 0), (0, width - table.shape[1])))
    q_start = q_start[:, None, :, 0]  # [G, 1, Q]

    def one_block(i, merged):
        peak0, total0, out0 = merged
        columns = jax.lax.dynamic_slice_in_dim(table, i * block, block, axis=1)  # [G, block]
        rows = page_row(layer, columns, pages_per_layer).reshape(-1)
        read = lambda pool: pool[:, rows].reshape(hkv, groups, block * page_size, *pool.shape[3:])
        k, v = read(k_pages).astype(q.dtype), read(v_pages).astype(q.dtype)
        s = jnp.einsum('ghqd,hgnd->ghqn', q, k, preferred_element_type=jnp.float32)
        if k_scales is not None:
            s = s * read(k_scales).swapaxes(0, 1)[:, :, None, :]
        s = s * scale
        if logit_cap is not None:
            s = logit_cap * jnp.tanh(s / logit_cap)
        token = i * block * page_size + jnp.arange(block * page_size)  # the group's own index
        seen = ((token[None, None, :] >= q_start[..., None]) &
                (token < lengths[:, None, None, None]))  # [G, 1, Q, n]
        s = jnp.where(seen, s, MASKED)
        peak = jnp.maximum(peak0, s.max(axis=-1))  # [G, Hkv, Q]
        p = jnp.where(seen, jnp.exp(s - peak[..., None]), 0.0)
        rescale = jnp.exp(peak0 - peak)
        total = total0 * rescale + p.sum(axis=-1)
        if v_scales is not None:
            p = p * read(v_scales).swapaxes(0, 1)[:, :, None, :]
        out = out0 * rescale[..., None] + jnp.einsum('ghqn,hgnd->ghqd', p.astype(q.dtype), v,
                                                     preferred_element_type=jnp.float32)
        return peak, total, out

    start = (jnp.full((groups, hkv, queries), MASKED, jnp.float32),
             jnp.zeros((groups, hkv, queries), jnp.float32),
             jnp.zeros((groups, hkv, queries, dh), jnp.float32))
    blocks = -(-jnp.max(lengths) // (block * page_size))
    peak, total, out = jax.lax.fori_loop(0, blocks, one_block, start)
    total = total[..., None]
    some = total > 0
    out = jnp.where(some, out / jnp.where(some, total, 1.0), 0.0)
    lse = jnp.where(some, peak[..., None] + jnp.log(jnp.where(some, total, 1.0)), MASKED)
    return out, lse


def pool_bytes_per_token(kv_heads: int, head_dim: int, dtype) -> int:
    """Bytes one token's K and V take in a pool, per layer (with int8's scales)."""
    itemsize = np.dtype(dtype).itemsize
    return 2 * kv_heads * (head_dim * itemsize + (4 if np.dtype(dtype) == np.int8 else 0))
