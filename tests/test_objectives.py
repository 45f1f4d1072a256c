"""RL objectives against hand-computed numbers."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxprefix.rl import objectives as obj

# Two sequences of 3 tokens. Row 1's first token is prompt (mask 0) and has a wild ratio (5.0)
# that must not leak into the loss or the stats.
RATIOS = np.array([[1.5, 0.9, 1.0], [5.0, 0.5, 1.2]], np.float32)
OLD = np.zeros((2, 3), np.float32)
LOGP = np.log(RATIOS)
MASK = np.array([[1, 1, 1], [0, 1, 1]], np.float32)
ADV = np.array([1.0, -2.0], np.float32)
# Per-token loss by hand with eps_low=0.2, eps_high=0.28:
# row 0 (A=1): -min(r, clip(r, .8, 1.28)) = -1.28, -0.9, -1.0
# row 1 (A=-2): max(2r, 2 clip(r)) at r=.5 -> 1.6, at r=1.2 -> 2.4
PER_TOKEN_SUM = -1.28 - 0.9 - 1.0 + 1.6 + 2.4


def loss(aggregation, **kw):
    return obj.policy_loss(jnp.asarray(LOGP), OLD, ADV, MASK, eps_low=0.2, eps_high=0.28,
                           aggregation=aggregation, **kw)


def test_grpo_advantages():
    adv = obj.group_advantages(np.array([[1.0, 0, 0, 1], [1, 1, 1, 1]]), "grpo")
    # mean .5, unbiased std sqrt(1/3): +-0.5 / 0.57735 = +-0.866025; constant group -> 0.
    np.testing.assert_allclose(adv, [[0.866025, -0.866025, -0.866025, 0.866025], [0, 0, 0, 0]],
                               atol=1e-5)


def test_dr_grpo_and_rloo_advantages():
    np.testing.assert_allclose(obj.group_advantages(np.array([[1.0, 0, 0, 1]]), "dr_grpo"),
                               [[0.5, -0.5, -0.5, 0.5]])
    # r_i minus the mean of the other two: 1 - 0, 0 - .5, 0 - .5
    np.testing.assert_allclose(obj.group_advantages(np.array([[1.0, 0, 0]]), "rloo"),
                               [[1.0, -0.5, -0.5]], atol=1e-6)


def test_pass_at_k_advantages_by_hand():
    rewards = np.array([[1.0, 0, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]])
    adv = obj.group_advantages(rewards, "pass_at_k", k=2)
    # [1,0,0,0], k=2: R = 1 - C(3,2)/C(4,2) = 1/2, sigma = 1/2. Correct: (1 - 1/2)/(1/2) = 1.
    # Wrong: a wrong sample sits in an all-wrong pair with P = C(2,1)/C(3,1) = 2/3:
    # (1 - 1/2 - 2/3)/(1/2) = -1/3.
    np.testing.assert_allclose(adv[0], [1.0, -1 / 3, -1 / 3, -1 / 3], atol=1e-5)
    # [1,1,0,0]: R = 1 - C(2,2)/C(4,2) = 5/6, sigma = sqrt(5)/6. Correct: (1/6)/sigma;
    # wrong: P = C(1,1)/C(3,1) = 1/3, (1/6 - 1/3)/sigma.
    sigma = np.sqrt(5) / 6
    np.testing.assert_allclose(adv[1], [1 / 6 / sigma] * 2 + [-1 / 6 / sigma] * 2, atol=1e-5)
    np.testing.assert_allclose(adv[2:], 0.0)  # no correct (or no wrong) sample: no signal
    # k = 1 is GRPO with the population std: [1,0,0,0] -> mean 1/4, std sqrt(3)/4.
    np.testing.assert_allclose(obj.group_advantages(rewards[:1], "pass_at_k", k=1)[0],
                               np.array([0.75, -0.25, -0.25, -0.25]) / (np.sqrt(3) / 4), atol=1e-5)
    with pytest.raises(ValueError, match="k must be in 1..n=4"):
        obj.group_advantages(rewards, "pass_at_k", k=5)


def test_entropy_bonus_by_hand():
    entropy = np.array([[0.5, 1.0, 2.0], [9.0, 1.5, 0.5]], np.float32)  # row 1 col 0 masked
    # token_mean: 0.1 * (0.5 + 1 + 2 + 1.5 + 0.5) / 5; seq_mean_token_mean: 0.1 * (3.5/3 + 2/2)/2
    np.testing.assert_allclose(obj.entropy_bonus(entropy, MASK, 0.1), 0.1 * 5.5 / 5, atol=1e-6)
    np.testing.assert_allclose(obj.entropy_bonus(entropy, MASK, 0.1, "seq_mean_token_mean"),
                               0.1 * (3.5 / 3 + 1.0) / 2, atol=1e-6)


def test_advantages_reject_bad_input():
    with pytest.raises(ValueError, match="mode"):
        obj.group_advantages(np.ones((2, 3)), "ppo")
    with pytest.raises(ValueError, match="n >= 2"):
        obj.group_advantages(np.ones((2, 1)))


def test_token_mean_loss_and_stats():
    value, stats = loss("token_mean")
    np.testing.assert_allclose(value, PER_TOKEN_SUM / 5, atol=1e-5)
    s = obj.finish_ratio_stats(stats)
    np.testing.assert_allclose(s["clip_frac/low"], 1 / 5)   # r=.5 with A<0
    np.testing.assert_allclose(s["clip_frac/high"], 1 / 5)  # r=1.5 with A>0
    np.testing.assert_allclose(s["ratio/mean"], (1.5 + 0.9 + 1.0 + 0.5 + 1.2) / 5, atol=1e-6)
    np.testing.assert_allclose(s["ratio/min"], 0.5, atol=1e-6)
    np.testing.assert_allclose(s["ratio/max"], 1.5, atol=1e-6)  # the masked 5.0 is ignored
    np.testing.assert_allclose(s["ratio/max_abs_dev"], 0.5, atol=1e-6)


def test_seq_mean_token_mean_loss():
    value, _ = loss("seq_mean_token_mean")
    np.testing.assert_allclose(value, ((-1.28 - 0.9 - 1.0) / 3 + (1.6 + 2.4) / 2) / 2, atol=1e-5)


def test_seq_mean_token_sum_norm_loss():
    np.testing.assert_allclose(loss("seq_mean_token_sum_norm", max_len=4)[0],
                               PER_TOKEN_SUM / (2 * 4), atol=1e-5)
    np.testing.assert_allclose(loss("seq_mean_token_sum_norm")[0], PER_TOKEN_SUM / (2 * 3),
                               atol=1e-5)


@pytest.mark.parametrize("mode", obj.AGGREGATIONS)
def test_micro_batches_add_up_to_the_batch(mode):
    full, _ = loss(mode)
    totals = dict(total_tokens=MASK.sum(), total_sequences=2.0)
    parts = [obj.policy_loss(jnp.asarray(LOGP[i:i + 1]), OLD[i:i + 1], ADV[i:i + 1],
                             MASK[i:i + 1], eps_low=0.2, eps_high=0.28, aggregation=mode,
                             **totals)[0] for i in range(2)]
    np.testing.assert_allclose(sum(parts), full, atol=1e-6)


def test_gspo_sequence_ratio_value_and_gradient():
    value, _ = loss("seq_mean_token_mean", ratio="sequence")
    s0 = (1.5 * 0.9 * 1.0) ** (1 / 3)   # 1.10521, A=+1, inside the clip range
    s1 = (0.5 * 1.2) ** 0.5             # 0.774597 < 0.8, A=-2 -> clipped: 2 * 0.8
    np.testing.assert_allclose(value, (-s0 + 1.6) / 2, atol=1e-5)

    def gspo_reference(logp):  # the sequence-level objective, written directly
        s = jnp.exp(obj.sequence_log_ratio(logp, OLD, MASK))
        per_seq = -jnp.minimum(s * ADV, jnp.clip(s, 0.8, 1.28) * ADV)
        return per_seq.mean()

    grad = jax.grad(lambda lp: loss_at(lp, "seq_mean_token_mean", ratio="sequence"))(LOGP)
    np.testing.assert_allclose(grad, jax.grad(gspo_reference)(jnp.asarray(LOGP)), atol=1e-6)
    assert s1 < 0.8


def loss_at(logp, aggregation, **kw):
    return obj.policy_loss(logp, OLD, ADV, MASK, eps_low=0.2, eps_high=0.28,
                           aggregation=aggregation, **kw)[0]


def test_token_mean_gradient_matches_finite_differences():
    # Ratios away from the clip edges so the loss is smooth around the point.
    logp = np.log(np.array([[1.1, 0.9, 1.0], [3.0, 0.95, 1.05]], np.float32))
    grad = np.asarray(jax.grad(lambda lp: loss_at(lp, "token_mean"))(jnp.asarray(logp)))
    h = 1e-3
    numeric = np.zeros_like(logp)
    for idx in np.ndindex(*logp.shape):
        up, down = logp.copy(), logp.copy()
        up[idx] += h
        down[idx] -= h
        numeric[idx] = (loss_at(up, "token_mean") - loss_at(down, "token_mean")) / (2 * h)
    np.testing.assert_allclose(grad, numeric, atol=2e-3)
    assert grad[1, 0] == 0.0  # a prompt token gets no gradient
    # d/dlogp of -r*A/5 at r: row 0 A=1 -> -r/5
    np.testing.assert_allclose(grad[0], -np.array([1.1, 0.9, 1.0]) / 5, atol=1e-6)


def test_kl_estimators():
    logp = np.log(np.array([[0.5, 1.0]], np.float32))
    ref = np.zeros((1, 2), np.float32)
    np.testing.assert_allclose(obj.kl_penalty(logp, ref, "k1"), [[np.log(0.5), 0.0]], atol=1e-6)
    # d = log 2: 2 - log 2 - 1
    np.testing.assert_allclose(obj.kl_penalty(logp, ref, "k3"), [[1 - np.log(2), 0.0]], atol=1e-6)
    with pytest.raises(ValueError, match="kind"):
        obj.kl_penalty(logp, ref, "k2")


def test_kl_term_enters_the_loss():
    ref = LOGP + 0.1  # k3 per token: exp(.1) - .1 - 1
    value, stats = loss("token_mean", ref_logp=ref, kl_coef=0.5, kl_kind="k3")
    k3 = np.exp(0.1) - 0.1 - 1
    np.testing.assert_allclose(value, PER_TOKEN_SUM / 5 + 0.5 * k3, atol=1e-5)
    np.testing.assert_allclose(stats["kl_sum"], 5 * k3, atol=1e-5)


def test_truncated_completions_carry_no_loss():
    mask = obj.mask_truncated(jnp.asarray(MASK), np.array([True, False]))
    np.testing.assert_array_equal(mask, [[1, 1, 1], [0, 0, 0]])
    np.testing.assert_allclose(obj.masked_mean(jnp.asarray(RATIOS), mask), 3.4 / 3, atol=1e-6)


# TIS: pi_old / pi_sampler per token (old = 0, so sampler = -log w); capped at 1.5 -> 1.5, .5, 1
# on row 0; row 1's masked 3.0 must not count, then 1.2 and 0.8.
RAW_TIS = np.array([[2.0, 0.5, 1.0], [3.0, 1.2, 0.8]], np.float32)
SAMPLER = OLD - np.log(RAW_TIS)


def test_truncated_importance_sampling_loss_by_hand():
    value, stats = loss("token_mean", sampler_logp=SAMPLER, tis_cap=1.5)
    # The per-token losses above times the capped weights:
    # row 0: -1.28 * 1.5, -0.9 * 0.5, -1.0 * 1; row 1: 1.6 * 1.2, 2.4 * 0.8.
    by_hand = (-1.28 * 1.5 - 0.9 * 0.5 - 1.0 + 1.6 * 1.2 + 2.4 * 0.8) / 5
    np.testing.assert_allclose(value, by_hand, atol=1e-5)
    np.testing.assert_allclose(stats["tis_weight_sum"], 1.5 + 0.5 + 1.0 + 1.2 + 0.8, atol=1e-5)
    np.testing.assert_allclose(stats["tis_capped_sum"], 1.0)  # row 0's 2.0; the masked 3.0 not
    # Detached weights: each token's gradient is its weight times the uncorrected one.
    weights = np.minimum(RAW_TIS, 1.5)
    plain = jax.grad(lambda lp: loss_at(lp, "token_mean"))(jnp.asarray(LOGP))
    tis = jax.grad(lambda lp: loss_at(lp, "token_mean", sampler_logp=SAMPLER, tis_cap=1.5))(
        jnp.asarray(LOGP))
    np.testing.assert_allclose(tis, weights * np.asarray(plain), atol=1e-6)


def test_tis_leaves_the_kl_term_alone_and_is_off_at_cap_zero():
    ref = LOGP + 0.1
    value, _ = loss("token_mean", sampler_logp=SAMPLER, tis_cap=1.5, ref_logp=ref, kl_coef=0.5)
    tis_only, _ = loss("token_mean", sampler_logp=SAMPLER, tis_cap=1.5)
    np.testing.assert_allclose(value, tis_only + 0.5 * (np.exp(0.1) - 0.1 - 1), atol=1e-5)
    off, stats = loss("token_mean", sampler_logp=SAMPLER, tis_cap=0.0)
    np.testing.assert_allclose(off, PER_TOKEN_SUM / 5, atol=1e-5)  # today's loss, exactly
    assert "tis_weight_sum" not in stats
    with pytest.raises(ValueError, match="sampler_logp"):
        loss("token_mean", tis_cap=1.5)


# IcePop at c = 1.5 on the same pi_old / pi_sampler: row 0's 2.0 and 0.5 leave [2/3, 1.5] (row
# 1's 3.0 too, but it is prompt and must not count); 1.0, 1.2 and 0.8 stay.
KEEP = np.array([[0, 0, 1], [0, 1, 1]], np.float32)


def test_ratio_mask_drops_tokens_outside_the_band():
    value, stats = loss("token_mean", sampler_logp=SAMPLER, ratio_mask=1.5)
    # The kept tokens' losses (-1.0; 1.6, 2.4) over all 5 loss tokens: masked ones stay in the
    # normaliser.
    np.testing.assert_allclose(value, (-1.0 + 1.6 + 2.4) / 5, atol=1e-5)
    np.testing.assert_allclose(stats["ratio_masked_sum"], 2.0)
    logp = jnp.asarray(LOGP)
    plain = np.asarray(jax.grad(lambda lp: loss_at(lp, "token_mean"))(logp))
    masked = jax.grad(lambda lp: loss_at(lp, "token_mean", sampler_logp=SAMPLER,
                                         ratio_mask=1.5))(logp)
    assert plain[0, 1] != 0 and plain[0, 2] != 0  # a masked and a kept token with a gradient
    np.testing.assert_allclose(masked, KEEP * plain, atol=1e-6)


def test_ratio_mask_then_tis_on_the_rest():
    value, stats = loss("token_mean", sampler_logp=SAMPLER, ratio_mask=1.5, tis_cap=1.5)
    np.testing.assert_allclose(value, (-1.0 * 1.0 + 1.6 * 1.2 + 2.4 * 0.8) / 5, atol=1e-5)
    np.testing.assert_allclose(stats["ratio_masked_sum"], 2.0)
    np.testing.assert_allclose(stats["tis_capped_sum"], 1.0)
    logp = jnp.asarray(LOGP)
    plain = np.asarray(jax.grad(lambda lp: loss_at(lp, "token_mean"))(logp))
    both = jax.grad(lambda lp: loss_at(lp, "token_mean", sampler_logp=SAMPLER, ratio_mask=1.5,
                                       tis_cap=1.5))(logp)
    np.testing.assert_allclose(both, KEEP * np.minimum(RAW_TIS, 1.5) * plain, atol=1e-6)
    off, stats = loss("token_mean", sampler_logp=SAMPLER, ratio_mask=0.0)
    np.testing.assert_allclose(off, PER_TOKEN_SUM / 5, atol=1e-5)
    assert "ratio_masked_sum" not in stats
    with pytest.raises(ValueError, match="ratio_mask > 0 needs sampler_logp"):
        loss("token_mean", ratio_mask=1.5)


def test_logprob_mismatch_over_loss_tokens():
    learner = SAMPLER + np.array([[0.1, -0.3, 0.0], [9.0, 0.2, -0.05]], np.float32)
    mean, largest = obj.logprob_mismatch(SAMPLER, learner, MASK)
    np.testing.assert_allclose(mean, (0.1 + 0.3 + 0.0 + 0.2 + 0.05) / 5, atol=1e-6)
    np.testing.assert_allclose(largest, 0.3, atol=1e-6)  # the masked 9.0 is ignored
