"""RL objectives as pure array functions: group advantages, clipped policy losses, KL, entropy.

Shapes: rewards [G, n] (G groups of n samples of one context); per-token arrays [B, T] aligned
with the sampler's `completion_mask` (1 only on sampled tokens: prompt and prefix tokens never
carry loss); advantages [B] (one per sequence, broadcast over its tokens) or [B, T] (a packed
batch: rl/batch_layout.pack).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

ADVANTAGE_MODES = ("grpo", "dr_grpo", "rloo", "pass_at_k")
RATIO_LEVELS = ("token", "sequence")
AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")
KL_KINDS = ("k1", "k3")
OLD_LOGPROBS = ("sampler", "learner")


def group_advantages(rewards, mode: str = "grpo", eps: float = 1e-6, k: int = 1):
    """Advantages [G, n] of each sample relative to its group.

    grpo: (r - mean) / (std + eps), std unbiased (ddof=1) as in DeepSeekMath / TRL.
    dr_grpo: r - mean (Dr. GRPO drops the std, which up-weights easy and hard groups).
    rloo: r - mean of the other n-1 samples, i.e. n/(n-1) * (r - mean).
    pass_at_k: the analytical pass@k advantage for `k` (see `pass_at_k_advantages`).
    """
    rewards = jnp.asarray(rewards, jnp.float32)
    if rewards.ndim != 2 or rewards.shape[1] < 2:
        raise ValueError(f"group_advantages: rewards must be [groups, n >= 2], got {rewards.shape}")
    n = rewards.shape[1]
    if mode == "pass_at_k":
        return pass_at_k_advantages(rewards, k, eps)
    centred = rewards - rewards.mean(axis=1, keepdims=True)
    if mode == "grpo":
        return centred / (rewards.std(axis=1, ddof=1, keepdims=True) + eps)
    if mode == "dr_grpo":
        return centred
    if mode == "rloo":
        return centred * (n / (n - 1))
    raise ValueError(f"group_advantages: mode must be one of {ADVANTAGE_MODES}, got {mode!r}")


def pass_at_k_advantages(rewards, k: int, eps: float = 1e-6):
    """Advantages [G, n] that optimise pass@k instead of pass@1: the analytical form of "Pass@k
    Training" (Chen et al. 2025, arXiv 2508.10751, Sec. 4.3).

    A group of n samples, n_neg of them wrong (reward <= 0.5), is scored as all C(n, k) subsets
    of k samples, each worth 1 if it holds a correct sample. Their mean reward and spread are
        R = 1 - C(n_neg, k) / C(n, k),   sigma = sqrt(R (1 - R)),
    and each sample's advantage is the mean normalised advantage of the subsets containing it:
        correct: (1 - R) / sigma
        wrong:   (1 - R - C(n_neg - 1, k - 1) / C(n - 1, k - 1)) / sigma
    (a wrong sample is in an all-wrong subset with that probability). k = 1 gives GRPO with the
    population std. A group with no correct sample, or no wrong one, gets 0.
    """
    rewards = jnp.asarray(rewards, jnp.float32)
    n = rewards.shape[1]
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k_advantages: k must be in 1..n={n}, got {k}")
    correct = rewards > 0.5
    n_neg = (~correct).sum(axis=1, keepdims=True).astype(jnp.float32)
    # C(a, j) / C(b, j) as a product of j ratios (a term is 0 once a - i < 0: no such subset).
    def ratio(a, b, j):
        out = jnp.ones_like(a)
        for i in range(j):
            out = out * jnp.maximum(a - i, 0.0) / (b - i)
        return out
    mean = 1.0 - ratio(n_neg, float(n), k)
    sigma = jnp.sqrt(mean * (1.0 - mean))
    wrong_in_failed_subset = ratio(n_neg - 1.0, float(n - 1), k - 1)
    advantage = jnp.where(correct, 1.0 - mean, 1.0 - mean - wrong_in_failed_subset)
    return jnp.where(sigma > 0, advantage / (sigma + eps), 0.0)


def entropy_bonus(entropy, mask, coef: float, aggregation: str = "token_mean", **normalisers):
    """coef * the entropy of the policy over the loss tokens, aggregated like the policy loss
    (normalisers: `aggregate`'s max_len / total_tokens / total_sequences). Subtracted from the
    loss: the bonus POPE reports does not fix hard problems."""
    return coef * aggregate(entropy, mask, aggregation, **normalisers)


def mask_truncated(completion_mask, stopped):
    """Zero the loss mask of completions cut off at max_new_tokens (DAPO overlong filtering)."""
    return completion_mask * jnp.asarray(stopped, completion_mask.dtype)[:, None]


def masked_mean(x, mask):
    mask = mask.astype(x.dtype)
    return (x * mask).sum() / jnp.maximum(mask.sum(), 1.0)


def sequence_log_ratio(logp, old_logp, mask):
    """Per-sequence mean log importance ratio [B] over completion tokens (GSPO)."""
    mask = mask.astype(logp.dtype)
    return ((logp - old_logp) * mask).sum(-1) / jnp.maximum(mask.sum(-1), 1.0)


def importance_ratio(logp, old_logp, mask, level: str = "token"):
    """Ratio pi/pi_old per token [B, T].

    level='sequence' is GSPO-token: the value is the sequence ratio exp(mean log ratio), and the
    gradient through token t is ratio * grad log pi(t), so with seq_mean_token_mean it equals GSPO.
    """
    if level == "token":
        return jnp.exp(logp - old_logp)
    if level == "sequence":
        seq = jax.lax.stop_gradient(sequence_log_ratio(logp, old_logp, mask))
        return jnp.exp(seq[:, None] + logp - jax.lax.stop_gradient(logp))
    raise ValueError(f"importance_ratio: level must be one of {RATIO_LEVELS}, got {level!r}")


def truncated_importance_weights(old_logp, sampler_logp, cap: float):
    """Per-token TIS weights [B, T]: min(pi_old / pi_sampler, cap), detached.

    The sampler draws from its own numerics (a bf16 or 8-bit KV cache, another engine), a little
    off the learner's pi_old at the same weights; the policy gradient is an expectation under
    pi_old, so each sampled token is re-weighted by pi_old / pi_sampler, capped for variance
    (verl's TIS; Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy
    RL training"). Detached: a weight, not a path for the gradient.
    """
    return jax.lax.stop_gradient(jnp.minimum(jnp.exp(old_logp - sampler_logp), cap))


def ratio_band_mask(old_logp, sampler_logp, c: float):
    """Per-token keep mask [B, T], detached: 1 where pi_old / pi_sampler lies in [1/c, c], else 0.

    IcePop (Ling Team 2025, Ring-1T): a token the sampler and the learner disagree on by more
    than a factor c (numerics, or stale weights) is dropped from the policy gradient rather than
    re-weighted (as TIS does): its gradient would be more the mismatch's than the policy's.
    """
    r = jnp.exp(old_logp - sampler_logp)
    return jax.lax.stop_gradient(((r >= 1.0 / c) & (r <= c)).astype(jnp.float32))


def logprob_mismatch(sampler_logp, learner_logp, mask):
    """(mean, max) over mask tokens of |sampler - learner| log-prob: how far the sampler's
    numerics are from the learner's at the same weights."""
    m = mask.astype(jnp.float32)
    gap = jnp.abs(sampler_logp - learner_logp).astype(jnp.float32)
    return (gap * m).sum() / jnp.maximum(m.sum(), 1.0), jnp.where(m > 0, gap, 0.0).max()


def token_advantages(advantages):
    """Advantages [B, T]: per sequence ([B]) broadcast over its tokens, or per token already."""
    return advantages if advantages.ndim == 2 else advantages[:, None]


def clipped_surrogate(ratio, advantages, eps_low: float, eps_high: float):
    """PPO per-token loss -min(r A, clip(r, 1-eps_low, 1+eps_high) A); separate eps (DAPO)."""
    adv = token_advantages(advantages)
    unclipped = ratio * adv
    clipped = jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high) * adv
    return -jnp.minimum(unclipped, clipped)


def aggregate(per_token, mask, mode: str = "token_mean", *, max_len: int | None = None,
              total_tokens=None, total_sequences=None):
    """Reduce a per-token loss [B, T] to a scalar; only mask=1 tokens count.

    token_mean: sum / number of tokens (DAPO).
    seq_mean_token_mean: mean over sequences of each sequence's token mean (GRPO paper).
    seq_mean_token_sum_norm: sum / (sequences * max_len), a constant normaliser (Dr. GRPO).
    total_tokens / total_sequences: normalisers of the whole minibatch when this call sees one
    micro-batch of it, so that micro-batch losses (and gradients) add up to the minibatch's.
    """
    mask = mask.astype(per_token.dtype)
    masked = per_token * mask
    if mode == "token_mean":
        denom = mask.sum() if total_tokens is None else total_tokens
        return masked.sum() / jnp.maximum(denom, 1.0)
    if mode == "seq_mean_token_mean":
        tokens = mask.sum(-1)
        per_seq = masked.sum(-1) / jnp.maximum(tokens, 1.0)
        denom = (tokens > 0).sum() if total_sequences is None else total_sequences
        return per_seq.sum() / jnp.maximum(denom, 1.0)
    if mode == "seq_mean_token_sum_norm":
        length = per_token.shape[1] if max_len is None else max_len
        sequences = per_token.shape[0] if total_sequences is None else total_sequences
        return masked.sum() / (jnp.maximum(sequences, 1.0) * length)
    raise ValueError(f"aggregate: mode must be one of {AGGREGATIONS}, got {mode!r}")


def kl_penalty(logp, ref_logp, kind: str = "k3"):
    """Per-token estimate of KL(pi || pi_ref) from samples of pi (Schulman's k1 / k3)."""
    if kind == "k1":
        return logp - ref_logp
    if kind == "k3":
        # exp(d) - d - 1 with d = ref - logp: unbiased, always >= 0, low variance.
        d = ref_logp - logp
        return jnp.exp(d) - d - 1.0
    raise ValueError(f"kl_penalty: kind must be one of {KL_KINDS}, got {kind!r}")


# A token whose sampler and learner log-probs differ by more than this is counted apart.
LOGP_DIFF_FAR = 0.1


def ratio_stats(ratio, advantages, mask, eps_low: float, eps_high: float):
    """Token-weighted sums of the ratio diagnostics (sums, so micro-batches can be added).

    clipped_low: tokens with A < 0 whose ratio fell below 1 - eps_low (gradient cut off);
    clipped_high: tokens with A > 0 above 1 + eps_high; logp_diff: |log ratio|, on the first
    minibatch the learner's log-prob against the sampler's at the same weights (the mismatch),
    its sum, largest, and the tokens past LOGP_DIFF_FAR.
    """
    m = mask.astype(jnp.float32)
    r = jax.lax.stop_gradient(ratio).astype(jnp.float32)
    adv = token_advantages(advantages)
    low = (r < 1.0 - eps_low) & (adv < 0)
    high = (r > 1.0 + eps_high) & (adv > 0)
    big = jnp.finfo(jnp.float32).max
    diff = jnp.abs(jnp.log(jnp.maximum(r, 1e-30)))
    return {
        "tokens": m.sum(),
        "clip_low_sum": (low * m).sum(),
        "clip_high_sum": (high * m).sum(),
        "ratio_sum": (r * m).sum(),
        "ratio_min": jnp.where(m > 0, r, big).min(),
        "ratio_max": jnp.where(m > 0, r, -big).max(),
        "ratio_dev_max": jnp.where(m > 0, jnp.abs(r - 1.0), 0.0).max(),
        "logp_diff_sum": (diff * m).sum(),
        "logp_diff_max": jnp.where(m > 0, diff, 0.0).max(),
        "logp_diff_far_sum": ((diff > LOGP_DIFF_FAR) * m).sum(),
    }


def finish_ratio_stats(sums):
    """Turn summed diagnostics into means: clip fractions and ratio mean/min/max (with no loss
    token computed, e.g. every micro-batch skipped, those of an unchanged policy: 1)."""
    tokens = jnp.maximum(sums["tokens"], 1.0)
    seen = lambda x: jnp.where(sums["tokens"] > 0, x, 1.0)
    return {
        "clip_frac/low": sums["clip_low_sum"] / tokens,
        "clip_frac/high": sums["clip_high_sum"] / tokens,
        "clip_frac/total": (sums["clip_low_sum"] + sums["clip_high_sum"]) / tokens,
        "ratio/mean": seen(sums["ratio_sum"] / tokens),
        "ratio/min": seen(sums["ratio_min"]),
        "ratio/max": seen(sums["ratio_max"]),
        "ratio/max_abs_dev": sums["ratio_dev_max"],
    }


def policy_loss(logp, old_logp, advantages, mask, *, eps_low: float = 0.2,
                eps_high: float = 0.2, ratio: str = "token", aggregation: str = "token_mean",
                max_len: int | None = None, ref_logp=None, kl_coef: float = 0.0,
                kl_kind: str = "k3", total_tokens=None, total_sequences=None,
                sampler_logp=None, tis_cap: float = 0.0, ratio_mask: float = 0.0):
    """Clipped policy-gradient loss (+ optional KL to a frozen reference) and its diagnostics.

    sampler_logp with tis_cap > 0: truncated importance sampling, the policy-gradient term of
    each token times `truncated_importance_weights(old_logp, sampler_logp, tis_cap)` (old_logp
    then being the learner's recomputation; the KL term is not re-weighted, as in verl).
    sampler_logp with ratio_mask c > 0: IcePop, the policy-gradient term of each token whose
    pi_old / pi_sampler leaves [1/c, c] multiplied by 0 (`ratio_band_mask`; before TIS, which then
    weighs the rest; the KL term is kept).
    Returns (loss scalar, stats) with stats summed over tokens (see `ratio_stats`) plus
    'kl_sum' (masked sum of the per-token KL, 0 without a reference), with TIS
    'tis_weight_sum' and 'tis_capped_sum' (tokens whose weight hit the cap), and with the ratio
    mask 'ratio_masked_sum' (loss tokens masked).
    """
    r = importance_ratio(logp, old_logp, mask, ratio)
    per_token = clipped_surrogate(r, advantages, eps_low, eps_high)
    keep = None
    if ratio_mask > 0:
        if sampler_logp is None:
            raise ValueError("policy_loss: ratio_mask > 0 needs sampler_logp")
        # Masked tokens stay in the normaliser (`aggregate` divides by `mask`, not `mask * keep`),
        # as in IcePop: dropping a token takes its term out without scaling up the others'.
        keep = ratio_band_mask(old_logp, sampler_logp, ratio_mask)
        per_token = per_token * keep
    tis = None
    if tis_cap > 0:
        if sampler_logp is None:
            raise ValueError("policy_loss: tis_cap > 0 needs sampler_logp")
        tis = truncated_importance_weights(old_logp, sampler_logp, tis_cap)
        per_token = per_token * tis
    kl_sum = jnp.zeros((), jnp.float32)
    if ref_logp is not None:
        kl = kl_penalty(logp, ref_logp, kl_kind)
        per_token = per_token + kl_coef * kl
        kl_sum = (jax.lax.stop_gradient(kl) * mask).sum()
    loss = aggregate(per_token, mask, aggregation, max_len=max_len, total_tokens=total_tokens,
                     total_sequences=total_sequences)
    stats = ratio_stats(r, advantages, mask, eps_low, eps_high)
    stats["kl_sum"] = kl_sum
    if tis is not None:
        m = mask.astype(jnp.float32)
        stats["tis_weight_sum"] = (tis * m).sum()
        stats["tis_capped_sum"] = ((tis >= tis_cap) * m).sum()
    if keep is not None:
        stats["ratio_masked_sum"] = ((1.0 - keep) * mask.astype(jnp.float32)).sum()
    return loss, stats
