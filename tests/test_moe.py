"""Qwen3-MoE (and Qwen2-MoE's shared expert) against transformers (CPU torch, f32): logits over
routing variants, greedy decode, export; the sampler's two decodes, a GRPO update and sharding on
a tiny MoE (its routing replay: test_routing_replay.py); the shipped 30B-A3B config."""
import contextlib
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

import tiny_checkpoints as tc
from jaxprefix.checkpoints.hf import from_pretrained, save_pretrained
from jaxprefix.models import Decoder, ModelConfig, moe, published, token_logprobs
from jaxprefix.rl import objectives
from jaxprefix.rl.train_config import TrainConfig
from jaxprefix.rl.train_step import Learner
from jaxprefix.sampling import SharedContext, budget, generate

TOL = 1e-4
forward = nnx.jit(lambda model, tokens, mask=None: model(tokens, mask=mask))

# name -> overrides of tiny_checkpoints' qwen3_moe (4 experts, top-2, renormalised)
VARIANTS = {
    'normalised_top2_of_4': dict(),
    'unnormalised_top3_of_8': dict(num_experts=8, num_experts_per_tok=3, norm_topk_prob=False),
    'mlp_only_layer': dict(num_hidden_layers=3, mlp_only_layers=[1]),
    'sparse_step_2': dict(num_hidden_layers=4, decoder_sparse_step=2),  # dense, sparse, ...
}


@pytest.fixture(scope='module')
def checkpoints(tmp_path_factory):
    """variant -> (checkpoint path, our Decoder loaded from it, the transformers model)."""
    cache = {}

    def get(variant):
        if variant not in cache:
            # Small shards: every checkpoint goes through the index file.
            path, hf = tc.save_checkpoint('qwen3_moe', tmp_path_factory.mktemp(variant),
                                          max_shard_size='40KB', **VARIANTS[variant])
            assert (path / 'model.safetensors.index.json').is_file()
            cache[variant] = (path, from_pretrained(path, dtype=jnp.float32)[0], hf)
        return cache[variant]
    return get


@pytest.mark.parametrize('variant', list(VARIANTS))
def test_logits_equal_transformers(checkpoints, variant):
    _, model, hf = checkpoints(variant)
    tokens = tc.random_tokens(2, 11, seed=1)
    mask = np.ones(tokens.shape, bool)
    mask[1, :3] = False  # left padding in one row
    ours = np.asarray(forward(model, tokens, mask))
    np.testing.assert_allclose(ours[mask], tc.hf_logits(hf, tokens, mask)[mask], atol=TOL, rtol=0)


def test_dense_layers_among_sparse_ones_keep_their_own_stacks(checkpoints):
    _, model, _ = checkpoints('sparse_step_2')
    assert model.config.sparse_layers == (False, True, False, True)
    assert model.gate.shape == (2, 64, 96) and model.expert_up.shape == (2, 4, 64, 40)
    assert model.q.shape[0] == 4
    # Each layer's own weights, as the CPU decode hoists them, are of that layer's kind.
    kinds = ['router' in w for w in model.layer_weights()]
    assert kinds == [False, True, False, True]


def test_routing_renormalises_top_k_and_dispatch_is_dropless():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(32, 8)), jnp.float32)
    router = jnp.asarray(rng.normal(size=(8, 4)), jnp.float32)
    probs = moe.router_probs(x, router)
    weights, experts = moe.route(probs, 2, normalize=True)
    np.testing.assert_allclose(np.asarray(weights.sum(-1)), 1.0, rtol=1e-6)
    raw, same = moe.route(probs, 2, normalize=False)
    np.testing.assert_array_equal(np.asarray(same), np.asarray(experts))
    probs = jax.nn.softmax(x @ router)
    np.testing.assert_allclose(np.asarray(raw), np.sort(np.asarray(probs), -1)[:, ::-1][:, :2],
                               rtol=1e-6)
    # Every token through its experts, one at a time, with no capacity limit.
    wg, wu, wd = (jnp.asarray(rng.normal(size=s), jnp.float32)
                  for s in ((4, 8, 6), (4, 8, 6), (4, 6, 8)))
    out = moe.experts_mlp(x, weights, experts, wg, wu, wd, 'silu')
    expected = np.zeros((32, 8), np.float32)
    for n in range(32):
        for j in range(2):
            e = int(experts[n, j])
            expected[n] += float(weights[n, j]) * np.asarray(
                (jax.nn.silu(x[n] @ wg[e]) * (x[n] @ wu[e])) @ wd[e])
    np.testing.assert_allclose(np.asarray(out), expected, atol=1e-5, rtol=1e-5)


