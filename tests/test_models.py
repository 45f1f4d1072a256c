"""Decoder against transformers (CPU torch, f32), padding, the cached path and token scoring."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import tiny_checkpoints as tc
from jaxprefix.checkpoints.hf import from_pretrained
from jaxprefix.models import Decoder, KVCache, ModelConfig, layers, token_logprobs

TOL = 1e-4

# Jitted entry points: one compile per shape instead of op-by-op dispatch (much faster on CPU).
forward = nnx.jit(lambda model, tokens, mask=None: model(tokens, mask=mask))
extend = nnx.jit(lambda model, tokens, positions, context=(), cache=None: model.extend(
    tokens, positions, context=context, cache=cache))
# The CPU decode's form: each layer's weights apart, projections output-major.
extend_per_layer = nnx.jit(lambda model, tokens, positions, context=(), cache=None: model.extend(
    tokens, positions, context=context, cache=cache, layer_weights=model.layer_weights()))


@pytest.fixture(scope='module')
def checkpoints(tmp_path_factory):
    """family -> (Decoder loaded from the HF directory, the transformers model)."""
    cache = {}

    def get(family):
        if family not in cache:
            path, hf = tc.save_checkpoint(family, tmp_path_factory.mktemp(family))
            cache[family] = (from_pretrained(path)[0], hf)
        return cache[family]
    return get


@pytest.mark.parametrize('family', list(tc.FAMILIES))
def test_logits_match_transformers(checkpoints, family):
    model, hf = checkpoints(family)
    tokens = tc.random_tokens(2, 11, seed=1)  # longer than gemma3's sliding window (4)
    np.testing.assert_allclose(np.asarray(forward(model, tokens)), tc.hf_logits(hf, tokens),
                               atol=TOL, rtol=0)


def test_left_padded_rows_equal_rows_alone(checkpoints):
    model, hf = checkpoints('gemma3')  # sliding window by position, not by index
    lengths = [9, 5, 7]
    t = max(lengths)
    rows = [tc.random_tokens(1, n, seed=10 + i)[0] for i, n in enumerate(lengths)]
    tokens = np.zeros((len(rows), t), np.int32)
    mask = np.zeros((len(rows), t), bool)
    for i, r in enumerate(rows):
        tokens[i, t - len(r):], mask[i, t - len(r):] = r, True
    batched = np.asarray(forward(model, tokens, mask))
    for i, r in enumerate(rows):
        alone = np.asarray(forward(model, r[None]))[0]
        np.testing.assert_allclose(batched[i, t - len(r):], alone, atol=TOL, rtol=0)
    # And transformers agrees on the padded batch.
    ref = tc.hf_logits(hf, tokens, mask)
    np.testing.assert_allclose(batched[mask], ref[mask], atol=TOL, rtol=0)


def _full_logits(model, context, continuation):
    """Logits of the unpadded sequence context + continuation, computed in one forward."""
    seq = np.concatenate([context, continuation])[None]
    return np.asarray(forward(model, seq))[0]


def _head_major(decode):
    """`decode` over KV laid out per layer, head-major (KVSegment.head_major: the CPU decode's
    layout)."""
    def run(model, tokens, positions, context=(), cache=None):
        logits, cache = decode(model, tokens, positions,
                               tuple(s.in_head_major() for s in context), cache.in_head_major())
        assert cache.head_major
        return logits, cache
    return run


@pytest.mark.parametrize('decode', [extend, extend_per_layer, _head_major(extend_per_layer)],
                         ids=['stacked', 'per_layer', 'per_layer_head_major'])
def test_extend_shared_context_then_cache_equals_full_forward(checkpoints, decode):
    model, _ = checkpoints('gemma3')  # sliding window across segments and cache
    groups, r, steps = 2, 3, 5
    # Two contexts of different lengths, left-padded into one segment (padding has position -1).
    ctx_lengths = [6, 4]
    width = max(ctx_lengths)
    contexts = [tc.random_tokens(1, n, seed=20 + g)[0] for g, n in enumerate(ctx_lengths)]
    ctx_tokens = np.zeros((groups, width), np.int32)
    ctx_pos = np.full((groups, width), -1, np.int32)
    for g, c in enumerate(contexts):
        ctx_tokens[g, width - len(c):] = c
        ctx_pos[g, width - len(c):] = np.arange(len(c))
    prefill_logits, segment = extend(model, ctx_tokens, ctx_pos)
    for g, c in enumerate(contexts):
        np.testing.assert_allclose(np.asarray(prefill_logits)[g, width - len(c):],
                                   _full_logits(model, c, c[:0]), atol=TOL, rtol=0)

    b = groups * r
    continuation = tc.random_tokens(b, steps + 1, seed=30)
    cache = KVCache.empty(model.config, b, steps + 1)
    base = np.repeat(np.asarray(ctx_lengths), r)[:, None]
    outputs = []
    # First write two tokens at once, then one at a time.
    for start, stop in [(0, 2)] + [(s, s + 1) for s in range(2, steps + 1)]:
        pos = base + np.arange(start, stop)[None]
        logits, cache = decode(model, continuation[:, start:stop], pos, (segment,), cache)
        outputs.append(np.asarray(logits))
    assert int(cache.index) == steps + 1
    got = np.concatenate(outputs, axis=1)
    for row in range(b):
        want = _full_logits(model, contexts[row // r], continuation[row])[ctx_lengths[row // r]:]
        np.testing.assert_allclose(got[row], want, atol=TOL, rtol=0)


def test_extend_suffix_segment_on_shared_prompt(checkpoints):
    """A prompt prefilled once (G=1), then per-row suffixes attending to it and causally."""
    model, _ = checkpoints('qwen2')
    prompt = tc.random_tokens(1, 5, seed=40)
    _, prompt_kv = extend(model, prompt, np.arange(5)[None])
    suffix = tc.random_tokens(3, 4, seed=41)
    logits, suffix_kv = extend(model, suffix, np.broadcast_to(5 + np.arange(4), (3, 4)),
                                 (prompt_kv,))
    assert suffix_kv.k.shape == (2, 3, 4, 2, 24) and suffix_kv.pos.shape == (3, 4)
    for row in range(3):
        want = _full_logits(model, prompt[0], suffix[row])[5:]
        np.testing.assert_allclose(np.asarray(logits)[row], want, atol=TOL, rtol=0)


def _reference_logprobs(model, tokens, mask, m_forward=lambda m, t, k: m(t, mask=k)):
    logits = m_forward(model, tokens, mask)
    logp = jax.nn.log_softmax(logits, axis=-1)
    gathered = jnp.take_along_axis(logp[:, :-1], tokens[:, 1:, None], axis=-1)[..., 0]
    entropy = -jnp.sum(jnp.exp(logp) * logp, axis=-1)[:, :-1]
    valid = mask[:, 1:] & mask[:, :-1]
    zero = jnp.zeros((tokens.shape[0], 1))
    return (jnp.concatenate([zero, jnp.where(valid, gathered, 0)], 1),
            jnp.concatenate([zero, jnp.where(valid, entropy, 0)], 1))


def test_token_logprobs_equal_full_log_softmax(checkpoints):
    model, _ = checkpoints('gemma3')  # final logit softcapping applies in both paths
    tokens = jnp.asarray(tc.random_tokens(2, 12, seed=50))
    mask = jnp.ones(tokens.shape, bool).at[1, :3].set(False)
    logp, entropy = nnx.jit(token_logprobs, static_argnames='chunk_size')(
        model, tokens, mask, chunk_size=4)  # 11 targets: ragged chunks
    want_logp, want_entropy = _reference_logprobs(model, tokens, mask)
    np.testing.assert_allclose(logp, want_logp, atol=TOL, rtol=0)
    np.testing.assert_allclose(entropy, want_entropy, atol=TOL, rtol=0)
    assert float(jnp.abs(logp[1, :4]).max()) == 0.0 and float(logp.max()) <= 0.0


def test_token_logprobs_gradient_matches_full(checkpoints):
    model, _ = checkpoints('llama')
    tokens = jnp.asarray(tc.random_tokens(2, 8, seed=51))
    mask = jnp.ones(tokens.shape, bool)

    def chunked(m):
        logp, entropy = token_logprobs(m, tokens, mask, chunk_size=3)
        return logp.sum() + 0.1 * entropy.sum()

    def full(m):
        logp, entropy = _reference_logprobs(m, tokens, mask)
        return logp.sum() + 0.1 * entropy.sum()

    g1 = nnx.jit(nnx.grad(chunked))(model)
    g2 = nnx.jit(nnx.grad(full))(model)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4)
    assert float(jnp.abs(g1['embed'][...]).max()) > 0


def test_token_logprobs_at_wanted_columns_alone(checkpoints):
    """`wanted` (the learner's loss tokens): those columns' log-probs, entropies and gradient
    are the full computation's, every other column 0; chunks past the last wanted column are
    skipped, ragged ones included."""
    model, _ = checkpoints('llama')
    tokens = jnp.asarray(tc.random_tokens(3, 10, seed=52))
    mask = jnp.ones(tokens.shape, bool).at[2, 7:].set(False)
    wanted = jnp.zeros(tokens.shape, bool).at[0, 4:9].set(True).at[2, 5:9].set(True)
    wanted = wanted.at[1, 0].set(True)  # column 0 has no predecessor: stays 0
    keep = wanted & mask & jnp.roll(mask, 1, axis=1)
    keep = keep.at[:, 0].set(False)

    def loss(m, wanted):
        logp, entropy = token_logprobs(m, tokens, mask, chunk_size=3, wanted=wanted)
        return (jnp.where(keep, logp, 0).sum() + 0.1 * jnp.where(keep, entropy, 0).sum(),
                (logp, entropy))

    (_, (logp, entropy)), g1 = nnx.jit(nnx.value_and_grad(loss, has_aux=True))(model, wanted)
    (_, (all_logp, all_entropy)), g2 = nnx.jit(nnx.value_and_grad(loss, has_aux=True))(model,
                                                                                       None)
    np.testing.assert_allclose(logp, jnp.where(keep, all_logp, 0), atol=TOL, rtol=0)
    np.testing.assert_allclose(entropy, jnp.where(keep, all_entropy, 0), atol=TOL, rtol=0)
    assert float(jnp.abs(jnp.where(keep, 0, logp)).max()) == 0.0
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4)


@pytest.mark.slow
def test_remat_gives_same_gradient(checkpoints):
    model, _ = checkpoints('qwen3')
    remat = Decoder(model.config.replace(remat=True), nnx.Rngs(0))
    nnx.update(remat, nnx.state(model))
    tokens = jnp.asarray(tc.random_tokens(2, 6, seed=52))
    loss = lambda m: token_logprobs(m, tokens, jnp.ones(tokens.shape, bool))[0].sum()
    grad = nnx.jit(nnx.grad(loss))
    for a, b in zip(jax.tree.leaves(grad(model)), jax.tree.leaves(grad(remat))):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize('family', list(tc.FAMILIES))
def test_config_counts_and_hf_round_trip(family):
    hf = tc.hf_model(family)
    config = ModelConfig.from_hf(hf.config.to_dict())
    assert config.num_params() == sum(p.numel() for p in hf.parameters())
    assert ModelConfig.from_hf(config.to_hf()) == config
    assert hash(config) == hash(ModelConfig.from_hf(config.to_hf()))


def test_flops_per_token_counts_matmuls():
    config = ModelConfig.from_hf(tc.hf_config('llama').to_dict())
    d, f, h, kv, dh, v = 64, 96, 4, 2, 24, tc.VOCAB
    per_layer = d * h * dh * 2 + d * kv * dh * 2 + 3 * d * f + 2 * d  # + two norms
    assert config.flops_per_token() == 2 * (2 * per_layer + d + v * d)
    assert config.flops_per_token(10) - config.flops_per_token() == 4 * 2 * 10 * h * dh


def test_unsupported_model_type_is_named():
    with pytest.raises(ValueError, match=r"'mistral'.*supported: llama, qwen2, qwen3, gemma3_text"):
        ModelConfig.from_hf({'model_type': 'mistral', 'hidden_size': 8})


@pytest.mark.parametrize('equation,inputs', [('btd,dhk->bthk', 1), ('bthk,hkd->btd', 2),
                                             ('btd,df->btf', 1), ('btf,fd->btd', 1)])
def test_einsum_output_major_equals_einsum(equation, inputs):
    """The CPU decode's weight-first matmul gives x W for a weight laid out output-major."""
    x_axes, w_axes = equation.split('->')[0].split(',')
    sizes = dict(b=3, t=2, d=8, h=4, k=5, f=6)
    keys = jax.random.split(jax.random.key(0), 2)
    x = jax.random.normal(keys[0], [sizes[a] for a in x_axes])
    w = jax.random.normal(keys[1], [sizes[a] for a in w_axes])
    got = layers.einsum_output_major(equation, x, layers.output_major(w, inputs))
    np.testing.assert_allclose(got, jnp.einsum(equation, x, w), atol=1e-5, rtol=1e-5)
