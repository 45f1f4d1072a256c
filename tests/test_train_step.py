"""The jitted update: against a direct gradient, sharded == single device, NaN skipped."""
import dataclasses

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from jaxprefix.checkpoints.hf import from_gguf
from jaxprefix.models.config import ModelConfig
from jaxprefix.models.decoder import Decoder
from jaxprefix.models.scoring import token_logprobs
from jaxprefix.models.sharding import make_mesh, shard_model
from jaxprefix.rl import objectives
from jaxprefix.rl.batch_layout import trim_widths
from jaxprefix.rl.train_config import TrainConfig
from jaxprefix.rl.train_step import Learner

CONFIG = ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=48,
                     num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                     tie_word_embeddings=True)
ROWS, WIDTH = 16, 12


def tiny_model(mesh=None):
    model = Decoder(CONFIG, rngs=nnx.Rngs(0))
    return model if mesh is None else shard_model(model, mesh)


def rollout_batch(seed=0):
    """Rows: context (3-5 tokens), completion (2-6 tokens), right padding."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, CONFIG.vocab_size, (ROWS, WIDTH)).astype(np.int32)
    context = rng.integers(3, 6, ROWS)
    length = context + rng.integers(2, 7, ROWS)
    cols = np.arange(WIDTH)[None]
    token_mask = cols < length[:, None]
    tokens = np.where(token_mask, tokens, 0)
    completion = (cols >= context[:, None]) & token_mask
    return {"tokens": tokens, "positions": np.where(token_mask, cols, 0).astype(np.int32),
            "token_mask": token_mask, "completion_mask": completion.astype(np.float32),
            "advantages": rng.normal(size=ROWS).astype(np.float32)}


def with_old_logprobs(batch, learner, state, noise=0.0, seed=1):
    """Old log-probs as the sampler would report them: the policy's own, perturbed by `noise`."""
    logp = np.asarray(learner.logprobs(state.params, batch))
    jitter = np.random.default_rng(seed).normal(size=logp.shape).astype(np.float32) * noise
    return {**batch, "old_logprobs": (logp + jitter) * batch["completion_mask"]}


def params_of(state):
    return [np.asarray(x) for x in jax.tree.leaves(state.params)]


def assert_same_step(state, metrics, expected_state, expected, keys):
    """Two updates took the same step: the metrics named and every new weight agree."""
    for key in keys:
        np.testing.assert_allclose(metrics[key], expected[key], rtol=1e-5)
    for a, b in zip(params_of(state), params_of(expected_state)):
        np.testing.assert_allclose(a, b, atol=1e-6)


# Two learners compiled once per module: compilation dominates these tests' time.
ONE_MINIBATCH = TrainConfig(learning_rate=1e-3, max_grad_norm=1e9, adam_eps=1e-12,
                            micro_batch_size=4, eps_low=0.2, eps_high=0.28)
TWO_MINIBATCHES = TrainConfig(learning_rate=1e-3, num_minibatches=2, micro_batch_size=4,
                              eps_high=0.28)


@pytest.fixture(scope="module")
def one_minibatch():
    return Learner(tiny_model(), ONE_MINIBATCH)


@pytest.fixture(scope="module")
def two_minibatches():
    return Learner(tiny_model(), TWO_MINIBATCHES)


def direct_loss(learner, batch, aggregation="token_mean"):
    """The loss written out from the pieces, whole batch at once, as a function of params."""
    def loss(params):
        model = nnx.merge(learner.graphdef, params, learner.rest)
        logp, _ = token_logprobs(model, batch["tokens"], batch["token_mask"],
                                 positions=batch["positions"])
        return objectives.policy_loss(logp, batch["old_logprobs"], batch["advantages"],
                                      batch["completion_mask"], eps_low=0.2, eps_high=0.28,
                                      aggregation=aggregation)[0]
    return loss


