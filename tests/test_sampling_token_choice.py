"""Token choice against hand-computed distributions: chi-square on a tiny vocabulary, truncation
sets computed in numpy, and per-row PRNG streams that do not depend on their neighbours."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxprefix.sampling.token_choice import (SamplingSettings, choose_tokens, row_step_keys,
                                             truncate_logits)

# chi2.ppf(0.9999, df) for df = 1..9: a correct sampler fails 1 in 10^4 runs (fixed seeds: never).
CHI2_9999 = [15.14, 18.42, 21.11, 23.51, 25.74, 27.86, 29.88, 31.83, 33.72]
LOGITS = np.array([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, 0.3], np.float32)


def _draw(settings, num=20000, logits=LOGITS, seed=0):
    logits_bv = jnp.broadcast_to(jnp.asarray(logits), (num, logits.shape[0]))
    keys = row_step_keys(jax.random.key(seed), jnp.arange(num), jnp.int32(0))
    tokens, logprobs = jax.jit(choose_tokens)(logits_bv, keys, settings)
    return np.asarray(tokens), np.asarray(logprobs)


def _softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def _chi_square(tokens, probs):
    counts = np.bincount(tokens, minlength=probs.shape[0])
    support = probs > 0
    assert counts[~support].sum() == 0, f'sampled excluded tokens: {np.nonzero(counts[~support])}'
    expected = probs[support] * tokens.shape[0]
    stat = ((counts[support] - expected) ** 2 / expected).sum()
    return stat, CHI2_9999[support.sum() - 2]


@pytest.mark.parametrize('temperature', [1.0, 0.6, 1.7])
def test_frequencies_match_tempered_softmax(temperature):
    tokens, logprobs = _draw(SamplingSettings.make(temperature=temperature))
    probs = _softmax(LOGITS.astype(np.float64) / temperature)
    stat, limit = _chi_square(tokens, probs)
    assert stat < limit, (stat, limit)
    # Reported log-probs are of the tempered distribution the token was drawn from.
    np.testing.assert_allclose(logprobs, np.log(probs)[tokens], rtol=1e-5, atol=1e-5)


def test_inverse_cdf_across_blocks_and_excluded_tokens():
    # 600 tokens = 3 CDF blocks; mass only on 8 tokens at block edges, every other logit -inf.
    support = np.array([0, 3, 255, 256, 300, 511, 512, 599])
    logits = np.full(600, -np.inf, np.float32)
    logits[support] = LOGITS
    tokens, _ = _draw(SamplingSettings.make(temperature=1.0), logits=logits)
    probs = np.zeros(600)
    probs[support] = _softmax(LOGITS.astype(np.float64))
    stat, limit = _chi_square(tokens, probs)
    assert stat < limit, (stat, limit)


def test_chi_square_detects_a_wrong_temperature():
    # The check above can fail: samples at T=1 are far from the T=0.6 distribution.
    tokens, _ = _draw(SamplingSettings.make(temperature=1.0))
    stat, limit = _chi_square(tokens, _softmax(LOGITS.astype(np.float64) / 0.6))
    assert stat > 10 * limit


def test_top_k_frequencies_and_support():
    tokens, logprobs = _draw(SamplingSettings.make(temperature=1.0, top_k=3))
    keep = np.argsort(-LOGITS)[:3]
    probs = np.zeros_like(LOGITS, dtype=np.float64)
    probs[keep] = _softmax(LOGITS[keep].astype(np.float64))
    stat, limit = _chi_square(tokens, probs)
    assert stat < limit, (stat, limit)
    # Reported log-probs are of the untruncated distribution.
    np.testing.assert_allclose(logprobs, np.log(_softmax(LOGITS.astype(np.float64)))[tokens],
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('top_p,top_k', [(0.7, 0), (0.9, 0), (0.8, 4), (0.01, 0)])
def test_top_p_frequencies_and_support(top_p, top_k):
    tokens, _ = _draw(SamplingSettings.make(temperature=0.8, top_p=top_p, top_k=top_k))
    scaled = LOGITS.astype(np.float64) / 0.8
    order = np.argsort(-scaled)
    if top_k:
        order = order[:top_k]
    p = _softmax(scaled[order])
    # Keep the smallest prefix of the sorted tokens whose mass reaches top_p.
    num_kept = int(np.searchsorted(np.cumsum(p), top_p) + 1)
    keep = order[:num_kept]
    probs = np.zeros_like(scaled)
    probs[keep] = _softmax(scaled[keep])
    if num_kept == 1:
        assert np.all(tokens == keep[0])
        return
    stat, limit = _chi_square(tokens, probs)
    assert stat < limit, (stat, limit)


def test_truncate_logits_by_hand():
    logits = jnp.array([[0.0, 3.0, 1.0, 2.0, -1.0]])
    np.testing.assert_array_equal(np.isfinite(truncate_logits(logits, 2, None))[0],
                                  [False, True, False, True, False])
    # softmax = [.032 .644 .087 .237 .012]: mass .644 < .8, so .237 is needed too; .881 >= .8.
    np.testing.assert_array_equal(np.isfinite(truncate_logits(logits, 0, 0.8))[0],
                                  [False, True, False, True, False])
    np.testing.assert_array_equal(np.isfinite(truncate_logits(logits, 0, 0.6))[0],
                                  [False, True, False, False, False])
    assert truncate_logits(logits, 0, None) is logits


def test_greedy_is_argmax_with_logprob():
    logits = jax.random.normal(jax.random.key(1), (5, 11))
    tokens, logprobs = choose_tokens(logits, None, SamplingSettings.make(temperature=0.0))
    np.testing.assert_array_equal(tokens, np.argmax(logits, -1))
    np.testing.assert_allclose(logprobs, np.max(jax.nn.log_softmax(logits), -1), rtol=1e-6)


def test_row_keys_depend_only_on_seed_row_and_step():
    seed = jax.random.key(3)
    a = row_step_keys(seed, jnp.array([0, 5, 9]), jnp.int32(2))
    b = row_step_keys(seed, jnp.array([9, 7]), jnp.int32(2))
    c = row_step_keys(seed, jnp.array([9]), jnp.int32(3))
    data = jax.random.key_data
    np.testing.assert_array_equal(data(a[2]), data(b[0]))
    assert not np.array_equal(data(a[2]), data(c[0]))
    assert not np.array_equal(data(a[0]), data(a[1]))


def test_settings_reject_bad_values():
    with pytest.raises(ValueError, match='temperature'):
        SamplingSettings.make(temperature=-1.0)
    with pytest.raises(ValueError, match='top_p'):
        SamplingSettings.make(top_p=0.0)
    with pytest.raises(ValueError, match='top_k'):
        SamplingSettings.make(top_k=-2)
