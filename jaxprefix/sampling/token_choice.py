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

_CDF_BLOCK = 256  # tokens per block of the two-level CDF


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
    if top_k == 0:
        if top_p is None:
            return logits_bv
        threshold_b = _nucleus_floor(logits_bv, top_p)
    else:
        # Only the top-k are sorted (descending), so no full-vocabulary sort.
        sorted_bk, _ = jax.lax.top_k(logits_bv, min(top_k, logits_bv.shape[-1]))
        threshold_b = sorted_bk[:, -1]
        if top_p is not None:
            probs_bk = jax.nn.softmax(sorted_bk, axis=-1)
            mass_before_bk = jnp.cumsum(probs_bk, axis=-1) - probs_bk
            kept_bk = mass_before_bk < top_p  # the first token always has mass_before 0: never empty
            threshold_b = jnp.min(jnp.where(kept_bk, sorted_bk, jnp.inf), axis=-1)
    return jnp.where(logits_bv >= threshold_b[:, None], logits_bv, -jnp.inf)


def _nucleus_floor(logits_bv: jax.Array, top_p: jax.Array, steps: int = 40) -> jax.Array:
    """The smallest logit of each row's top-p nucleus, by bisection instead of a sort.

    mass(t) = P(logit >= t) falls as t rises, and mass(t) >= top_p exactly when t <= the nucleus'
    smallest logit, so bisection converges to it (to adjacent floats after ~30 halvings). A full
    49k-vocabulary sort per step cost ~0.9 s at 64 rows on CPU; 40 masked sums cost a few ms.
    """
    probs_bv = jax.nn.softmax(logits_bv, axis=-1)
    hi_b = jnp.max(logits_bv, axis=-1)
    lo_b = jnp.min(jnp.where(jnp.isfinite(logits_bv), logits_bv, hi_b[:, None]), axis=-1)

    def reaches_top_p(t_b):
        return jnp.sum(jnp.where(logits_bv >= t_b[:, None], probs_bv, 0.0), axis=-1) >= top_p

    def halve(_, bounds):  # invariant: lo feasible; hi infeasible unless it is the max itself
        lo, hi = bounds
        mid = (lo + hi) / 2
        ok = reaches_top_p(mid)
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

    lo_b, hi_b = jax.lax.fori_loop(0, steps, halve, (lo_b, hi_b))
    return jnp.where(reaches_top_p(hi_b), hi_b, lo_b)


def choose_tokens(logits_bv: jax.Array, keys_b: jax.Array,
                  settings: SamplingSettings) -> tuple[jax.Array, jax.Array]:
    """Draws one token per row; returns (tokens int32 [B], logprobs f32 [B]).

    `keys_b` holds one PRNG key per row (ignored when greedy). The log-probability is that of the
    chosen token under the tempered model, log softmax(logits / temperature), before any top-k /
    top-p truncation (greedy: temperature 1): what the learner's teacher-forced forward pass
    (`models.token_logprobs(..., temperature=T)`) gives for the same tokens, as in TRL, verl and
    Tunix, so the first importance ratio of an update is 1.
    """
    logits_bv = logits_bv.astype(jnp.float32)
    if settings.greedy:
        tokens_b = jnp.argmax(logits_bv, axis=-1).astype(jnp.int32)
        tempered_bv = logits_bv
    else:
        tempered_bv = logits_bv / settings.temperature
        candidates_bv = truncate_logits(tempered_bv, settings.top_k,
                                        settings.top_p if settings.nucleus else None)
        tokens_b = sample_inverse_cdf(keys_b, candidates_bv)
    logprobs_bv = jax.nn.log_softmax(tempered_bv, axis=-1)
    logprobs_b = jnp.take_along_axis(logprobs_bv, tokens_b[:, None], axis=-1)[:, 0]
    return tokens_b, logprobs_b


def sample_inverse_cdf(keys_b: jax.Array, logits_bv: jax.Array) -> jax.Array:
    """One token per row drawn from softmax(logits) with one uniform number per row.

    Inverse-CDF sampling: token i is drawn when cdf[i-1] <= u < cdf[i], so a token of zero
    probability (a -inf logit) never is. It needs one random number per row where the Gumbel trick
    (jax.random.categorical) needs one per vocabulary entry, which on CPU cost more than a small
    model's decode step at 64 rows. The CDF is two-level (blocks of _CDF_BLOCK tokens, then one
    block) because XLA's cumsum over a 49k vocabulary is itself slow on CPU.
    """
    b, v = logits_bv.shape
    num_blocks = -(-v // _CDF_BLOCK)
    weights_bv = jnp.exp(logits_bv - jnp.max(logits_bv, axis=-1, keepdims=True))
    weights_bv = jnp.pad(weights_bv, ((0, 0), (0, num_blocks * _CDF_BLOCK - v)))
    weights_bnk = weights_bv.reshape(b, num_blocks, _CDF_BLOCK)
    block_cdf_bn = jnp.cumsum(weights_bnk.sum(axis=-1), axis=-1)
    u_b = jax.vmap(lambda key: jax.random.uniform(key, (), jnp.float32))(keys_b)
    u_b = u_b * block_cdf_bn[:, -1]
    block_b = jnp.minimum(jnp.sum(block_cdf_bn <= u_b[:, None], axis=-1), num_blocks - 1)
    before_b = jnp.take_along_axis(jnp.pad(block_cdf_bn, ((0, 0), (1, 0))), block_b[:, None],
                                   axis=-1)[:, 0]
    in_block_bk = jnp.take_along_axis(weights_bnk, block_b[:, None, None], axis=1)[:, 0]
    offset_b = jnp.sum(jnp.cumsum(in_block_bk, axis=-1) <= (u_b - before_b)[:, None], axis=-1)
    tokens_b = (block_b * _CDF_BLOCK + jnp.minimum(offset_b, _CDF_BLOCK - 1)).astype(jnp.int32)
    # Rounding (two summation orders, p ~ 1e-7) may land on a zero-weight slot: take the mode then.
    chosen_b = jnp.take_along_axis(weights_bv, tokens_b[:, None], axis=-1)[:, 0]
    mode_b = jnp.argmax(logits_bv, axis=-1).astype(jnp.int32)
    return jnp.where(chosen_b > 0, tokens_b, mode_b)


def row_step_keys(seed_key: jax.Array, row_ids_b: jax.Array, step: jax.Array) -> jax.Array:
    """One key per row for this step: a function of (seed, row id, step) only.

    Row ids are the samples' global indices (context i, sample j -> i*n + j), and `step` (a scalar,
    or one per row) is the row's own token index, so a sample draws the same stream whatever batch
    padding, bucketing or scheduling surrounds it.
    """
    def one(row, row_step):
        return jax.random.fold_in(jax.random.fold_in(seed_key, row), row_step)
    return jax.vmap(one)(row_ids_b, jnp.broadcast_to(step, row_ids_b.shape))