def hf_greedy(hf, context, max_new_tokens):
    ids = torch.tensor([context], dtype=torch.long)
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                          max_new_tokens=max_new_tokens, min_new_tokens=0, eos_token_id=None,
                          pad_token_id=0, top_k=None, top_p=None, temperature=None)
    return out[0, len(context):].tolist()


def test_greedy_generation_equals_transformers(checkpoints):
    _, model, hf = checkpoints('mlp_only_layer')
    contexts = [tc.random_tokens(1, 7, seed=1)[0].tolist(),
                tc.random_tokens(1, 12, seed=2)[0].tolist()]
    r = generate(model, contexts, n=1, max_new_tokens=16, temperature=0.0)
    for row, context in enumerate(contexts):
        assert r.completions()[row] == hf_greedy(hf, context, 16), row


def test_export_round_trip_through_transformers(checkpoints, tmp_path):
    _, model, _ = checkpoints('sparse_step_2')
    out = save_pretrained(model, model.config, tmp_path / 'out')
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32, attn_implementation='eager').eval()
    assert isinstance(reloaded, transformers.Qwen3MoeForCausalLM)
    assert reloaded.config.mlp_only_layers == [] and reloaded.config.decoder_sparse_step == 2
    tokens = tc.random_tokens(2, 9, seed=3)
    np.testing.assert_allclose(tc.hf_logits(reloaded, tokens), np.asarray(forward(model, tokens)),
                               atol=TOL, rtol=0)
    again, config = from_pretrained(out)
    assert config == model.config
    for name in model.layer_names + ('embed', 'final_norm', 'lm_head'):
        np.testing.assert_array_equal(np.asarray(getattr(again, name)[...]),
                                      np.asarray(getattr(model, name)[...]))


def test_qwen2_moe_shared_expert_loads_and_exports(tmp_path):
    src, hf = tc.save_checkpoint('qwen2_moe', tmp_path / 'src')  # a dense layer 1, q/k/v biases
    model, config = from_pretrained(src)
    assert config.shared_expert_intermediate_size == 56 and config.qkv_bias
    tokens = tc.random_tokens(2, 9, seed=5)
    ours = np.asarray(forward(model, tokens))
    np.testing.assert_allclose(ours, tc.hf_logits(hf, tokens), atol=TOL, rtol=0)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(
        save_pretrained(model, config, tmp_path / 'out'), dtype=torch.float32,
        attn_implementation='eager').eval()
    assert isinstance(reloaded, transformers.Qwen2MoeForCausalLM)
    np.testing.assert_allclose(tc.hf_logits(reloaded, tokens), ours, atol=TOL, rtol=0)


# --- the sampler and the learner on a tiny MoE -----------------------------------------------

TINY = ModelConfig(model_type='qwen3_moe', vocab_size=64, hidden_size=32, intermediate_size=48,
                   num_layers=3, num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True,
                   num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                   norm_topk_prob=True, mlp_only_layers=(1,), max_position_embeddings=256)


def tiny_moe():
    return Decoder(TINY, rngs=nnx.Rngs(0))


def recorded_routes_expected(model, tokens, token_mask):
    """The experts the model's own teacher-forced forward routes each token of right-padded rows
    to, -1 where the sampler records none (each row's last token, never fed; padding)."""
    own = np.asarray(nnx.jit(lambda m, t, mask: m.route(t, mask=mask))(model, tokens, token_mask))
    unrecorded = np.arange(tokens.shape[1])[None] >= np.sum(token_mask, axis=1)[:, None] - 1
    return np.where(unrecorded[..., None, None], -1, own)