def assert_adam_sign_step(learner, aggregation):
    """4 accumulated micro-batches == the whole-batch gradient: Adam's first step moves every
    weight by lr * sign(grad) (m / sqrt(v) = g / |g|)."""
    state = learner.init_state()
    before = params_of(state)
    batch = with_old_logprobs(rollout_batch(), learner, state, noise=0.1)
    loss, grads = jax.value_and_grad(direct_loss(learner, batch, aggregation))(state.params)
    state, metrics = learner.update(state, batch)
    np.testing.assert_allclose(metrics["loss"], loss, rtol=1e-5)
    np.testing.assert_allclose(metrics["grad_norm"], optax.tree.norm(grads), rtol=1e-4)
    lr = learner.config.learning_rate
    for b, a, g in zip(before, params_of(state), jax.tree.leaves(grads)):
        g = np.asarray(g)
        big = np.abs(g) > 1e-6
        np.testing.assert_allclose((a - b)[big], -lr * np.sign(g[big]), rtol=1e-3, atol=1e-7)
    return state, metrics, batch


def test_accumulated_update_is_adam_sign_step_of_the_direct_gradient(one_minibatch):
    state, metrics, batch = assert_adam_sign_step(one_minibatch, "token_mean")
    assert int(state.step) == 1 and int(state.updates) == 1 and int(state.skipped) == 0
    assert 0 < float(metrics["ratio/first_max_abs_dev"]) < 1.0  # the injected noise shows
    np.testing.assert_allclose(metrics["loss_tokens"], batch["completion_mask"].sum())
    # the mismatch read back: |old - learner| is the injected noise (normal, sigma 0.1)
    diff = np.abs(batch["old_logprobs"] - np.asarray(one_minibatch.logprobs(
        one_minibatch.init_state().params, batch)))[batch["completion_mask"] > 0]
    np.testing.assert_allclose(metrics["mismatch/first_logp_diff_mean"], diff.mean(), rtol=1e-3)
    np.testing.assert_allclose(metrics["mismatch/first_logp_diff_max"], diff.max(), rtol=1e-3)
    np.testing.assert_allclose(metrics["mismatch/first_past_0.1"], (diff > 0.1).mean())
    np.testing.assert_allclose(metrics["lr"], 1e-3)


@pytest.mark.slow
@pytest.mark.parametrize("aggregation", objectives.AGGREGATIONS[1:])
def test_accumulation_per_aggregation(aggregation):
    config = dataclasses.replace(ONE_MINIBATCH, aggregation=aggregation)
    assert_adam_sign_step(Learner(tiny_model(), config), aggregation)


@pytest.mark.slow
def test_kl_to_reference_enters_the_update():
    config = dataclasses.replace(ONE_MINIBATCH, kl_coef=0.5, kl_kind="k3")
    learner = Learner(tiny_model(), config)
    state = learner.init_state()
    batch = with_old_logprobs(rollout_batch(), learner, state)
    with pytest.raises(ValueError, match="ref_logprobs"):
        learner.update(state, batch)
    # One minibatch: the policy is the sampler's, so ref - logp = -0.1 on every loss token.
    batch["ref_logprobs"] = batch["old_logprobs"] - 0.1
    _, metrics = learner.update(state, batch)
    k3 = np.exp(-0.1) + 0.1 - 1
    np.testing.assert_allclose(metrics["kl"], k3, rtol=1e-4)
    np.testing.assert_allclose(metrics["loss"], 0.5 * k3 - (
        batch["advantages"][:, None] * batch["completion_mask"]).sum()
        / batch["completion_mask"].sum(), rtol=1e-4)


def test_sampler_logprobs_give_unit_ratio_on_first_minibatch(two_minibatches):
    state = two_minibatches.init_state()
    batch = with_old_logprobs(rollout_batch(), two_minibatches, state)
    _, metrics = two_minibatches.update(state, batch)
    assert float(metrics["ratio/first_max_abs_dev"]) < 1e-5
    assert float(metrics["ratio/max_abs_dev"]) > 1e-5  # the second minibatch sees moved weights
    assert int(metrics["updates"]) == 2


