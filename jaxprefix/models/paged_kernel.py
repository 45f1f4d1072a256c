"""A Pallas TPU kernel: decode queries over KV pages, returning the output and its log-sum-exp.

JAX ships paged decode kernels (jax.experimental.pallas.ops.tpu.paged_attention and
ragged_paged_attention), but both return only the normalised output and give each query row
its own page table. The sampler needs two things they lack: the n samples of a context read the
context's pages ONCE (a group of query rows shares one page table), and the partial results of
the context and of each row's own tokens merge by their log-sum-exp. So this kernel takes a
group of Q query vectors per page table (the group's rows times the query heads of one KV head)
and returns (output, log-sum-exp).

Layout (one device's share; the caller shards groups and KV heads): queries [G, Hkv, Q, Dh],
pages [Hkv, total_pages, page_size, Dh] laid out as `paged_attention.PageLayout` says (every
layer's pages in one pool, so no layer is ever sliced out and copied), a page table
[G, pages_per_group], lengths [G] and, per query, the first token it may see (q_start [G, Q, 1]:
sliding windows; 0 elsewhere) with first_token [G] their minimum. Grid (group, KV head, block of
pages): each step copies `pages_per_block` pages from HBM into one half of a double buffer
while the other half is computed on; blocks outside [first_token, length) are neither copied
nor computed. int8 pages carry one scale per token and head ([Hkv, total_pages, page_size] f32):
the scores are scaled after the q.k product, the probabilities before the p.v product.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jaxprefix.models import paged_attention

MASKED = -1e30  # finite: a query with nothing to read yields 0 and this log-sum-exp, never NaN


def _kernel(layer_ref, first_ref, lengths_ref, table_ref,           # scalar prefetch (SMEM)
            q_ref, q_start_ref, k_hbm, v_hbm, *rest,
            pages_per_block, page_size, pages_per_layer, scale, logit_cap, quantized):
    if quantized:
        ks_hbm, vs_hbm, o_ref, lse_ref, kbuf, vbuf, ksbuf, vsbuf, sems, m_ref, l_ref, acc_ref = rest
    else:
        o_ref, lse_ref, kbuf, vbuf, sems, m_ref, l_ref, acc_ref = rest
    g, h, block = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    first_token, length = first_ref[g], lengths_ref[g]
    block_tokens = pages_per_block * page_size
    # lax.div, not //: floor division lowers through sign(), which asks the local chip's kind.
    blocks = jax.lax.div(length + block_tokens - 1, block_tokens)
    first_block = jax.lax.div(first_token, block_tokens)

    def copies(which, slot):
        """The DMAs of block `which` into buffer half `slot`, one per page it needs."""
        out = []
        for i in range(pages_per_block):
            page_no = which * pages_per_block + i
            page = paged_attention.page_row(layer_ref[0], table_ref[g, page_no], pages_per_layer)
            pairs = [(k_hbm.at[h, page], kbuf.at[slot, i]), (v_hbm.at[h, page], vbuf.at[slot, i])]
            if quantized:  # a page's scales land in its lanes of the block's [1, N] row
                lanes = pl.ds(i * page_size, page_size)
                pairs += [(ks_hbm.at[h, page], ksbuf.at[slot, :, lanes]),
                          (vs_hbm.at[h, page], vsbuf.at[slot, :, lanes])]
            needed = (page_no * page_size < length) & ((page_no + 1) * page_size > first_token)
            out.append((needed,
                        [pltpu.make_async_copy(src, dst, sems.at[slot]) for src, dst in pairs]))
        return out

    def start(which, slot):
        for needed, dmas in copies(which, slot):
            @pl.when(needed)
            def _():
                for dma in dmas:
                    dma.start()

    @pl.when(block == 0)
    def _():
        m_ref[...] = jnp.full(m_ref.shape, MASKED, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @pl.when((block >= first_block) & (block < blocks))
    def _():
        slot = jax.lax.rem(block, 2)

        @pl.when(block == first_block)  # later blocks were started one step ahead
        def _():
            start(block, slot)

        @pl.when(block + 1 < blocks)
        def _():
            start(block + 1, 1 - slot)

        for needed, dmas in copies(block, slot):
            @pl.when(needed)
            def _():
                for dma in dmas:
                    dma.wait()

        first = block * block_tokens
        column = first + jax.lax.broadcasted_iota(jnp.int32, (1, block_tokens), 1)
        seen = (column >= q_start_ref[...]) & (column < length)  # [Q, N]
        k = kbuf[slot].reshape(block_tokens, -1)
        v = vbuf[slot].reshape(block_tokens, -1)
        q = q_ref[...]
        compute = q.dtype
        s = jax.lax.dot_general(q, k.astype(compute), (((1,), (1,)), ((), ())),
                                preferred_element_type=jnp.float32)  # [Q, N]
        if quantized:
            s = s * ksbuf[slot]
        s = s * scale
        if logit_cap is not None:
            s = logit_cap * jnp.tanh(s / logit_cap)
        s = jnp.where(seen, s, MASKED)
        m_prev = m_ref[...]
        m_new = jnp.maximum(m_prev, s.max(axis=1, keepdims=True))
        p = jnp.where(seen, jnp.exp(s - m_new), 0.0)
        correction = jnp.exp(m_prev - m_new)
        l_ref[...] = correction * l_ref[...] + p.sum(axis=1, keepdims=True)
        if quantized:  # scales of pages not read are stale too: mask after scaling
            p = jnp.where(seen, p * vsbuf[slot], 0.0)
        # Stale buffer rows outside the pages read may hold anything: zero them (0 * NaN is NaN).
        row = first + jax.lax.broadcasted_iota(jnp.int32, (block_tokens, 1), 0)
        v = jnp.where((row >= first_token) & (row < length), v.astype(compute), 0)
        acc_ref[...] = correction * acc_ref[...] + jax.lax.dot_general(
            p.astype(compute), v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        m_ref[...] = m_new

    @pl.when(block == pl.num_programs(2) - 1)
    def _():
        total = l_ref[...]
        some = total > 0
        o_ref[...] = jnp.where(some, acc_ref[...] / jnp.where(some, total, 1.0), 0.0)
        lse_ref[...] = jnp.where(some, m_ref[...] + jnp.log(jnp.where(some, total, 1.0)), MASKED)


def paged_decode_attention(q, k_pages, v_pages, q_start, first_token, lengths, table, layer, *,
                           pages_per_layer: int, scale: float, logit_cap: float | None = None,
                           k_scales=None, v_scales=None, pages_per_block: int = 8,
                           interpret: bool = False):
    """(out f32 [G, Hkv, Q, Dh], log-sum-exp f32 [G, Hkv, Q, 1]) of queries q [G, Hkv, Q, Dh]
    over the tokens q_start[g, i] .. lengths[g] - 1 of group g's pages table[g] in layer `layer`
    (int32 []); first_token [G] is the least q_start of each group. A query with no such token
    gives 0 and MASKED.

    `pages_per_block` pages are copied and computed per grid step (at most the table's width,
    which it must divide). `interpret` runs the kernel on CPU (tests)."""
    groups, hkv, queries, dh = q.shape
    page_size = k_pages.shape[2]
    width = table.shape[1]
    pages_per_block = min(pages_per_block, width)
    if width % pages_per_block:
        raise ValueError(f'pages_per_block={pages_per_block} must divide the page table width '
                         f'{width}')
    quantized = k_scales is not None
    kernel = functools.partial(_kernel, pages_per_block=pages_per_block, page_size=page_size,
                               pages_per_layer=pages_per_layer, scale=scale, logit_cap=logit_cap,
                               quantized=quantized)
    group_block = pl.BlockSpec((None, None, queries, dh), lambda i, h, j, *_: (i, h, 0, 0))
    lse_block = pl.BlockSpec((None, None, queries, 1), lambda i, h, j, *_: (i, h, 0, 0))
    start_block = pl.BlockSpec((None, queries, 1), lambda i, h, j, *_: (i, 0, 0))
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    # Scales as [Hkv, pages, 1, page_size]: a page's scales are one lane row (a free reshape).
    pages = [k_pages, v_pages] + ([x[:, :, None, :] for x in (k_scales, v_scales)]
                                  if quantized else [])
    scratch = [pltpu.VMEM((2, pages_per_block, page_size, dh), k_pages.dtype),
               pltpu.VMEM((2, pages_per_block, page_size, dh), v_pages.dtype)]
    if quantized:
        scratch += [pltpu.VMEM((2, 1, pages_per_block * page_size), jnp.float32)] * 2
    scratch += [pltpu.SemaphoreType.DMA((2,)),
                pltpu.VMEM((queries, 1), jnp.float32), pltpu.VMEM((queries, 1), jnp.float32),
                pltpu.VMEM((queries, dh), jnp.float32)]
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=4, grid=(groups, hkv, width // pages_per_block),
        in_specs=[group_block, start_block] + [hbm] * len(pages),
        out_specs=[group_block, lse_block], scratch_shapes=scratch)
    return pl.pallas_call(
        kernel, grid_spec=grid_spec,
        out_shape=[jax.ShapeDtypeStruct((groups, hkv, queries, dh), jnp.float32),
                   jax.ShapeDtypeStruct((groups, hkv, queries, 1), jnp.float32)],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=('parallel', 'arbitrary', 'arbitrary')),
        interpret=pltpu.InterpretParams() if interpret else False,
    )(jnp.reshape(layer, (1,)).astype(jnp.int32), first_token.astype(jnp.int32),
      lengths.astype(jnp.int32), table.astype(jnp.int32), q, q_start.astype(jnp.int32), *pages)

