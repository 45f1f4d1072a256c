"""Key/value segments and grouped-query attention over several of them.

A KVSegment holds the keys and values of some tokens for every layer, for G groups of query
rows: a batch of B = G * r query rows is group-major, rows g*r .. g*r+r-1 read group g. That is
how n samples of one prompt attend to a single copy of the prompt's KV. Masks come from
positions only: a slot is visible when its position is >= 0 (filled), <= the query position
(causal), of the query's own sequence and, on sliding-window layers, closer than the window.

A packed row (the learner's, rl/batch_layout.pack) holds several sequences one after another,
each at positions 0..len-1 of its own. Its positions carry each token's sequence in the bits
above POSITION_BITS (`packed_positions`), so the masks keep the sequences apart by position
alone and RoPE reads the position within the sequence (`position_in_sequence`). A row of one
sequence has sequence 0: its positions are the plain ones.
"""
from __future__ import annotations

import functools
from typing import NamedTuple, Sequence

import flax.struct
import jax
import jax.numpy as jnp

from jaxprefix.models.config import ModelConfig
from jaxprefix.models.layers import softcap

# Finite, so a query row with no visible key (padding) yields finite garbage, not NaN.
_MASKED = -1e30
# Positions up to 2^20 - 1 in a sequence; above them, the sequence's index in a packed row (up
# to 2^11 - 1 in an int32; TrainConfig.check_batch keeps a packed minibatch below that).
POSITION_BITS = 20


def packed_positions(positions: jax.Array, sequence: jax.Array) -> jax.Array:
    """Positions of a packed row: each token's `sequence` (int, >= 0) above its position; -1
    (padding) stays -1."""
    return jnp.where(positions >= 0, (sequence << POSITION_BITS) | positions, -1)


def position_in_sequence(positions: jax.Array) -> jax.Array:
    """A token's position within its sequence (what RoPE rotates by); -1 stays -1."""
    return jnp.where(positions >= 0, positions & ((1 << POSITION_BITS) - 1), positions)


def same_sequence(q_pos: jax.Array, k_pos: jax.Array) -> jax.Array:
    """Whether query and key positions (broadcast) lie in the same sequence of a packed row."""
    return (q_pos >> POSITION_BITS) == (k_pos >> POSITION_BITS)


@flax.struct.dataclass
class KVSegment:
    k: jax.Array    # [layers, G, S, Hkv, Dh]  (head_major: per layer [G, Hkv, Dh, S])
    v: jax.Array    # [layers, G, S, Hkv, Dh]  (head_major: per layer [G, Hkv, S, Dh])
    pos: jax.Array  # int32 [G, S], -1 marks an empty slot
    # The CPU decode's layout (backend.unrolls_layers): k and v are tuples of one array per
    # layer, each head-major, which is what a decode step's two attention dots read in place
    # (the keys transposed for the scores). From a stacked token-major segment, XLA's CPU
    # backend copies every layer's slice out, then into the dots' layouts, every step.
    head_major: bool = flax.struct.field(pytree_node=False, default=False)

    @property
    def groups(self) -> int:
        return self.pos.shape[0]

    @property
    def length(self) -> int:
        return self.pos.shape[1]

    def layer(self, i) -> tuple[jax.Array, jax.Array]:
        """(k, v) of layer i (a Python int where head_major)."""
        return self.k[i], self.v[i]

    def in_head_major(self) -> KVSegment:
        if self.head_major:
            return self
        return self.replace(k=tuple(k.transpose(0, 2, 3, 1) for k in self.k),
                            v=tuple(v.transpose(0, 2, 1, 3) for v in self.v), head_major=True)

    def in_token_major(self) -> KVSegment:
        if not self.head_major:
            return self
        return self.replace(k=jnp.stack([k.transpose(0, 3, 1, 2) for k in self.k]),
                            v=jnp.stack([v.transpose(0, 2, 1, 3) for v in self.v]),
                            head_major=False)


@flax.struct.dataclass
class KVCache(KVSegment):
    """A KVSegment with one group per query row and a write column `index` (int32 []: every row
    writes its new tokens at the same column; the static decode's cache)."""
    index: jax.Array = None

    @classmethod
    def empty(cls, config: ModelConfig, batch: int, length: int, dtype=None) -> KVCache:
        dtype = jnp.dtype(dtype or config.dtype)
        shape = (config.num_layers, batch, length, config.num_kv_heads, config.head_dim)
        return cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
                   pos=jnp.full((batch, length), -1, jnp.int32), index=jnp.zeros((), jnp.int32))