def test_learner_old_logprobs_replace_the_samplers(one_minibatch):
    """old_logprobs='learner': the update recomputes pi_old itself, so a batch whose sampler
    log-probs are off by noise takes the step that exact ones take in 'sampler' mode, and the
    noise is reported as the mismatch."""
    learner = Learner(tiny_model(), dataclasses.replace(ONE_MINIBATCH, old_logprobs="learner"))
    state = one_minibatch.init_state()
    exact = with_old_logprobs(rollout_batch(), one_minibatch, state)
    noisy = with_old_logprobs(rollout_batch(), one_minibatch, state, noise=0.1)
    _, reference = one_minibatch.update(one_minibatch.init_state(), exact)
    _, metrics = learner.update(learner.init_state(), noisy)
    for key in ("loss", "grad_norm", "entropy"):
        np.testing.assert_allclose(metrics[key], reference[key], rtol=1e-5)
    assert float(metrics["ratio/first_max_abs_dev"]) < 1e-5  # the noise left the ratio
    mask = noisy["completion_mask"] > 0
    gap = np.abs(noisy["old_logprobs"] - exact["old_logprobs"])[mask]
    np.testing.assert_allclose(metrics["rollout/logprob_mismatch_mean"], gap.mean(), rtol=1e-4)
    np.testing.assert_allclose(metrics["rollout/logprob_mismatch_max"], gap.max(), rtol=1e-4)
    assert "rollout/logprob_mismatch_mean" not in reference  # 'sampler' mode: as before


def corrected_update(config, **correction):
    """(the learner's update metrics, the loss tokens' mask, exp(pi_old - pi_sampler), the batch)
    of a noisy-sampler batch under `config`, after checking that the update's loss and gradient
    are those of policy_loss(**correction) written out directly."""
    learner = Learner(tiny_model(), config)
    state = learner.init_state()
    own = np.asarray(learner.logprobs(state.params, rollout_batch()))
    batch = with_old_logprobs(rollout_batch(), learner, state, noise=0.3)
    mask = batch["completion_mask"]

    def direct(params):
        model = nnx.merge(learner.graphdef, params, learner.rest)
        logp, _ = token_logprobs(model, batch["tokens"], batch["token_mask"],
                                 positions=batch["positions"])
        return objectives.policy_loss(logp, own, batch["advantages"], mask, eps_low=0.2,
                                      eps_high=0.28, sampler_logp=batch["old_logprobs"],
                                      **correction)[0]

    loss, grads = jax.value_and_grad(direct)(state.params)
    _, metrics = learner.update(state, batch)
    np.testing.assert_allclose(metrics["loss"], loss, rtol=1e-5)
    np.testing.assert_allclose(metrics["grad_norm"], optax.tree.norm(grads), rtol=1e-4)
    return metrics, mask, np.exp(own - batch["old_logprobs"]), batch


def test_tis_update_equals_the_hand_computed_loss(one_minibatch):
    """On the first minibatch pi = pi_old (the learner's), so the clipped ratio is 1 and each
    token's loss is -A * min(exp(pi_old - pi_sampler), cap): the loss is that mean, and the
    gradient that of the TIS loss written out directly."""
    cap = 1.2
    config = dataclasses.replace(ONE_MINIBATCH, old_logprobs="learner", tis_cap=cap)
    metrics, mask, ratio, batch = corrected_update(config, tis_cap=cap)
    weights = np.minimum(ratio, cap)
    by_hand = -(batch["advantages"][:, None] * weights * mask).sum() / mask.sum()
    np.testing.assert_allclose(metrics["loss"], by_hand, rtol=1e-5)
    np.testing.assert_allclose(metrics["tis/weight_mean"], weights[mask > 0].mean(), rtol=1e-5)
    capped = (weights[mask > 0] >= cap).mean()
    assert 0 < capped < 1
    np.testing.assert_allclose(metrics["tis/capped_fraction"], capped, rtol=1e-5)
    # The same batch uncorrected ('sampler' mode): another loss.
    _, plain = one_minibatch.update(one_minibatch.init_state(), batch)
    assert abs(float(plain["loss"]) - by_hand) > 1e-3