def test_continuous_decode_equals_the_static_one_and_both_record_the_models_routes():
    """Static, continuous and continuous with preemptions (pages of 8 tokens, each row promised
    one: 6 rows start on 6 pages, and 10 of 12 rows outgrow a page) draw the same tokens and
    record, for every token but a row's last, the experts the model's own forward picks."""
    model = tiny_moe()
    rng = np.random.default_rng(0)
    a, b, c = (rng.integers(3, 64, size=n).tolist() for n in (3, 9, 7))
    contexts = [a, b, c, SharedContext(b, a)]
    request = dict(n=3, max_new_tokens=16, stop_ids=(5, 9, 17), seed=3, temperature=1.0,
                   record_routes=True)
    static = generate(model, contexts, **request)
    assert (static.lengths > 8).sum() == 10 and not static.stopped.all()
    pages = (3 * 32 + 6 * 8) * budget.page_bytes_per_token(TINY, 'float32')
    expected = recorded_routes_expected(model, static.tokens, static.token_mask)
    assert static.routes.dtype == np.int8 and static.routes.shape == expected.shape
    np.testing.assert_array_equal(static.routes, expected)
    for memory in (dict(max_rows_in_flight=4, page_size=16),
                   dict(max_rows_in_flight=6, page_size=8, kv_budget_bytes=pages,
                        reserve_fraction=0.5)):
        continuous = generate(model, contexts, **memory, **request)
        assert continuous.completions() == static.completions()
        np.testing.assert_allclose(continuous.logprobs, static.logprobs, atol=1e-6, rtol=0)
        np.testing.assert_array_equal(continuous.routes, expected)
    # The sampler's log-probs are the model's own (teacher-forced) ones: same routing.
    score = nnx.jit(lambda m, t, mask: token_logprobs(m, t, mask)[0])
    reference = score(model, static.tokens, static.token_mask)
    reference = np.where(static.completion_mask, np.asarray(reference), 0.0)
    np.testing.assert_allclose(static.logprobs, reference, atol=1e-5, rtol=0)


def test_grpo_update_trains_experts_and_router():
    """One GRPO update over 4 accumulated micro-batches: its loss is the clipped objective of the
    learner's own log-probs, and every kind of weight moves (the router through the top-k)."""
    config = TrainConfig(learning_rate=1e-3, micro_batch_size=4, eps_low=0.2, eps_high=0.28)
    learner = Learner(tiny_moe(), config)
    state = learner.init_state()
    rng = np.random.default_rng(0)
    rows, width = 16, 12
    tokens = rng.integers(1, 64, (rows, width)).astype(np.int32)
    context = rng.integers(3, 6, rows)
    length = context + rng.integers(2, 7, rows)
    cols = np.arange(width)[None]
    token_mask = cols < length[:, None]
    batch = {'tokens': np.where(token_mask, tokens, 0),
             'positions': np.where(token_mask, cols, 0).astype(np.int32),
             'token_mask': token_mask,
             'completion_mask': ((cols >= context[:, None]) & token_mask).astype(np.float32),
             'advantages': rng.normal(size=rows).astype(np.float32)}
    logp = np.asarray(learner.logprobs(state.params, batch))
    batch['old_logprobs'] = ((logp + 0.1 * rng.normal(size=logp.shape)).astype(np.float32)
                             * batch['completion_mask'])
    expected = objectives.policy_loss(jnp.asarray(logp), batch['old_logprobs'],
                                      batch['advantages'], batch['completion_mask'],
                                      eps_low=0.2, eps_high=0.28,
                                      aggregation=config.aggregation)[0]
    before = {k: np.asarray(v[...]) for k, v in nnx.to_flat_state(state.params)}
    state, metrics = learner.update(state, batch)
    np.testing.assert_allclose(metrics['loss'], expected, rtol=1e-5)
    assert int(state.updates) == 1 and float(metrics['grad_norm']) > 0
    after = {k: np.asarray(v[...]) for k, v in nnx.to_flat_state(state.params)}
    for name in ('router', 'expert_gate', 'expert_down', 'gate', 'q'):
        key = next(k for k in after if k[-1] == name)
        assert np.abs(after[key] - before[key]).max() > 1e-5, name

    # With the load-balancing loss: + coef times its mean over the micro-batches (rows strided
    # over them: micro-batch j holds rows j, j + 4, ...).
    balanced = Learner(tiny_moe(), dataclasses.replace(config, router_aux_coef=0.01))
    model = balanced.model(balanced.init_state())
    load = nnx.jit(lambda m, t, p, mask: m.hidden(t, p, mask, router_load=True)[1])
    aux = np.mean([float(moe.load_balancing_loss(
        load(model, batch['tokens'][j::4], batch['positions'][j::4], token_mask[j::4]),
        token_mask[j::4].sum())) for j in range(4)])
    _, metrics = balanced.update(balanced.init_state(), batch)
    np.testing.assert_allclose(metrics['router/aux_loss'], aux, rtol=1e-5)
    np.testing.assert_allclose(metrics['loss'], expected + 0.01 * aux, rtol=1e-5)


