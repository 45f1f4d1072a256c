"""Routing replay over multi-turn tool episodes, on a tiny random MoE in f32 with the calculator
(every turn read as a call, so every episode has observations): each episode's tokens carry
the experts the sampler computed them with, the KV-kept rollout's equal to the reference's and
to the model's own teacher-forced forward of the final sequence; the learner replays them; a
GRPO step on MoE episodes runs with train.routing_replay 'auto'. All slow: the continuous
decode's turn program of a MoE alone takes ~40 s to compile on 2 loaded cores (the episodes'
routes reaching the learner and replayed: test_moe.py, default suite)."""
import dataclasses
import string

import numpy as np
import pytest
from flax import nnx

from jaxprefix.models import Decoder
from jaxprefix.rl import boundaries, loop
from jaxprefix.rl.train_step import Learner
from jaxprefix.sampling import budget
from jaxprefix.tokenizers import CharTokenizer
from jaxprefix.tools.episodes import BUDGET, reprefilled_tokens
from test_moe import TINY, recorded_routes_expected
from test_routing_replay import replayed_logprobs
from test_tool_episodes import _config, _scored, train_one_step
from tests.calculator_policy import CONVERSATIONS, TEMPLATE


@pytest.fixture(scope="module")
def moe():
    """A tiny random MoE (test_moe's, two sparse layers) on test_tool_episodes' characters."""
    tokenizer = CharTokenizer(sorted(set(string.printable) - set(string.whitespace) | {" "}))
    tokenizer.chat_template = TEMPLATE
    config = dataclasses.replace(TINY, vocab_size=tokenizer.vocab_size, num_layers=2,
                                 mlp_only_layers=())
    contexts = [tokenizer.encode(f"u:{q}<eos>a:") for q, *_ in CONVERSATIONS]
    return Decoder(config, rngs=nnx.Rngs(0)), tokenizer, contexts


ENVIRONMENT = '''
from jaxprefix.tools import environments
from jaxprefix.tools.calls import ToolCall


def every_turn_calls(tokenizer, tools):
    """The chat environment with every turn read as a call of the calculator."""
    def parse(text):
        return [ToolCall("calculator", {"expression": f"{len(text)}*3"})]
    return environments.Environment(tools, parse, environments.chat(tokenizer, tools).observe)
'''


def _fed(token_mask):
    """Every token but each row's last (never fed, so never routed)."""
    return token_mask & np.pad(token_mask[:, 1:], ((0, 0), (0, 1)))


def _episode_config(tmp_path):
    """The calculator RL config (test_tool_episodes) on the MoE's random text: KV-kept
    episodes of up to 3 turns of up to 8 tokens at T = 1, 48 tokens in all, every turn a
    call."""
    (tmp_path / "env.py").write_text(ENVIRONMENT)
    config = _config(tmp_path, rollout="kv_kept", episode_token_budget=48,
                     environment=f"{tmp_path}/env.py:every_turn_calls")
    config.rollout.update(max_new_tokens=8, temperature=1.0)
    return config


@pytest.fixture(scope="module")
def scored(moe, tmp_path_factory):
    """KV-kept episodes of 3 turns, every turn a call, some cut by their budget."""
    return _scored(moe, _episode_config(tmp_path_factory.mktemp("config")), seed=1,
                   record_routes=True)


@pytest.mark.slow  # the KV-kept rollout's compile: ~1 minute on 2 loaded cores
def test_kv_kept_episodes_carry_the_experts_of_the_models_own_forward(moe, scored):
    """Every token of every episode but its last (prompt, observations, sampled turns) carries
    the experts the model's teacher-forced forward of the whole episode routes it to (f32: the
    prefill, appending passes and decode steps route as the full forward does here)."""
    assert all(e.turns == 3 and e.tool_calls >= 1 for e in scored.episodes)
    assert any(e.ended == BUDGET for e in scored.episodes)
    rows = scored.rollouts
    assert rows.routes.shape == (*rows.tokens.shape, 2, 2) and rows.routes.dtype == np.int8
    np.testing.assert_array_equal(rows.routes, recorded_routes_expected(moe[0], rows.tokens,
                                                                        rows.token_mask))


@pytest.mark.slow  # two more rollouts, each compiled: ~2 minutes on 2 loaded cores
def test_the_reference_and_a_preempted_kv_kept_rollout_record_the_same_routes(moe, scored,
                                                                              tmp_path):
    """The re-prefilling reference (each token keeps its first forward's experts) and a KV-kept
    rollout whose rows are preempted and replay their earlier turns (every row in flight on 8
    pages of 16 tokens, one promised to each) record the same routes as the KV-kept rollout."""
    config = _episode_config(tmp_path)
    token = budget.page_bytes_per_token(moe[0].config, "float32")
    preempted = _scored(moe, config, seed=1, record_routes=True, max_rows_in_flight=6,
                        page_size=16, reserve_fraction=1 / 8,
                        kv_budget_bytes=(4 * 16 + 8 * 16) * token)
    assert sum(reprefilled_tokens(e) for e in preempted.episodes) > 0  # replayed
    config.tools.rollout = "reference"
    reference = _scored(moe, config, seed=1, record_routes=True)
    for other in (preempted, reference):
        assert [e.tokens.tolist() for e in other.episodes] == \
            [e.tokens.tolist() for e in scored.episodes]
        np.testing.assert_array_equal(other.rollouts.routes, scored.rollouts.routes)


@pytest.mark.slow  # the KV-kept rollout's compile: ~1 minute on 2 loaded cores
def test_the_learner_replays_sampled_episodes_as_the_sampler_computed_them(moe, scored,
                                                                           tmp_path):
    """The loop's own path (sample_and_score with record_routes, then _batch): every token but
    each row's last has its experts, and the learner's log-probs replaying them are the
    sampler's (f32) and are replayed (test_moe.replayed_logprobs)."""
    _, batch = loop._batch([scored], _episode_config(tmp_path).train)
    boundaries.check_batch(batch)
    assert ((batch["routes"] >= 0).all(axis=(2, 3)) == _fed(batch["token_mask"])).all()
    loss = batch["completion_mask"] > 0
    replayed = replayed_logprobs(moe[0], batch)
    np.testing.assert_allclose(replayed[loss], batch["old_logprobs"][loss], atol=1e-5, rtol=0)


@pytest.mark.slow  # its sampler's and update's compiles: ~2.5 minutes on 2 loaded cores
def test_a_grpo_step_on_moe_episodes_replays_their_routes(moe, tmp_path, monkeypatch):
    """loop.train on the MoE with 3-turn episodes (KV-kept) and train.routing_replay left at
    'auto': the step's batch carries every token's experts, observations included, and the
    update runs on it."""
    model, tokenizer, _ = moe
    config = _episode_config(tmp_path)
    assert config.train.routing_replay == "auto"
    batches = []
    update = Learner.update
    monkeypatch.setattr(Learner, "update", lambda self, state, batch: (
        batches.append(batch), update(self, state, batch))[1])
    record = train_one_step(model, tokenizer, config, str(tmp_path / "run"))
    assert record["rollout/tool_calls"] >= 6 and np.isfinite(record["loss"])
    (batch,) = batches
    mask = batch["token_mask"]
    assert ((batch["routes"] >= 0).all(axis=(2, 3)) == _fed(mask)).all()