def test_ratio_mask_update_drops_the_tokens_outside_the_band(one_minibatch):
    """On the first minibatch pi = pi_old (the learner's), so each token's loss is -A times 1 if
    exp(pi_old - pi_sampler) lies in [1/c, c], else 0, over all loss tokens; the learner reports
    the masked share of them."""
    c = 1.2
    config = dataclasses.replace(ONE_MINIBATCH, old_logprobs="learner", ratio_mask=c)
    metrics, mask, ratio, batch = corrected_update(config, ratio_mask=c)
    keep = (ratio >= 1 / c) & (ratio <= c)
    by_hand = -(batch["advantages"][:, None] * keep * mask).sum() / mask.sum()
    np.testing.assert_allclose(metrics["loss"], by_hand, rtol=1e-5)
    masked = 1 - keep[mask > 0].mean()
    assert 0.1 < masked < 0.9
    np.testing.assert_allclose(metrics["ratio_mask/masked_fraction"], masked, rtol=1e-5)
    assert "tis/weight_mean" not in metrics


def test_sharded_step_equals_single_device_step(two_minibatches):
    state = two_minibatches.init_state()
    batch = with_old_logprobs(rollout_batch(), two_minibatches, state, noise=0.05)
    state, m_single = two_minibatches.update(state, batch)

    mesh = make_mesh(data=1, fsdp=4, tensor=2)
    sharded = Learner(tiny_model(mesh), TWO_MINIBATCHES, mesh)
    sharded_state = sharded.init_state()
    embed = sharded_state.params["embed"][...]
    assert len(embed.sharding.device_set) == 8
    sharded_state, m_sharded = sharded.update(sharded_state, batch)
    assert sharded_state.params["embed"][...].sharding == embed.sharding  # stays in place
    for key in ("loss", "grad_norm", "clip_frac/high", "entropy"):
        np.testing.assert_allclose(m_sharded[key], m_single[key], rtol=1e-4, atol=1e-6)
    for a, b in zip(params_of(sharded_state), params_of(state)):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_non_finite_gradient_skips_the_update_and_is_counted(two_minibatches):
    learner = two_minibatches
    state = learner.init_state()
    before = params_of(state)
    batch = with_old_logprobs(rollout_batch(), learner, state)
    # Rows are strided: row r = 4k + 2m + j is row k of micro-batch j of minibatch m, so rows 0
    # and 2 poison both minibatches.
    poisoned = {**batch, "advantages": batch["advantages"].copy()}
    poisoned["advantages"][[0, 2]] = np.nan
    state, metrics = learner.update(state, poisoned)
    for a, b in zip(params_of(state), before):
        np.testing.assert_array_equal(a, b)
    assert int(state.skipped) == 2 and int(state.updates) == 0
    assert int(metrics["skipped_updates"]) == 2
    opt_leaves = [np.asarray(x) for x in jax.tree.leaves(state.opt_state)]
    assert all(np.isfinite(x).all() for x in opt_leaves)
    # Only the first minibatch poisoned: one update applied, one skipped.
    poisoned["advantages"][2] = batch["advantages"][2]
    state, metrics = learner.update(state, poisoned)
    assert int(state.updates) == 1 and int(metrics["skipped_updates"]) == 1
    assert any(not np.array_equal(a, b) for a, b in zip(params_of(state), before))


def test_remat_takes_the_same_step_and_leaves_the_sampler_graph_alone(one_minibatch):
    remat = Learner(tiny_model(), dataclasses.replace(ONE_MINIBATCH, remat=True))
    assert remat.model(remat.init_state()).config.remat is False  # the sampler's graph
    state = one_minibatch.init_state()
    batch = with_old_logprobs(rollout_batch(), one_minibatch, state, noise=0.1)
    plain_state, plain = one_minibatch.update(state, batch)
    remat_state, metrics = remat.update(remat.init_state(), batch)
    assert_same_step(remat_state, metrics, plain_state, plain, ("loss", "grad_norm", "entropy"))


