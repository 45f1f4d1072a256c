"""Attention without [T, S] scores: blockwise online softmax with a flash-style backward.

The same contract as attention.attend (queries over several KV segments, masks by position,
grouped-query heads, soft-capping), for the no-cache path of the decoder: the learner's forward
and backward, and the sampler's prefill. Scores exist one [block_q, block_k] tile at a time:
the forward keeps a running max, sum and output per query (Milakov & Gimelshein 2018; Dao et al.
2022) and saves only the output and the log-sum-exp, the backward recomputes each tile from them
(a plain scan under autodiff would keep every tile's probabilities: O(T^2 / block) residuals).
Tiles that no query of the tile can see (causal future, beyond the sliding window, padding) are
skipped with lax.cond, so causal attention costs about half the dense FLOPs.

A query that sees no key at all (padding) gets a zero output here and a finite garbage one in
attention.attend; every visible query gets the same result.
"""
from __future__ import annotations

import functools
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp

from jaxprefix.models.attention import Segment, same_sequence

BLOCK_Q = 512
BLOCK_K = 512
_MASKED = -1e30  # finite: exp(_MASKED - m) is 0 for any real running max m
_FAR = 2**30     # larger than any position


def attend(q: jax.Array, q_pos: jax.Array, segments: Sequence[Segment], *, scale: float,
           window=None, logit_cap: float | None = None, block_q: int = BLOCK_Q,
           block_k: int = BLOCK_K) -> jax.Array:
    """attention.attend's result, computed in [block_q, block_k] tiles.

    q [B, T, H, Dh] at positions q_pos [B, T]; each segment (k, v [G, S, Hkv, Dh], pos [G, S])
    is read by B/G query rows per group (group-major rows). `window` (scalar, may be traced)
    limits the query-key position distance. Each segment's softmax is normalised on its own and
    the results are merged by their log-sum-exps (differentiably).
    """
    b, t, h, dh = q.shape
    window = None if window is None else jnp.asarray(window, jnp.int32)
    outs, lses = [], []
    for k, v, pos in segments:
        g, _, hkv, _ = k.shape
        if b % g:
            raise ValueError(f'{b} query rows cannot be split into {g} KV groups')
        # The rows of a group read the same keys: fold them into the query axis.
        qg = q.reshape(g, (b // g) * t, hkv, h // hkv, dh)
        o, lse = segment_attention(qg, k.astype(q.dtype), v.astype(q.dtype),
                                   q_pos.reshape(g, -1), pos, window, scale=scale,
                                   logit_cap=logit_cap, block_q=block_q, block_k=block_k)
        outs.append(o.reshape(b, t, h, dh))
        lses.append(lse.reshape(b, t, h))
    if len(outs) == 1:
        return outs[0].astype(q.dtype)
    peak = jax.lax.stop_gradient(functools.reduce(jnp.maximum, lses))
    weights = [jnp.exp(lse - peak) for lse in lses]
    total = sum(weights)
    total = jnp.where(total > 0, total, 1.0)
    out = sum(o * (w / total)[..., None] for o, w in zip(outs, weights))
    return out.astype(q.dtype)


def segment_attention(q, k, v, q_pos, k_pos, window, *, scale: float, logit_cap=None,
                      block_q: int = BLOCK_Q, block_k: int = BLOCK_K):
    """Softmax attention of q [G, Tq, Hkv, Hg, Dh] over one segment k, v [G, S, Hkv, Dh].

    Returns (out f32 [G, Tq, Hkv, Hg, Dh], lse f32 [G, Tq, Hkv, Hg]); a query that sees no key
    gets out 0 and lse _MASKED. Differentiable in q, k, v (flash-style custom VJP).
    """
    tq, s = q.shape[1], k.shape[1]
    bq, bk = min(block_q, _round_up(tq, 8)), min(block_k, _round_up(s, 8))
    nq, nk = -(-tq // bq), -(-s // bk)
    q = _pad_axis(q, 1, nq * bq, 0)
    k, v = _pad_axis(k, 1, nk * bk, 0), _pad_axis(v, 1, nk * bk, 0)
    q_pos = _pad_axis(q_pos, 1, nq * bq, -1)
    k_pos = _pad_axis(k_pos, 1, nk * bk, -1)
    o, lse = _flash(_Static(scale, logit_cap, bq, bk, window is not None),
                    q, k, v, q_pos, k_pos, window if window is not None else jnp.int32(0))
    return o[:, :tq], lse[:, :tq]


# --- the tiled computation ---------------------------------------------------------------------

class _Static(NamedTuple):
    """Hashable settings of one call (custom_vjp's non-differentiable argument)."""
    scale: float
    cap: float | None
    bq: int
    bk: int
    windowed: bool


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _pad_axis(x, axis: int, size: int, value):
    if x.shape[axis] == size:
        return x
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, pad, constant_values=value)


def _blocks(x, block: int):
    """[G, N*block, ...] -> [N, G, block, ...]."""
    g, n = x.shape[0], x.shape[1] // block
    return jnp.moveaxis(x.reshape(g, n, block, *x.shape[2:]), 1, 0)


def _unblocks(x):
    """[N, G, block, ...] -> [G, N*block, ...]."""
    x = jnp.moveaxis(x, 0, 1)
    return x.reshape(x.shape[0], -1, *x.shape[3:])


def _tile_visible(q_pos, k_pos, window, st: _Static):
    """bool [nq, nk]: may any query of q tile i see any key of k tile j (in any group)?"""
    qp, kp = _blocks(q_pos, st.bq), _blocks(k_pos, st.bk)  # [n, G, block]
    q_hi = qp.max(-1)                                        # -1 when the tile is all padding
    q_lo = jnp.where(qp >= 0, qp, _FAR).min(-1)
    k_lo = jnp.where(kp >= 0, kp, _FAR).min(-1)              # _FAR when the tile is all padding
    k_hi = kp.max(-1)
    seen = k_lo[None] <= q_hi[:, None]                       # [nq, nk, G]
    if st.windowed:
        seen &= (q_lo[:, None] - k_hi[None]) < window
    return seen.any(-1)


def _seen(qp, kp, window, st: _Static):
    """bool [G, 1, 1, bq, bk] for a tile: key filled, not in the future, of the query's sequence
    (a packed row), within the window."""
    q, k = qp[:, :, None], kp[:, None, :]
    seen = (k >= 0) & (k <= q) & same_sequence(q, k)
    if st.windowed:
        seen &= (q - k) < window
    return seen[:, None, None]


def _scores(qb, kb, st: _Static):
    """Scores [G, Hkv, Hg, bq, bk] (f32, scaled, capped) and the cap's tanh (for the VJP)."""
    s = jnp.einsum('gqkhd,gskd->gkhqs', qb, kb, preferred_element_type=jnp.float32) * st.scale
    if st.cap is None:
        return s, None
    capped = jnp.tanh(s / st.cap)
    return st.cap * capped, capped


def _forward(st: _Static, q, k, v, q_pos, k_pos, window):
    qb, qpb = _blocks(q, st.bq), _blocks(q_pos, st.bq)
    kb, vb, kpb = _blocks(k, st.bk), _blocks(v, st.bk), _blocks(k_pos, st.bk)
    visible = _tile_visible(q_pos, k_pos, window, st)
    g, _, hkv, hg, dh = q.shape

    def one_q_tile(i):
        qi, qpi = qb[i], qpb[i]

        def one_k_tile(carry, j):
            def compute(carry):
                m, l, acc = carry
                s, _ = _scores(qi, kb[j], st)
                seen = _seen(qpi, kpb[j], window, st)
                m_new = jnp.maximum(m, jnp.where(seen, s, _MASKED).max(-1))
                p = jnp.where(seen, jnp.exp(s - m_new[..., None]), 0.0)
                correction = jnp.exp(m - m_new)
                l = l * correction + p.sum(-1)
                pv = jnp.einsum('gkhqs,gskd->gkhqd', p.astype(v.dtype), vb[j],
                                preferred_element_type=jnp.float32)
                return m_new, l, acc * correction[..., None] + pv
            return jax.lax.cond(visible[i, j], compute, lambda c: c, carry), None

        stats = jnp.full((g, hkv, hg, st.bq), _MASKED, jnp.float32)
        init = (stats, jnp.zeros_like(stats), jnp.zeros((g, hkv, hg, st.bq, dh), jnp.float32))
        (m, l, acc), _ = jax.lax.scan(one_k_tile, init, jnp.arange(kb.shape[0]))
        some = l > 0
        out = acc / jnp.where(some, l, 1.0)[..., None]
        lse = jnp.where(some, m + jnp.log(jnp.where(some, l, 1.0)), _MASKED)
        # [G, Hkv, Hg, bq, ...] -> [G, bq, Hkv, Hg, ...]
        return jnp.moveaxis(out, 3, 1), jnp.moveaxis(lse, 3, 1)

    out, lse = jax.lax.map(one_q_tile, jnp.arange(qb.shape[0]))
    return _unblocks(out), _unblocks(lse)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(st: _Static, q, k, v, q_pos, k_pos, window):
    return _forward(st, q, k, v, q_pos, k_pos, window)


def _flash_fwd(st, q, k, v, q_pos, k_pos, window):
    out, lse = _forward(st, q, k, v, q_pos, k_pos, window)
    return (out, lse), (q, k, v, q_pos, k_pos, window, out, lse)


def _flash_bwd(st, residuals, cotangents):
    q, k, v, q_pos, k_pos, window, out, lse = residuals
    d_out, d_lse = cotangents
    # d softmax: ds = p * (dp - sum(d_out * out) + d_lse), per query.
    delta = (d_out * out).sum(-1) - d_lse                     # [G, Tq, Hkv, Hg]
    to_tiles = lambda x: jnp.moveaxis(_blocks(x, st.bq), 2, 4)  # [nq, G, Hkv, Hg, bq, ...]
    qb, qpb = _blocks(q, st.bq), _blocks(q_pos, st.bq)
    dob = jnp.moveaxis(_blocks(d_out.astype(q.dtype), st.bq), 2, 4)   # [nq, G, Hkv, Hg, bq, Dh]
    lseb, deltab = to_tiles(lse), to_tiles(delta)                      # [nq, G, Hkv, Hg, bq]
    kb, vb, kpb = _blocks(k, st.bk), _blocks(v, st.bk), _blocks(k_pos, st.bk)
    visible = _tile_visible(q_pos, k_pos, window, st)

    def one_k_tile(dq, j):
        kj, vj, kpj = kb[j], vb[j], kpb[j]

        def one_q_tile(carry, i):
            def compute(carry):
                dk, dv, dq = carry
                s, capped = _scores(qb[i], kj, st)
                seen = _seen(qpb[i], kpj, window, st)
                p = jnp.where(seen, jnp.exp(s - lseb[i][..., None]), 0.0)
                dv = dv + jnp.einsum('gkhqs,gkhqd->gskd', p.astype(q.dtype), dob[i],
                                     preferred_element_type=jnp.float32)
                dp = jnp.einsum('gkhqd,gskd->gkhqs', dob[i], vj, preferred_element_type=jnp.float32)
                ds = p * (dp - deltab[i][..., None])
                if capped is not None:
                    ds = ds * (1.0 - capped * capped)
                ds = (ds * st.scale).astype(q.dtype)
                dq = dq.at[i].add(jnp.einsum('gkhqs,gskd->gqkhd', ds, kj,
                                             preferred_element_type=jnp.float32))
                dk = dk + jnp.einsum('gkhqs,gqkhd->gskd', ds, qb[i],
                                     preferred_element_type=jnp.float32)
                return dk, dv, dq
            return jax.lax.cond(visible[i, j], compute, lambda c: c, carry), None

        zeros = jnp.zeros(kj.shape, jnp.float32)
        (dk, dv, dq), _ = jax.lax.scan(one_q_tile, (zeros, zeros, dq), jnp.arange(qb.shape[0]))
        return dq, (dk, dv)

    dq = jnp.zeros(qb.shape, jnp.float32)
    dq, (dk, dv) = jax.lax.scan(one_k_tile, dq, jnp.arange(kb.shape[0]))
    return (_unblocks(dq).astype(q.dtype), _unblocks(dk).astype(k.dtype),
            _unblocks(dv).astype(v.dtype), None, None, None)


_flash.defvjp(_flash_fwd, _flash_bwd)