# --- the shipped config -------------------------------------------------------------------------

def test_shipped_qwen3_30b_a3b_config():
    config = ModelConfig.from_hf(published.hf_config('Qwen/Qwen3-30B-A3B'))
    assert (config.num_experts, config.num_experts_per_tok, config.norm_topk_prob) == (128, 8, True)
    assert all(config.sparse_layers) and len(config.sparse_layers) == 48
    # The model card: 30.5B parameters in all, 3.3B activated.
    assert 30.4e9 < config.num_params() < 30.6e9
    assert 3.2e9 < config.num_params(active=True) < 3.4e9
    assert ModelConfig.from_hf(config.to_hf()) == config


def test_load_balancing_loss_equals_transformers_and_a_hand_computation(checkpoints):
    """moe.load_balancing_loss of the router loads is transformers' aux_loss (Qwen3-MoE, a dense
    layer among sparse ones, left padding) and E * sum_e f_e P_e computed here by hand."""
    _, model, hf = checkpoints('mlp_only_layer')
    tokens = tc.random_tokens(2, 11, seed=6)
    mask = np.ones(tokens.shape, bool)
    mask[1, :4] = False
    h, load = nnx.jit(lambda m, t, mask: m.hidden(t, mask=mask, router_load=True))(
        model, tokens, mask)
    ours = float(moe.load_balancing_loss(load, mask.sum()))
    ids, m = torch.as_tensor(tokens, dtype=torch.long), torch.as_tensor(mask, dtype=torch.long)
    with torch.no_grad():
        out = hf(input_ids=ids, attention_mask=m, position_ids=(m.cumsum(-1) - 1).clamp(min=0),
                 output_router_logits=True)
    assert len(out.router_logits) == 2  # the sparse layers 0 and 2
    np.testing.assert_allclose(ours, float(out.aux_loss), rtol=1e-5)
    experts, k = hf.config.num_experts, hf.config.num_experts_per_tok
    picks, probs = np.zeros(experts), np.zeros(experts)
    for logits in out.router_logits:  # [B * T, E] each
        p = torch.softmax(logits.float(), -1).numpy()[mask.reshape(-1)]
        probs += p.sum(0)
        for row in p:
            picks[np.argsort(-row)[:k]] += 1
    pairs = 2 * mask.sum()
    np.testing.assert_allclose(ours, experts * np.sum(picks / pairs * probs / pairs), rtol=1e-5)


