"""Choosing one token per row from next-token logits: greedy, temperature, top-k, top-p.

Pure functions of arrays, used inside the jitted decode loop. What changes the program (greedy,
top-k, a nucleus at all) is static, so greedy or untruncated sampling compiles without the sort it
does not need; temperature and top_p are traced, so changing them does not recompile.
"""
from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np


@flax.struct.dataclass
class SamplingSettings:
  """How a token is drawn; build it with `SamplingSettings.make`.

  temperature and top_p are traced values (changing them does not recompile); whether decoding
  is greedy, top_k and whether a nucleus is cut at all are static (they change the program).
  """
  temperature: jax.Array                                  # f32 [], unused when greedy
  top_p: jax.Array                                        # f32 [], used when nucleus
  top_k: int = flax.struct.field(pytree_node=False)       # 0 = off
  greedy: bool = flax.struct.field(pytree_node=False)     # temperature 0
  nucleus: bool = flax.struct.field(pytree_node=False)    # top_p < 1

  @classmethod
  def make(cls, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0) -> 'SamplingSettings':
    """Validated settings: temperature 0 means greedy; top_k 0 and top_p 1 mean no truncation."""
    if not temperature >= 0:
      raise ValueError(f'temperature must be >= 0 (0 = greedy), got {temperature!r}')
    if not 0.0 < top_p <= 1.0:
      raise ValueError(f'top_p must be in (0, 1], got {top_p!r}')
    if int(top_k) != top_k or top_k < 0:
      raise ValueError(f'top_k must be an integer >= 0 (0 = off), got {top_k!r}')
    return cls(temperature=np.float32(max(temperature, 1e-6)), top_p=np.float32(top_p),
               top_k=int(top_k), greedy=temperature == 0, nucleus=top_p < 1.0)


def truncate_logits(logits_bv: jax.Array, top_k: int, top_p: jax.Array | None) -> jax.Array:
  """Sets to -inf every logit outside the top-k (0 = off), then outside the top-p nucleus.

  The nucleus (top_p None = off) keeps the smallest set of most likely tokens whose mass reaches
  top_p (at least one token); the mass is that of the top-k-renormalised distribution, as in
  transformers' warpers.
  """
  vocab = logits_bv.shape[-1]
  if top_k == 0 and top_p is None:
    return logits_bv
  # Sorted (descending) candidate logits: only the top-k when k is set, so no full-vocab sort.
  k = vocab if top_k == 0 else min(top_k, vocab)
  sorted_bk, _ = jax.lax.top_k(logits_bv, k)
  threshold_b = sorted_bk[:, -1]
  if top_p is not None:
    probs_bk = jax.nn.softmax(sorted_bk.astype(jnp.float32), axis=-1)
    mass_before_bk = jnp.cumsum(probs_bk, axis=-1) - probs_bk
    kept_bk = mass_before_bk < top_p  # the first token always has mass_before 0: never empty
    # The smallest kept logit: every token at or above it stays.
    threshold_b = jnp.min(jnp.where(kept_bk, sorted_bk, jnp.inf), axis=-1)
  return jnp.where(logits_bv >= threshold_b[:, None], logits_bv, -jnp.inf)


def choose_tokens(logits_bv: jax.Array, keys_b: jax.Array,
                  settings: SamplingSettings) -> tuple[jax.Array, jax.Array]:
  """Draws one token per row; returns (tokens int32 [B], logprobs f32 [B]).

  `keys_b` holds one PRNG key per row (ignored when greedy). The log-probability is that of the
  chosen token under the model itself (temperature 1, no truncation): what a teacher-forced
  forward pass (`models.token_logprobs`) gives the learner for the same tokens.
  """
  logits_bv = logits_bv.astype(jnp.float32)
  if settings.greedy:
    tokens_b = jnp.argmax(logits_bv, axis=-1).astype(jnp.int32)
  else:
    candidates_bv = truncate_logits(logits_bv / settings.temperature, settings.top_k,
                                    settings.top_p if settings.nucleus else None)
    tokens_b = jax.vmap(jax.random.categorical)(keys_b, candidates_bv).astype(jnp.int32)
  logprobs_bv = jax.nn.log_softmax(logits_bv, axis=-1)
  logprobs_b = jnp.take_along_axis(logprobs_bv, tokens_b[:, None], axis=-1)[:, 0]
  return tokens_b, logprobs_b


def row_step_keys(seed_key: jax.Array, row_ids_b: jax.Array, step: jax.Array) -> jax.Array:
  """One key per row for this step: a function of (seed, row id, step) only.

  Row ids are the samples' global indices (context i, sample j -> i*n + j), so a sample draws the
  same stream whatever batch padding or bucketing surrounds it.
  """
  def one(row):
    return jax.random.fold_in(jax.random.fold_in(seed_key, row), step)
  return jax.vmap(one)(row_ids_b)