def test_remat_keeps_the_layers_inputs_not_their_activations():
    """Without remat every layer's activations are kept for backward; with it, the layers' inputs
    and one layer's recomputation. The attention is blockwise (no [T, T] scores are kept either
    way), so remat's saving is the MLP and projection activations: 52 MB -> 22 MB measured."""
    config = CONFIG.replace(num_layers=6)
    rng = np.random.default_rng(0)
    width = 128
    batch = {"tokens": rng.integers(1, 64, (ROWS, width)).astype(np.int32),
             "positions": np.tile(np.arange(width, dtype=np.int32), (ROWS, 1)),
             "token_mask": np.ones((ROWS, width), bool),
             "completion_mask": np.ones((ROWS, width), np.float32),
             "old_logprobs": np.zeros((ROWS, width), np.float32),
             "advantages": np.ones(ROWS, np.float32)}
    model = Decoder(config, nnx.Rngs(0))
    temp = {}
    for remat in (False, True):
        learner = Learner(model, TrainConfig(remat=remat))
        temp[remat] = learner.memory_analysis(learner.init_state(), batch).temp_size_in_bytes
    assert temp[True] < temp[False] / 2


def ragged_batch(width=64, seed=2):
    """Rows of 5 to `width` real tokens, so that sorted micro-batches can be cut short."""
    rng = np.random.default_rng(seed)
    length = rng.integers(5, width + 1, ROWS)
    length[3] = width  # one row fills the batch: the full-width branch runs too
    cols = np.arange(width)[None]
    token_mask = cols < length[:, None]
    tokens = np.where(token_mask, rng.integers(1, CONFIG.vocab_size, (ROWS, width)), 0)
    return {"tokens": tokens.astype(np.int32),
            "positions": np.where(token_mask, cols, 0).astype(np.int32),
            "token_mask": token_mask,
            "completion_mask": ((cols >= 3) & token_mask).astype(np.float32),
            "advantages": rng.normal(size=ROWS).astype(np.float32)}


def test_trim_widths_step_the_batch_width():
    assert trim_widths(256, 8) == (32, 64, 96, 128, 160, 192, 224, 256)
    assert trim_widths(100, 4) == (32, 64, 96, 100)
    assert trim_widths(12, 8) == (12,) and trim_widths(256, 1) == (256,)


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_sum_norm"])
def test_cut_padding_takes_the_same_step(aggregation):
    """Sorting rows into micro-batches and cutting each to its longest row (width_steps) takes
    the step of the full-width update: the same loss, gradient norm and new weights."""
    config = dataclasses.replace(ONE_MINIBATCH, aggregation=aggregation, num_minibatches=2)
    cut, full = (Learner(tiny_model(), dataclasses.replace(config, width_steps=steps))
                 for steps in (4, 1))
    state = full.init_state()
    batch = with_old_logprobs(ragged_batch(), full, state, noise=0.1)
    full_state, expected = full.update(state, batch)
    cut_state, metrics = cut.update(cut.init_state(), batch)
    assert_same_step(cut_state, metrics, full_state, expected,
                     ("loss", "grad_norm", "entropy", "ratio/first_max_abs_dev"))


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
def test_zero_advantage_micro_batches_are_skipped_for_the_same_step(aggregation):
    """Rows whose advantage is 0 (groups that all scored alike) are sorted into micro-batches of
    their own, which are not computed: the same loss, gradient norm and new weights as computing
    every micro-batch, with the computed share logged."""
    config = dataclasses.replace(ONE_MINIBATCH, aggregation=aggregation)
    skip, full = (Learner(tiny_model(), dataclasses.replace(config, skip_zero_advantage=on))
                  for on in (True, False))
    state = full.init_state()
    batch = rollout_batch()
    quiet = np.ones(ROWS, bool)
    quiet[[1, 6, 7, 10, 13, 14]] = False                  # 6 rows with a signal, 10 without
    batch["advantages"] = np.where(quiet, 0.0, batch["advantages"]).astype(np.float32)
    batch = with_old_logprobs(batch, full, state, noise=0.1)
    full_state, expected = full.update(state, batch)
    skip_state, metrics = skip.update(skip.init_state(), batch)
    assert_same_step(skip_state, metrics, full_state, expected,
                     ("loss", "grad_norm", "ratio/first_max_abs_dev"))
    assert float(metrics["update/computed_share"]) == 0.5   # 2 of 4 micro-batches of 4 rows
    assert float(expected["update/computed_share"]) == 1.0
    # a batch with no signal at all: nothing computed, the weights unchanged, the diagnostics
    # those of an unchanged policy (not the empty accumulator's sentinels)
    silent = {**batch, "advantages": np.zeros(ROWS, np.float32)}
    before = params_of(skip.init_state())
    state, metrics = skip.update(skip.init_state(), silent)
    assert float(metrics["update/computed_share"]) == 0.0
    assert all(np.array_equal(a, b) for a, b in zip(params_of(state), before))
    for key in ("ratio/min", "ratio/max", "ratio/mean"):
        assert float(metrics[key]) == 1.0, key
    for key in ("ratio/first_max_abs_dev", "mismatch/first_logp_diff_max", "loss"):
        assert float(metrics[key]) == 0.0, key
    # a KL term gives every row a gradient: nothing is skipped
    assert not dataclasses.replace(config, kl_coef=0.01).skips_zero_advantage