def test_expert_parallel_equals_one_device():
    """8 experts over 8 simulated devices, one a device: expert parallel over 'data', over
    'data' x 'fsdp' x 'tensor', as the sampler decodes (rows over 'data', heads over 'tensor')
    and over 'fsdp' (the paper runs' learner); 4 experts under FSDP alone (they do not split 8
    ways: each whole on every device as its layer runs, the model dimension sharded). The logits
    and the gradient of every weight are one device's. A replayed routing (other experts than
    the router's) is dispatched the same way: its log-probs are one device's too."""
    from jaxprefix.models import make_mesh, shard_model
    tokens = np.random.default_rng(4).integers(1, 64, (8, 10)).astype(np.int32)
    mask = jnp.ones(tokens.shape, bool)

    def loss(m):
        return token_logprobs(m, tokens, mask)[0].sum(), m(tokens)
    run = nnx.jit(nnx.value_and_grad(loss, has_aux=True))
    replay = nnx.jit(lambda m, routes: token_logprobs(m, tokens, mask, routes=routes)[0])
    for experts, meshes in ((8, (((8, 1, 1), 1), ((2, 2, 2), 1), ((4, 1, 2), 1), ((1, 8, 1), 1))),
                            (4, (((1, 8, 1), 4),))):
        config = TINY.replace(num_layers=1, mlp_only_layers=(), num_experts=experts,
                              num_experts_per_tok=3)
        model = Decoder(config, rngs=nnx.Rngs(0))
        (_, single), single_grads = run(model)
        other = (np.asarray(nnx.jit(lambda m, t: m.route(t))(model, tokens)) + 1) % experts
        single_replayed = np.asarray(replay(model, other))
        for sizes, held in meshes:
            mesh = make_mesh(*sizes)
            sharded = shard_model(Decoder(config, rngs=nnx.Rngs(0)), mesh)
            assert sharded.expert_up[...].sharding.shard_shape(sharded.expert_up.shape)[1] == held
            with jax.set_mesh(mesh):
                (_, logits), grads = run(sharded)
                replayed = replay(sharded, other)
            np.testing.assert_allclose(np.asarray(logits), np.asarray(single), atol=1e-5, rtol=0)
            np.testing.assert_allclose(np.asarray(replayed), single_replayed, atol=1e-5, rtol=0)
            for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(single_grads)):
                np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5, rtol=1e-4)


@pytest.mark.slow  # 126 s on 2 loaded cores (3 compiles of the update)
def test_learner_update_with_experts_over_fsdp_equals_one_device(monkeypatch):
    """The paper runs' learner (FSDP over all 8 devices, remat, micro-batches) holds one whole
    expert a device and exchanges tokens, in chunks (few pairs a call here), instead of
    gathering the experts: no all-gather in its update has an expert stack's shape, and the
    update's loss, gradient norm and new weights are one device's."""
    from jaxprefix.models import make_mesh, shard_model
    # 12 tokens a device in 3 chunks of 4, gathered: 32 tokens, their experts in 4 calls of 8
    monkeypatch.setattr(moe, '_PAIRS_PER_CALL', 32)
    config = TINY.replace(num_layers=2, mlp_only_layers=(), num_experts=8, num_experts_per_tok=3)
    train = TrainConfig(learning_rate=1e-4, micro_batch_size=8, remat=True)
    rng = np.random.default_rng(8)
    rows, width = 16, 12
    cols = np.arange(width)[None]
    length = rng.integers(6, width + 1, rows)
    token_mask = cols < length[:, None]
    batch = {'tokens': np.where(token_mask, rng.integers(1, 64, (rows, width)), 0).astype(np.int32),
             'positions': np.where(token_mask, cols, 0).astype(np.int32),
             'token_mask': token_mask,
             'completion_mask': ((cols >= 3) & token_mask).astype(np.float32),
             'old_logprobs': (-2 * token_mask).astype(np.float32),
             'advantages': rng.normal(size=rows).astype(np.float32)}
    results = []
    for mesh in (None, make_mesh(1, 8, 1)):
        model = Decoder(config, rngs=nnx.Rngs(0))
        learner = Learner(model if mesh is None else shard_model(model, mesh), train, mesh)
        state = learner.init_state()
        if mesh is not None:
            assert state.params['expert_up'][...].sharding.shard_shape((2, 8, 32, 24)) == \
                (2, 1, 32, 24)
            hlo = learner.lower_update(state, learner.place_batch(batch)).compile().as_text()
            gathers = [line for line in hlo.splitlines()
                       if re.search(r' all-gather(-start)?\(', line)]
            assert gathers and not any('32,24]' in g or '24,32]' in g for g in gathers)
        state, metrics = learner.update(state, batch)
        results.append((metrics, {k: np.asarray(v[...])
                                  for k, v in nnx.to_flat_state(state.params)}))
    (single, single_params), (sharded, sharded_params) = results
    for name in ('loss', 'grad_norm'):
        np.testing.assert_allclose(sharded[name], single[name], rtol=1e-5)
    # Adam's first step is lr * g / |g| a weight: rounding moves a tiny gradient's step a little
    for key, value in single_params.items():
        np.testing.assert_allclose(sharded_params[key], value, atol=train.learning_rate / 10,
                                   rtol=0, err_msg=key)


