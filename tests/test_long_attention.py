"""Memory-efficient attention of the no-cache path: blockwise (CPU/GPU) and splash (TPU) equal
models.attention.attend, forward and gradient, under every mask the decoder builds."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxprefix.models import Decoder, ModelConfig, attention, backend, blockwise_attention
from jaxprefix.models.config import FULL, SLIDING

TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}
B, T, H, HKV, DH = 4, 37, 6, 2, 8


def positions(lengths, width, left_pad=()):
    """[B, width] positions 0..len-1 of real tokens, -1 on padding (right, or left for rows in
    left_pad), as the learner's batches and the sampler's prompts lay them out."""
    pos = np.full((len(lengths), width), -1, np.int32)
    for i, n in enumerate(lengths):
        start = width - n if i in left_pad else 0
        pos[i, start:start + n] = np.arange(n)
    return jnp.asarray(pos)


def qkv(rng, dtype, b=B, t=T, h=H, hkv=HKV, dh=DH):
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape), dtype)
    return normal(b, t, h, dh), normal(b, t, hkv, dh), normal(b, t, hkv, dh)


def compare(fn_ref, fn_new, args, q_pos, dtype):
    """Max |difference| / max |reference| of the outputs at visible queries and of the gradients
    of a random projection of them, with respect to every argument."""
    visible = (q_pos >= 0)[:, :, None, None]
    ref, new = fn_ref(*args), fn_new(*args)
    assert new.dtype == ref.dtype and new.shape == ref.shape
    cotangent = jnp.asarray(np.random.default_rng(1).normal(size=ref.shape), jnp.float32)

    def loss(fn):
        return lambda *a: (jnp.where(visible, fn(*a).astype(jnp.float32), 0) * cotangent).sum()

    def error(a, b):
        a, b = a.astype(jnp.float32), b.astype(jnp.float32)
        return float(jnp.abs(a - b).max() / jnp.abs(a).max())
    grads_ref = jax.grad(loss(fn_ref), argnums=range(len(args)))(*args)
    grads_new = jax.grad(loss(fn_new), argnums=range(len(args)))(*args)
    errors = [error(jnp.where(visible, ref, 0), jnp.where(visible, new, 0))]
    errors += [error(a, b) for a, b in zip(grads_ref, grads_new)]
    assert max(errors) < TOLERANCE[dtype], errors


@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize('window,cap', [(None, None), (5, None), (None, 3.0), (9, 2.0)])
def test_blockwise_equals_attend_on_own_tokens(dtype, window, cap):
    """Causal, sliding-window and soft-capped self-attention with right and left padding, tiles
    smaller than the row so that several are skipped; a row with one token; T not a multiple."""
    rng = np.random.default_rng(0)
    q_pos = positions([37, 20, 1, 30], T, left_pad=(3,))
    kw = dict(scale=DH ** -0.5, window=None if window is None else jnp.int32(window),
              logit_cap=cap)
    ref = lambda q, k, v: attention.attend(q, q_pos, [(k, v, q_pos)], **kw)
    new = lambda q, k, v: blockwise_attention.attend(q, q_pos, [(k, v, q_pos)], block_q=16,
                                                     block_k=8, **kw)
    compare(ref, new, qkv(rng, dtype), q_pos, dtype)


@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16])
def test_blockwise_equals_attend_over_context_segments(dtype):
    """Suffix tokens over a read-only prompt segment shared by groups of rows (G=2 for B=4),
    one prompt half padding: the partial softmaxes merge by their log-sum-exps."""
    rng = np.random.default_rng(2)
    g, s = 2, 23
    ck, cv = (jnp.asarray(rng.normal(size=(g, s, HKV, DH)), dtype) for _ in range(2))
    c_pos = positions([23, 11], s)
    own = positions([37, 20, 5, 30], T)
    q_pos = jnp.where(own >= 0, own + 23, -1)
    kw = dict(scale=DH ** -0.5, window=jnp.int32(30), logit_cap=None)
    ref = lambda q, k, v, ck, cv: attention.attend(q, q_pos, [(ck, cv, c_pos), (k, v, q_pos)], **kw)
    new = lambda q, k, v, ck, cv: blockwise_attention.attend(
        q, q_pos, [(ck, cv, c_pos), (k, v, q_pos)], block_q=16, block_k=16, **kw)
    compare(ref, new, (*qkv(rng, dtype), ck, cv), q_pos, dtype)


def test_blockwise_keeps_no_scores_for_the_backward():
    """The VJP saves output and log-sum-exp, not [T, S] probabilities: the residuals of a long
    row are O(T), far below one score matrix."""
    t = 2048
    q, k, v = qkv(np.random.default_rng(0), jnp.float32, b=1, t=t)
    pos = positions([t], t)
    f = lambda q, k, v: blockwise_attention.attend(q, pos, [(k, v, pos)], scale=0.3)
    _, residuals = jax.vjp(f, q, k, v)
    saved = sum(x.nbytes for x in jax.tree.leaves(residuals))
    assert saved < 0.1 * H * t * t * 4, saved


@pytest.mark.parametrize('window', [None, 64])
def test_splash_kernel_equals_attend(window):
    """The TPU kernel (interpret mode on CPU), index-causal within segment ids, sees what
    position masks see on the learner's right-padded rows and the sampler's left-padded prompts,
    forward and gradient; sliding window switched on by the traced per-layer window."""
    t, h, hkv, dh = 256, 4, 2, 128
    rng = np.random.default_rng(3)
    q_pos = positions([256, 200, 130, 180], t, left_pad=(3,))
    q, k, v = qkv(rng, jnp.float32, t=t, h=h, hkv=hkv, dh=dh)
    kw = dict(scale=dh ** -0.5, logit_cap=None)
    w = None if window is None else jnp.int32(window)
    ref = lambda q, k, v: attention.attend(q, q_pos, [(k, v, q_pos)], window=w, **kw)
    new = lambda q, k, v: backend.splash_attend(q, k, v, q_pos, window=w, interpret=True,
                                                      sliding_window=window, **kw)
    compare(ref, new, (q, k, v), q_pos, jnp.float32)


def gemma_like():
    return ModelConfig(model_type='gemma3_text', vocab_size=64, hidden_size=256,
                       intermediate_size=256, num_layers=2, num_heads=2, num_kv_heads=1,
                       head_dim=128, sliding_window=128, layer_types=(SLIDING, FULL),
                       query_pre_attn_scalar=128, qk_norm=True, norm_plus_one=True,
                       sandwich_norms=True, embed_scale=True, attn_logit_softcapping=50.0,
                       dtype='bfloat16', param_dtype='float32', remat=True)


def test_tpu_kernel_path_compiles_for_a_tpu_topology():
    """The decoder's no-cache path, forward and gradient, lowered for a v5e-4 mesh on this CPU:
    the program holds the splash kernels (forward, dq, dkv) and compiles."""
    from jaxprefix.models.sharding import make_mesh
    from jaxprefix.tpu import programs, topology

    mesh = make_mesh(data=2, fsdp=2, devices=topology.devices(topology.slice_type('v5e-4')))
    graphdef, params = nnx.split(programs.abstract_model(gemma_like(), mesh))
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(('data', 'fsdp')))
    tokens = jax.ShapeDtypeStruct((4, 512), jnp.int32, sharding=rows)

    def loss(params, tokens):
        m = nnx.merge(graphdef, params)
        return m(tokens, mask=tokens > 0).astype(jnp.float32).mean()

    with jax.set_mesh(mesh):
        compiled = jax.jit(jax.grad(loss)).lower(params, tokens).compile()
    text = compiled.as_text()
    for kernel in ('splash_mha_fwd', 'splash_mha_dq', 'splash_mha_dkv'):
        assert kernel in text


def test_decoder_no_cache_path_matches_cached_decoding():
    """Model level: logits of a padded batch through the blockwise path equal those of feeding
    the same tokens one at a time through the cache (dense attention), f32."""
    c = ModelConfig(model_type='llama', vocab_size=50, hidden_size=32, intermediate_size=64,
                    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8)
    model = Decoder(c, rngs=nnx.Rngs(0))
    tokens = jnp.asarray(np.random.default_rng(0).integers(1, 50, (2, 12)), jnp.int32)
    mask = jnp.asarray(np.arange(12)[None] < np.array([[12], [7]]))
    full = model(tokens, mask=mask)
    cache = attention.KVCache.empty(c, 2, 12)
    pos = jnp.where(mask, jnp.arange(12)[None], -1)
    step_logits = []
    for i in range(12):
        logits, cache = model.extend(tokens[:, i:i + 1], pos[:, i:i + 1], cache=cache)
        step_logits.append(logits[:, 0])
    stepped = jnp.stack(step_logits, axis=1)
    np.testing.assert_allclose(np.where(mask[..., None], full, 0),
                               np.where(mask[..., None], stepped, 0), atol=2e-5)