def test_invalid_settings_name_the_field():
    with pytest.raises(ValueError, match="eps_low"):
        TrainConfig(eps_low=-0.1)
    with pytest.raises(ValueError, match="aggregation"):
        TrainConfig(aggregation="sum")
    with pytest.raises(ValueError, match="num_minibatches"):
        TrainConfig(num_minibatches=3).check_batch(16)
    with pytest.raises(ValueError, match="mesh"):
        TrainConfig(micro_batch_size=2).check_batch(16, batch_shards=4)
    with pytest.raises(ValueError, match="old_logprobs"):
        TrainConfig(old_logprobs="actor")
    with pytest.raises(ValueError, match="width_steps"):
        TrainConfig(width_steps=0)
    with pytest.raises(ValueError, match="tis_cap=2.0: expected 0 unless old_logprobs='learner'"):
        TrainConfig(tis_cap=2.0)  # against the sampler's own log-probs TIS would do nothing
    with pytest.raises(ValueError, match="ratio_mask=2.0: expected 0 unless old_logprobs="):
        TrainConfig(ratio_mask=2.0)  # every ratio would be 1: nothing masked
    for c in (0.5, 1.0, -1.0):  # a band [1/c, c] needs c > 1
        with pytest.raises(ValueError, match=rf"ratio_mask={c}: expected 0 \(off\) or > 1"):
            TrainConfig(old_logprobs="learner", ratio_mask=c)
    TrainConfig(old_logprobs="learner", ratio_mask=2.0, tis_cap=2.0)  # both: fine


def _sampled_batch(model, temperature):
    """A learner batch laid out from real rollouts at `temperature` (sampler log-probs as old)."""
    from jaxprefix import sampling
    from jaxprefix.rl import dynamic_sampling

    contexts = [[3, 4, 5], [7, 8, 9, 10]]
    rollouts = sampling.generate(model, contexts, n=4, max_new_tokens=6, temperature=temperature,
                                 seed=3)
    rewards = np.random.default_rng(0).uniform(size=(2, 4))
    advantages = np.asarray(objectives.group_advantages(rewards))
    selection = dynamic_sampling.select_groups([rewards], 2)
    return dynamic_sampling.build_batch([rollouts], [advantages], selection)


