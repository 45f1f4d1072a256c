"""Routing replay on a tiny MoE (train.routing_replay): replaying the model's own routes changes
nothing, forcing others changes the log-probs, the sampler's recorded routes follow their rows
into the learner, and episodes' routes reach it too (their sampling: test_episode_replay.py)."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxprefix.models import token_logprobs
from jaxprefix.rl import boundaries, dynamic_sampling
from jaxprefix.rl.train_config import TrainConfig
from jaxprefix.rl.train_step import Learner
from jaxprefix.sampling import generate
from jaxprefix.tools.episodes import ANSWER, Episode, as_rollouts
from test_moe import TINY, recorded_routes_expected, tiny_moe

def test_replaying_the_models_own_routes_changes_nothing():
    model = tiny_moe()
    tokens = jnp.asarray(np.random.default_rng(1).integers(1, 64, (3, 10)), jnp.int32)
    mask = jnp.ones(tokens.shape, bool)
    routes = nnx.jit(lambda m, t: m.route(t))(model, tokens)
    assert routes.shape == (3, 10, 2, 2)  # two sparse layers (layer 1 is dense), top-2

    def loss(m, routes):
        return token_logprobs(m, tokens, mask, routes=routes)[0].sum()
    grad = nnx.jit(nnx.value_and_grad(loss))
    free, free_grads = grad(model, None)
    replayed, replay_grads = grad(model, routes)
    np.testing.assert_allclose(float(replayed), float(free), rtol=1e-7)
    for a, b in zip(jax.tree.leaves(free_grads), jax.tree.leaves(replay_grads)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-7, rtol=1e-6)
    # Gate weights come from the router over the replayed experts: the router still learns.
    assert np.abs(np.asarray(replay_grads.router[...])).max() > 0


def test_replay_forcing_other_experts_changes_the_logprobs():
    model = tiny_moe()
    tokens = jnp.asarray(np.random.default_rng(2).integers(1, 64, (2, 8)), jnp.int32)
    mask = jnp.ones(tokens.shape, bool)
    own = np.asarray(nnx.jit(lambda m, t: m.route(t))(model, tokens))
    other = (own + 1) % TINY.num_experts  # every token forced to other experts
    logp = nnx.jit(lambda m, r: token_logprobs(m, tokens, mask, routes=r)[0])
    assert np.abs(np.asarray(logp(model, own)) - np.asarray(logp(model, other))).max() > 1e-3


def test_sampler_routes_follow_their_rows_and_the_learner_replays_them():
    """Rollouts of two sampler calls, their groups reordered by build_batch: each batch row's
    routes are its own tokens' experts; the learner's log-probs replaying them equal those
    without replay and the sampler's (f32: sampler and learner agree), forcing other experts
    changes them, and an update with replay is the update without."""
    model = tiny_moe()
    rng = np.random.default_rng(3)
    contexts = [rng.integers(3, 64, size=n).tolist() for n in (4, 9, 6, 7)]
    request = dict(n=2, max_new_tokens=10, stop_ids=(5, 9, 17), temperature=1.0,
                   record_routes=True)
    chunks = [generate(model, contexts[:2], seed=1, **request),
              generate(model, contexts[2:], seed=2, **request)]
    selection = dynamic_sampling.GroupSelection(picks=[(1, 1), (0, 0), (1, 0), (0, 1)],
                                                trainable=np.ones(4, bool),
                                                zero_variance_fraction=0.0)
    advantages = [rng.normal(size=(2, 2)).astype(np.float32) for _ in chunks]
    batch = dynamic_sampling.build_batch(chunks, advantages, selection)
    boundaries.check_batch(batch)
    np.testing.assert_array_equal(batch['routes'],
                                  recorded_routes_expected(model, batch['tokens'],
                                                           batch['token_mask']))
    free = {k: v for k, v in batch.items() if k != 'routes'}
    learner = Learner(model, TrainConfig(learning_rate=1e-3, micro_batch_size=4))
    state = learner.init_state()
    replayed = np.asarray(learner.logprobs(state.params, batch))
    np.testing.assert_allclose(replayed, np.asarray(learner.logprobs(state.params, free)),
                               atol=1e-6, rtol=0)
    np.testing.assert_allclose(replayed * batch['completion_mask'], batch['old_logprobs'],
                               atol=1e-5, rtol=0)
    others = np.where(batch['routes'] >= 0, (batch['routes'] + 1) % TINY.num_experts, -1)
    forced = np.asarray(learner.logprobs(state.params, {**batch, 'routes': others}))
    assert np.abs(forced - replayed).max() > 1e-3
    (with_replay, metrics), (without, free_metrics) = (
        learner.update(learner.init_state(), b) for b in (batch, free))
    np.testing.assert_allclose(metrics['loss'], free_metrics['loss'], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(with_replay.params), jax.tree.leaves(without.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, rtol=0)


def replayed_logprobs(model, batch) -> np.ndarray:
    """The learner's log-probs of `batch` replaying its routes, checked: equal to those without
    replay (every expert -1, the router's own choice: one program for all three; f32, and the
    recorded experts are the ones the learner's router picks), other experts forced everywhere
    change them, and forced on the observations alone they change the sampled tokens after
    each row's first observation and nothing before it."""
    learner = Learner(model, TrainConfig(learning_rate=1e-3, micro_batch_size=0))
    params = learner.init_state().params
    mask, loss, routes = batch['token_mask'], batch['completion_mask'] > 0, batch['routes']

    def forced(where):  # other experts than the recorded ones where `where` (-1 stays -1)
        other = np.where(where[..., None, None] & (routes >= 0), (routes + 1) % TINY.num_experts,
                         routes)
        return np.asarray(learner.logprobs(params, {**batch, 'routes': other}))
    replayed = forced(np.zeros_like(mask))
    off = np.asarray(learner.logprobs(params, {**batch, 'routes': np.full_like(routes, -1)}))
    np.testing.assert_allclose(replayed, off, atol=1e-6, rtol=0)
    assert np.abs(forced(mask) - replayed)[loss].max() > 1e-3
    columns = np.arange(mask.shape[1])[None]
    observations = mask & ~loss & (columns >= loss.argmax(axis=1)[:, None])
    assert observations.any(axis=1).all()
    changed = np.abs(forced(observations) - replayed) > 1e-4
    after = columns > observations.argmax(axis=1)[:, None]
    assert changed[loss & after].mean() > 0.5 and not changed[~after].any()
    return replayed


def episodes_with_own_routes(model, groups: int, n: int) -> list[Episode]:
    """Episodes (tools/episodes.py) of two turns of random tokens (prompt, a call, its
    observation, an answer), each token's routes its own in the model's forward of the whole
    (-1 on the last), as a sampler records them."""
    rng, episodes = np.random.default_rng(0), []
    for group in range(groups * n):
        spans = [(int(rng.integers(3, 7)), 0), (int(rng.integers(2, 6)), 1),
                 (int(rng.integers(3, 6)), 0), (int(rng.integers(2, 6)), 1)]
        sampled = np.concatenate([np.full(k, s, np.int32) for k, s in spans])
        starts = np.cumsum([k for k, _ in spans])
        episodes.append(Episode(
            rng.integers(1, model.config.vocab_size, len(sampled)).astype(np.int32), sampled,
            np.zeros(len(sampled), np.float32), int(starts[0]), (int(starts[0]), int(starts[2])),
            1, 0, ANSWER, group // n))
    rows = as_rollouts(episodes, n)
    routes = recorded_routes_expected(model, rows.tokens, rows.token_mask).astype(np.int8)
    return [dataclasses.replace(e, routes=r[:len(e.tokens)]) for e, r in zip(episodes, routes)]


def test_episode_routes_reach_the_learner_and_are_replayed():
    """Episodes laid out as rows (as_rollouts) and batched (build_batch, groups reordered) keep
    each token's routes at its position, and the learner replays them over the observations
    and later turns as over the first."""
    model = tiny_moe()
    episodes = episodes_with_own_routes(model, groups=3, n=2)
    selection = dynamic_sampling.GroupSelection(picks=[(0, 2), (0, 0), (0, 1)],
                                                trainable=np.ones(3, bool),
                                                zero_variance_fraction=0.0)
    batch = dynamic_sampling.build_batch([as_rollouts(episodes, 2)],
                                         [np.ones((3, 2), np.float32)], selection)
    boundaries.check_batch(batch)
    for row, e in enumerate(episodes[4:] + episodes[:4]):
        np.testing.assert_array_equal(batch['routes'][row, :len(e.tokens)], e.routes)
        assert (batch['routes'][row, len(e.tokens):] == -1).all()
    replayed_logprobs(model, batch)


