"""KV in pages: the layout (`PageLayout`), and a jnp reference of the attention over it.

The continuous sampler keeps every KV it decodes against in pages of `page_size` tokens: the
context of each group slot (read by the group's n rows together) and the tokens each row has
generated (pages drawn from a pool as the row grows; sampling/page_pool.py). A page table maps
a group's i-th page to its page in the pool. Every layer's pages live in the same pool (layer
l's page p at `page_row(l, p, pages_per_layer)`), so a layer reads its pages straight from the
pool: no layer is sliced out, and the pool rides in the decode loop's carry, written in place. During a
forward pass the pools are read only: the new token attends to itself as a segment of its own,
and the sampler writes its keys and values into the pages before the next step's pass.

The attention returns (output, log-sum-exp) so that it merges with the other parts (the
context, the new token) as attention.attend merges segments. On TPU the Pallas kernel
(paged_kernel.py) reads only the pages a group needs; elsewhere `reference` reads every page of
the layer where it lies, against its owner group's queries, and masks the rest;
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
    block-major, so that under a mesh a device holds its block's run; L is every layer (one
    array: `per_layer` False, TPU) or 1 (one array per layer: where the decoder unrolls its
    layers). Page ids in a table are local to their block. Static: hashable, jit-safe."""
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
    context's). The pool is one array of every layer's pages, or one array per layer."""
    k: tuple                # ([Hkv, D * L * P, page_size, Dh],) or L x [Hkv, D * P, ...], kv dtype
    v: tuple
    k_scale: tuple | None   # f32 [Hkv, ..., page_size] for int8 pages, else None
    v_scale: tuple | None
    table: jax.Array        # int32 [G, pages_per_group]: the group's pages (ids in its block)
    lengths: jax.Array      # int32 [G]: its tokens in those pages (0: nothing to read)
    first_position: jax.Array   # int32 [G]: the position of its first token (sliding windows)
    layout: PageLayout = flax.struct.field(pytree_node=False)
    name: str = flax.struct.field(pytree_node=False, default='pages')  # what it holds

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


def reference(q, k_pages, v_pages, q_start, first_token, lengths, table, layer, *,
              pages_per_layer: int, scale: float, logit_cap: float | None = None, k_scales=None,
              v_scales=None):
    """What paged_kernel.paged_decode_attention computes, in jnp. Same arguments and results;
    first_token only saves the kernel work. A page holds tokens of at most one group (as the
    sampler's pools do).

    Page-major: it reads the layer's pages where they lie, each page against the queries of the
    group that owns it, and merges each group's pages by their log-sum-exp. Gathering each
    group's pages into rows instead copies every page of every table, at its full width, once a
    layer and step: on CPU that copy took 37% of a long-tail decode step, where this reads each
    page of the pool once and copies only the (few) queries.
    """
    del first_token
    groups, hkv, queries, dh = q.shape
    page_size = k_pages.shape[2]
    pages = pages_per_layer
    # Each page's owner (groups: none) and its index in the owner's table, for the pages that
    # hold the owner's tokens.
    width = table.shape[1]
    used = jnp.arange(width)[None, :] * page_size < lengths[:, None]  # [G, W]
    ids = jnp.where(used, jnp.clip(table, 0, pages - 1), pages).reshape(-1)  # unused: dropped
    owner = jnp.full(pages, groups, jnp.int32).at[ids].set(
        jnp.repeat(jnp.arange(groups, dtype=jnp.int32), width), mode='drop')
    rank = jnp.zeros(pages, jnp.int32).at[ids].set(
        jnp.tile(jnp.arange(width, dtype=jnp.int32), groups), mode='drop')
    mine = owner < groups
    by_page = lambda x: x[jnp.minimum(owner, groups - 1)]  # [G, ...] -> [P, ...]

    layer_pages = lambda pool: jax.lax.dynamic_slice_in_dim(pool, page_row(layer, 0, pages), pages,
                                                            axis=1)
    k, v = layer_pages(k_pages).astype(q.dtype), layer_pages(v_pages).astype(q.dtype)
    q_pages = by_page(q).swapaxes(0, 1)  # [Hkv, P, Q, Dh]
    s = jnp.einsum('hpqd,hpnd->hpqn', q_pages, k, preferred_element_type=jnp.float32)
    if k_scales is not None:
        s = s * layer_pages(k_scales)[:, :, None, :]
    s = s * scale
    if logit_cap is not None:
        s = logit_cap * jnp.tanh(s / logit_cap)
    column = rank[:, None] * page_size + jnp.arange(page_size)  # [P, ps]: the owner's token
    seen = (mine[:, None, None] & (column[:, None, :] >= by_page(q_start))
            & (column < by_page(lengths)[:, None])[:, None, :])  # [P, Q, ps]
    s = jnp.where(seen, s, MASKED)
    # Per group: its pages' greatest score, then each page's share against it.
    def per_group(x, init, combine):  # [Hkv, P, ...] -> [Hkv, G, ...], pages combined
        empty = jnp.full((hkv, groups + 1) + x.shape[2:], init, x.dtype)  # + 1: no owner
        return getattr(empty.at[:, owner], combine)(x)[:, :groups]
    peak = per_group(s.max(axis=-1), MASKED, 'max')  # [Hkv, G, Q]
    p = jnp.where(seen, jnp.exp(s - peak[:, jnp.minimum(owner, groups - 1), :, None]), 0.0)
    total = per_group(p.sum(axis=-1), 0.0, 'add')[..., None]
    if v_scales is not None:
        p = p * layer_pages(v_scales)[:, :, None, :]
    out = per_group(jnp.einsum('hpqn,hpnd->hpqd', p.astype(q.dtype), v,
                               preferred_element_type=jnp.float32), 0.0, 'add')
    some = total > 0
    out = jnp.where(some, out / jnp.where(some, total, 1.0), 0.0)
    lse = jnp.where(some, peak[..., None] + jnp.log(jnp.where(some, total, 1.0)), MASKED)
    return out.swapaxes(0, 1), lse.swapaxes(0, 1)


def pool_bytes_per_token(kv_heads: int, head_dim: int, dtype) -> int:
    """Bytes one token's K and V take in a pool, per layer (with int8's scales)."""
    itemsize = np.dtype(dtype).itemsize
    return 2 * kv_heads * (head_dim * itemsize + (4 if np.dtype(dtype) == np.int8 else 0))