@pytest.mark.parametrize("temperature", [0.6])  # T < 1 sharpens; T > 1 is the same scaling
def test_learner_scores_at_the_sampling_temperature(temperature):
    """Rollouts at T: the learner at T reproduces the sampler's log-probs (ratio 1 on the first
    minibatch); scoring at T = 1 instead (the old behaviour) does not."""
    model = tiny_model()
    batch = _sampled_batch(model, temperature)
    deviations = {}
    for t in (temperature, 1.0):
        learner = Learner(model, TrainConfig(learning_rate=1e-3, temperature=t))
        _, metrics = learner.update(learner.init_state(), batch)
        deviations[t] = float(metrics["ratio/first_max_abs_dev"])
    assert deviations[temperature] < 1e-4
    assert deviations[1.0] > 1e-2


def test_entropy_bonus_enters_the_loss():
    """With zero advantages the policy term is 0, so the loss is -coef x the token-mean entropy."""
    model = tiny_model()
    learner = Learner(model, TrainConfig(learning_rate=1e-3, entropy_coef=0.05))
    state = learner.init_state()
    batch = with_old_logprobs(rollout_batch(), learner, state)
    batch["advantages"] = np.zeros_like(batch["advantages"])
    _, metrics = learner.update(state, batch)
    np.testing.assert_allclose(metrics["loss"], -0.05 * metrics["entropy"], rtol=1e-5)
    assert float(metrics["grad_norm"]) > 0  # the bonus alone moves the policy


@pytest.mark.slow  # SmolLM2-135M on CPU: about a minute alone
def test_smollm2_learner_matches_its_sampler_at_the_sampling_temperature(capsys):
    """On the real model (bundled SmolLM2-135M-Instruct, chat prompts, T = 0.8 as its configs
    sample): the learner's log-probs at T reproduce the sampler's; at T = 1 (the old behaviour)
    they do not. Prints the sizes measured (docs/RESULTS.md quotes them)."""
    from jaxprefix import sampling, tokenizers
    from jaxprefix.checkpoints.gguf import bundled_smollm2_path
    from jaxprefix.methods.prompting import ChatPrompts
    from jaxprefix.data.problem import Problem
    from jaxprefix.rl import dynamic_sampling

    path = bundled_smollm2_path()
    model, _ = from_gguf(path)
    prompts = ChatPrompts(tokenizers.load(path))
    questions = ["What is 17 * 23?", "Name the capital of France.", "Is 91 a prime number?",
                 "Write one sentence about rain."]
    contexts = [prompts.question(Problem(id=str(i), question=q, answer=""))
                for i, q in enumerate(questions)]
    rollouts = sampling.generate(model, contexts, n=4, max_new_tokens=32, temperature=0.8, seed=0)
    rewards = np.random.default_rng(0).uniform(size=(len(contexts), 4))  # every group kept
    batch = dynamic_sampling.build_batch(
        [rollouts], [np.asarray(objectives.group_advantages(rewards))],
        dynamic_sampling.select_groups([rewards], len(contexts)))
    mask = batch["completion_mask"] > 0
    deviation = {}
    for t in (0.8, 1.0):
        learner = Learner(model, TrainConfig(temperature=t))
        logp = np.asarray(learner.logprobs(learner.initial_params(), batch))
        deviation[t] = np.abs(logp - batch["old_logprobs"])[mask]
    with capsys.disabled():
        print(f"\nSmolLM2-135M, {int(mask.sum())} sampled tokens at T = 0.8: |learner - sampler| "
              f"log-prob at T = 0.8 mean {deviation[0.8].mean():.2e} max {deviation[0.8].max():.2e}"
              f"; at T = 1 mean {deviation[1.0].mean():.3f} max {deviation[1.0].max():.3f}, "
              f"ratio exp(dev) at T = 1 up to {np.exp(deviation[1.0].max()):.2f}")
    assert deviation[0.8].max() < 1e-2
    assert deviation[1.0].mean() > 10 * deviation[0.8].mean()