def test_cached_forward_reads_each_layers_experts_in_place():
    """The cached path (the sampler's decode) hands the expert kernel every sparse layer's
    stacked experts and the layer (backend.grouped_matmul's `layer`: no copy of a layer's
    slice): its logits are the plain forward's, on one device and expert parallel as the
    sampler decodes."""
    from jaxprefix.models import make_mesh, shard_model
    from jaxprefix.models.attention import KVCache
    tokens = np.random.default_rng(7).integers(1, 64, (8, 6)).astype(np.int32)
    positions = np.tile(np.arange(6, dtype=np.int32), (8, 1))
    cached = nnx.jit(lambda m, t: m.extend(t, positions, cache=KVCache.empty(m.config, 8, 6))[0])
    for mesh in (None, make_mesh(4, 1, 2)):
        model = tiny_moe() if mesh is None else shard_model(tiny_moe(), mesh)
        with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
            np.testing.assert_allclose(np.asarray(cached(model, tokens)),
                                       np.asarray(forward(model, tokens)), atol=1e-5, rtol=0)


def test_megablox_equals_ragged_dot():
    """The TPU kernel (interpreted on CPU) against jax.lax.ragged_dot: an empty group, rows past
    every group (zero), and the gradients of both operands."""
    from jaxprefix.models.backend import megablox_matmul
    rng = np.random.default_rng(6)
    lhs = jnp.asarray(rng.normal(size=(200, 64)), jnp.float32)
    rhs = jnp.asarray(rng.normal(size=(4, 64, 48)), jnp.float32)
    sizes = jnp.array([30, 0, 100, 20], jnp.int32)  # 150 of 200 rows in groups
    kernel = lambda lhs, rhs: megablox_matmul(lhs, rhs, sizes, expected_rows=150,
                                              expected_groups=3, interpret=True)
    reference = lambda lhs, rhs: jax.lax.ragged_dot(lhs, rhs, sizes)
    out = np.asarray(kernel(lhs, rhs))
    np.testing.assert_allclose(out, np.asarray(reference(lhs, rhs)), atol=1e-4, rtol=1e-5)
    assert not out[150:].any()
    grads = [jax.grad(lambda a, b: (f(a, b) ** 2).sum(), argnums=(0, 1))(lhs, rhs)
             for f in (kernel, reference)]
    for a, b in zip(*grads):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-3, rtol=1e-5)
    assert not np.asarray(grads[0][0])[150:].any()


def test_routes_recorded_on_four_devices_equal_one_devices():
    """Rows and contexts split in 4 blocks (static; continuous, each device admitting its own
    contexts): the same tokens and the same recorded experts as on one device."""
    from jaxprefix.models import make_mesh, shard_model
    rng = np.random.default_rng(6)
    contexts = [rng.integers(3, 64, size=n).tolist() for n in (3, 9, 7, 5, 12, 4, 8, 6)]
    request = dict(n=2, max_new_tokens=12, stop_ids=(5, 9, 17), seed=5, temperature=1.0,
                   record_routes=True)
    single = generate(tiny_moe(), contexts, **request)
    sharded = shard_model(tiny_moe(), make_mesh(4, 1, 1, devices=jax.devices()[:4]))
    for memory in ({}, dict(max_rows_in_flight=8, page_size=16)):
        r = generate(sharded, contexts, **memory, **request)
        assert r.completions() == single.completions(), memory
        np.testing.assert_array_equal(r.routes, single.routes)


def test_lora_on_the_attention_of_a_moe():
    from jaxprefix.models import lora
    model = tiny_moe()
    tokens = np.random.default_rng(5).integers(1, 64, (2, 7)).astype(np.int32)
    adapted = lora.with_adapters(model, lora.LoraConfig(4, targets=('q', 'k', 'v', 'o')))
    # B = 0 adds exactly zero, but the adapted program is another program: XLA:CPU may fuse
    # and round its projections differently (seen here: 7e-8 on some machines, 0 on others),
    # so the logits are equal to f32 rounding; a nonzero adapter moves them by ~1e-2.
    np.testing.assert_allclose(np.asarray(forward(adapted, tokens)),
                               np.asarray(forward(model, tokens)), atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match='gate, up, down are not adaptable on a mixture'):
        lora.with_adapters(model, lora.LoraConfig(4))
