"""A verifiers v1 environment drives training (jaxprefix/serving/verifiers_env.py): each round
serves the policy live on 127.0.0.1, verifiers' training client renders every turn with the
policy's tokenizer and samples it from the server's /inference/v1/generate, and the loop trains
on the episode's turns as its trace recorded them, rewarded by the task's @vf.reward.

The environment is tests/fixtures/verifiers_math_env.py (two chat turns: the question, then a
user turn asking to confirm). verifiers comes with the test extra (and the `verifiers` extra);
it pins openai<3, which the server's own tests take too. The policy is a tiny random llama
over SmolLM2's vocabulary and chat template, as in tests/test_env_source.py.
"""
import os

import numpy as np
import pytest
from flax import nnx

from test_env_source import PROBLEMS, _config, _train, sampled_through, tiny_llama_over

from jaxprefix import models, tokenizers
from jaxprefix.checkpoints.gguf import bundled_smollm2_path
from jaxprefix.methods.grpo import GrpoMethod
from jaxprefix.methods.prompting import ChatPrompts
from jaxprefix.rewards import from_file
from jaxprefix.rl import loop, objectives
from jaxprefix.rl.metrics import read_metrics
from jaxprefix.run_setup.learner_settings import loop_settings
from jaxprefix.run_setup.run_settings import resolve

ENVIRONMENT = os.path.join(os.path.dirname(__file__), "fixtures", "verifiers_math_env.py")
SOURCE = f"{ENVIRONMENT}:make"  # the tiny policy, problems and run: tests/test_env_source.py's


@pytest.fixture(scope="module")
def tokenizer():
    return tokenizers.load(bundled_smollm2_path())


@pytest.fixture(scope="module")
def model(tokenizer):
    return tiny_llama_over(tokenizer)


@pytest.fixture
def served(monkeypatch):
    """What the server answered each /inference/v1/generate of verifiers' client (renderers'
    generate: the prompt ids, the sampled ids, their log-probs, the parsed reply); the fixture's
    EPISODES cleared."""
    import renderers.client

    calls, generate = [], renderers.client.generate

    async def recorded(**keywords):
        result = await generate(**keywords)
        calls.append(result)
        return result

    monkeypatch.setattr(renderers.client, "generate", recorded)
    from_file._module(from_file.load(SOURCE, "test").path).EPISODES.clear()
    return calls


def _scored():
    """(problem id, last reply, reward) of each episode, as the task's reward saw them."""
    return from_file._module(from_file.load(SOURCE, "test").path).EPISODES


def test_rows_are_the_servers_tokens_and_logprobs_and_rewards_the_tasks(model, tokenizer,
                                                                       served):
    config = _config(SOURCE)
    scored = sampled_through(config, model, tokenizer)
    assert len(served) == 12 and len(_scored()) == 6  # two turns an episode
    _, batch = loop._batch([scored], loop_settings(config))
    advantages = np.asarray(objectives.group_advantages(scored.rewards, "grpo")).reshape(-1)
    np.testing.assert_allclose(batch["advantages"], advantages, rtol=1e-6)
    ends = {tuple(c["prompt_ids"] + c["completion_ids"]): c for c in served}
    for row in range(6):
        length = int(batch["token_mask"][row].sum())
        tokens = tuple(int(t) for t in batch["tokens"][row, :length])
        second = ends[tokens]  # the row ends with a turn as the server sampled it ...
        (first,) = [c for c in served if c is not second and tokens[:len(c["prompt_ids"]) + len(
            c["completion_ids"])] == tuple(c["prompt_ids"] + c["completion_ids"])]
        # ... and its first turn is a prefix of the second's prompt (one sequence).
        assert len(first["prompt_ids"]) < len(second["prompt_ids"])
        mask = np.zeros(length, np.float32)
        logprobs = np.zeros(length, np.float32)
        for turn in (first, second):
            start = len(turn["prompt_ids"])
            mask[start:start + len(turn["completion_ids"])] = 1
            logprobs[start:start + len(turn["completion_ids"])] = turn["completion_logprobs"]
        np.testing.assert_array_equal(batch["completion_mask"][row, :length], mask)
        np.testing.assert_allclose(batch["old_logprobs"][row, :length], logprobs, rtol=1e-6)
        # The row's reward is the one the task's @vf.reward gave the episode of this reply.
        (reward,) = [r for pid, reply, r in _scored()
                     if pid == PROBLEMS[row // 2].id and reply == second["content"].strip()]
        np.testing.assert_allclose(scored.rewards.reshape(-1)[row], reward, rtol=1e-6)
    assert scored.rewards.std() > 0
    # The server's log-probs are the policy's: the learner's teacher-forced ones agree.
    forced, _ = models.token_logprobs(model, batch["tokens"], batch["token_mask"])
    policy = batch["completion_mask"] > 0
    np.testing.assert_allclose(np.asarray(forced)[policy], batch["old_logprobs"][policy],
                               atol=2e-3)


def test_grpo_steps_of_the_loop_train_on_the_verifiers_environment(model, tokenizer, served,
                                                                   tmp_path):
    """loop.train, two GRPO steps: each round (an event loop of its own) runs the method's
    problems as the environment's episodes against the live server; the task's rewards are the
    metrics', the server's sampled tokens the count generated, and the update moves the policy."""
    config = _config(SOURCE, total_steps=2)
    settings = resolve(config)
    method = GrpoMethod(ChatPrompts(tokenizer), PROBLEMS, problems_per_step=3, n=2, seed=0)
    before = {k: np.asarray(v) for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    result = _train(config, settings, method, model, tokenizer, tmp_path)
    assert result["step"] == 2
    records = read_metrics(str(tmp_path / "run"))
    assert [r["step"] for r in records] == [1, 2] and len(served) == 24
    for k, record in enumerate(records):
        scored, calls = _scored()[6 * k:6 * k + 6], served[12 * k:12 * k + 12]
        assert sorted(pid for pid, _, _ in scored) == ["p0", "p0", "p1", "p1", "p2", "p2"]
        np.testing.assert_allclose(record["reward/mean"], np.mean([r for _, _, r in scored]),
                                   rtol=1e-5)
        assert record["rollout/turns_mean"] == 2.0
        assert record["tokens/generated"] == sum(len(c["completion_ids"]) for c in calls)
        assert np.isfinite(record["loss"])
    trained = nnx.state(result["learner"].sampling_model(result["state"], None), nnx.Param)
    moved = [k for k, v in nnx.to_flat_state(trained)
             if not np.allclose(np.asarray(v), before[k])]
    assert moved, "two updates on nonzero advantages changed no weight"