def _visible(q_pos: jax.Array, k_pos: jax.Array, window) -> jax.Array:
    """[G, r, T, S] bool: which slots each query sees. q_pos [G, r, T], k_pos [G, S]."""
    q = q_pos[..., None]
    k = k_pos[:, None, None, :]
    seen = (k >= 0) & (k <= q) & same_sequence(q, k)
    if window is not None:
        seen &= (q - k) < window
    return seen


Segment = tuple[jax.Array, jax.Array, jax.Array]  # (k, v, pos) of one layer


def attend(q: jax.Array, q_pos: jax.Array, segments: Sequence[Segment],
           *, scale: float, window=None, logit_cap: float | None = None,
           partials: Sequence[Partial] = (), head_major: Sequence[bool] = ()) -> jax.Array:
    """Attention of queries q [B, T, H, Dh] at positions q_pos [B, T] over KV segments.

    Each segment is (k [G, S, Hkv, Dh], v [G, S, Hkv, Dh], pos [G, S]) with B divisible by G.
    Queries are reshaped to [G, r, T, Hkv, H/Hkv, Dh], so a segment's KV is never copied per row.
    Each segment is normalised on its own and the partial results are merged by their running
    maxima and sums (as flash attention merges blocks): one exact softmax over all keys, without
    concatenating scores of segments laid out for different G. Scores are [G, Hkv, r, T, H/Hkv, S],
    batch dimensions first, the layout XLA's dot kernels want (2-3x faster on CPU than keys in the
    middle); only the small per-query statistics change layout.
    `window` (scalar, may be traced) limits the query-key position distance. `partials` are
    segments already attended to elsewhere (the sampler's KV pages), merged in the same way.
    `head_major[i]`: segment i is laid out head-major (KVSegment.head_major); absent, False.
    """
    b, t, h, dh = q.shape
    partial = list(partials)
    for i, (k, v, pos) in enumerate(segments):
        by_head = i < len(head_major) and head_major[i]
        g, hkv = pos.shape[0], k.shape[1 if by_head else 2]
        if b % g:
            raise ValueError(f'{b} query rows cannot be split into {g} KV groups')
        r = b // g
        qg = q.reshape(g, r, t, hkv, h // hkv, dh)
        s = jnp.einsum('grtkhd,gkds->gkrths' if by_head else 'grtkhd,gskd->gkrths', qg,
                       k.astype(q.dtype), preferred_element_type=jnp.float32) * scale
        s = softcap(s, logit_cap)
        seen = _visible(q_pos.reshape(g, r, t), pos, window)  # [G, r, T, S]
        s = jnp.where(seen[:, None, :, :, None, :], s, _MASKED)
        peak = jax.lax.stop_gradient(s.max(axis=-1))  # any shift gives the same softmax
        p = jnp.exp(s - peak[..., None])
        if by_head:  # the dot's own output layout, then the small output moved to rows
            o = jnp.einsum('gkrths,gksd->gkrthd', p.astype(q.dtype), v.astype(q.dtype),
                           preferred_element_type=jnp.float32)
            o = o.transpose(0, 2, 3, 1, 4, 5).reshape(b, t, hkv, h // hkv, dh)
        else:
            o = jnp.einsum('gkrths,gskd->grtkhd', p.astype(q.dtype), v.astype(q.dtype),
                           preferred_element_type=jnp.float32).reshape(b, t, hkv, h // hkv, dh)
        to_rows = lambda x: x.transpose(0, 2, 3, 1, 4).reshape(b, t, hkv, h // hkv)
        partial.append(Partial(to_rows(peak), to_rows(p.sum(axis=-1)), o))
    peak = functools.reduce(jnp.maximum, [m for m, _, _ in partial])
    total = sum(l * jnp.exp(m - peak) for m, l, _ in partial)
    out = sum(o * jnp.exp(m - peak)[..., None] for m, _, o in partial)
    return (out / total[..., None]).reshape(b, t, h, dh).astype(q.dtype)


class Partial(NamedTuple):
    """One segment's share of a softmax, per query row and head: out = Σ exp(s - peak) v and
    total = Σ exp(s - peak) (or a normalised out with total 1 and peak its log-sum-exp)."""
    peak: jax.Array   # f32 [B, T, Hkv, H/Hkv]
    total: jax.Array  # f32 [B, T, Hkv, H/Hkv]
    out: jax.Array    # f32 [B, T, Hkv, H/Hkv, Dh]
