"""Key/value segments and grouped-query attention over several of them.

A KVSegment holds the keys and values of some tokens for every layer, for G groups of query
rows: a batch of B = G * r query rows is group-major, rows g*r .. g*r+r-1 read group g. That is
how n samples of one prompt attend to a single copy of the prompt's KV. Masks come from
positions only: a slot is visible when its position is >= 0 (filled), <= the query position
(causal) and, on sliding-window layers, closer than the window.
"""
from __future__ import annotations

from typing import Sequence

import flax.struct
import jax
import jax.numpy as jnp

from jaxprefix.models.config import ModelConfig
from jaxprefix.models.layers import softcap

# Finite, so a query row with no visible key (padding) yields finite garbage, not NaN.
_MASKED = -1e30


@flax.struct.dataclass
class KVSegment:
  k: jax.Array    # [layers, G, S, Hkv, Dh]
  v: jax.Array    # [layers, G, S, Hkv, Dh]
  pos: jax.Array  # int32 [G, S], -1 marks an empty slot

  @property
  def groups(self) -> int:
    return self.pos.shape[0]

  @property
  def length(self) -> int:
    return self.pos.shape[1]


@flax.struct.dataclass
class KVCache(KVSegment):
  """A KVSegment with one group per query row and a write index (int32 scalar)."""
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
  seen = (k >= 0) & (k <= q)
  if window is not None:
    seen &= (q - k) < window
  return seen


Segment = tuple[jax.Array, jax.Array, jax.Array]  # (k, v, pos) of one layer


def attend(q: jax.Array, q_pos: jax.Array, segments: Sequence[Segment],
           *, scale: float, window=None, logit_cap: float | None = None) -> jax.Array:
  """Attention of queries q [B, T, H, Dh] at positions q_pos [B, T] over KV segments.

  Each segment is (k [G, S, Hkv, Dh], v [G, S, Hkv, Dh], pos [G, S]) with B divisible by G.
  Scores are computed per segment with queries reshaped to [G, r, T, Hkv, H/Hkv, Dh] (no copy
  of a segment's KV per row), concatenated along keys, and normalised by one f32 softmax.
  `window` (scalar, may be traced) limits the query-key position distance.
  """
  b, t, h, dh = q.shape
  scores, values = [], []
  for k, v, pos in segments:
    g, _, hkv, _ = k.shape
    if b % g:
      raise ValueError(f'{b} query rows cannot be split into {g} KV groups')
    r = b // g
    qg = q.reshape(g, r, t, hkv, h // hkv, dh)
    s = jnp.einsum('grtkhd,gskd->grtkhs', qg, k.astype(q.dtype),
                   preferred_element_type=jnp.float32) * scale
    s = softcap(s, logit_cap)
    seen = _visible(q_pos.reshape(g, r, t), pos, window)
    s = jnp.where(seen[:, :, :, None, None, :], s, _MASKED)
    scores.append(s.reshape(b, t, hkv, h // hkv, -1))
    values.append(v)
  lengths = [s.shape[-1] for s in scores]
  probs = jax.nn.softmax(jnp.concatenate(scores, axis=-1), axis=-1)
  out = jnp.zeros((b, t, h, dh), jnp.float32)
  start = 0
  for v, n in zip(values, lengths):
    g, _, hkv, _ = v.shape
    p = probs[..., start:start + n].astype(q.dtype).reshape(g, b // g, t, hkv, h // hkv, n)
    o = jnp.einsum('grtkhs,gskd->grtkhd', p, v.astype(q.dtype),
                   preferred_element_type=jnp.float32)
    out += o.reshape(b, t, h, dh)
    start += n
  return out.astype(q.dtype)
