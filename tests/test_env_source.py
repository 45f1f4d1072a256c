"""An external environment drives training: each round serves the policy live on 127.0.0.1
(serving/live.py), an environment runs its episodes against it through the openai client, and
the loop trains on what came back (serving/external.py, env_settings.py).

The environment is tests/fixtures/two_turn_env.py, a file as a user's would be: a chat turn
asks the question, then a token-in /v1/completions turn continues that conversation's exact ids
with a user turn asking to confirm; the reward is 1 for the right answer in the last turn plus a
bonus for a short one, in characters (so that a random policy's rewards vary within a group).
The policy is a tiny random llama over SmolLM2's vocabulary and chat template.
"""
import os

import numpy as np
import pytest
import tiny_checkpoints
from bounded import returns_within
from flax import nnx

from jaxprefix import models, run_config, tokenizers
from jaxprefix.checkpoints.gguf import bundled_smollm2_path
from jaxprefix.data.problem import Problem
from jaxprefix.errors import ConfigError
from jaxprefix.methods.grpo import GrpoMethod
from jaxprefix.methods.prompting import ChatPrompts
from jaxprefix.rewards import from_file
from jaxprefix.rl import loop, objectives, scoring
from jaxprefix.rl.metrics import read_metrics
from jaxprefix.run_setup import preflight
from jaxprefix.run_setup.learner_settings import loop_settings, reward_settings, validate
from jaxprefix.run_setup.run_settings import resolve
from jaxprefix.sampling import RolloutSpec
from jaxprefix.serving import external
from jaxprefix.serving.env_settings import EnvironmentSettings
from jaxprefix.serving.external import EpisodeResult, Turn, episode_of, turn_of
from jaxprefix.tools.episodes import ANSWER, TRUNCATED

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_NEW = 8
ENVIRONMENT = os.path.join(os.path.dirname(__file__), "fixtures", "two_turn_env.py")
PROBLEMS = [Problem(id=f"p{i}", question=f"What is {a}+{b}?", answer=str(a + b))
            for i, (a, b) in enumerate([(2, 3), (4, 6), (12, 9)])]


@pytest.fixture(scope="module")
def tokenizer():
    return tokenizers.load(bundled_smollm2_path())


@pytest.fixture(scope="module")
def model(tokenizer):
    return tiny_llama_over(tokenizer)


def tiny_llama_over(tokenizer):
    """A tiny random llama over SmolLM2's vocabulary (tests/tiny_checkpoints.save_llama_over's)."""
    return tiny_checkpoints.llama_over(tokenizer, max_position_embeddings=256)


@pytest.fixture
def source():
    source = f"{ENVIRONMENT}:make"
    _recorded(source).clear()
    return source


def _train(config, settings, method, model, tokenizer, tmp_path):
    """loop.train on the run's settings, three contexts a step, in tmp_path/run."""
    return loop.train(settings.loop, str(tmp_path / "run"), method=method, model=model,
                      tokenizer=tokenizer, stop_ids=[tokenizer.eos_id],
                      learner_config=validate(config, contexts_per_step=3),
                      rollout=settings.rollout, contexts_per_step=3,
                      episodes=scoring.episode_source(settings.tools, settings.environment,
                                                      tokenizer,
                                                      model.config.max_position_embeddings),
                      progress=False)


def _recorded(source):
    """The environment file's EPISODES (this process's copy of it)."""
    return from_file._module(from_file.load(source, "test").path).EPISODES


def _config(source, **train):
    """A GRPO run of 3 problems x 2 episodes a step through the environment `source`."""
    c = run_config.base_config()
    c.rollout.update(n=2, temperature=1.0, max_new_tokens=MAX_NEW)
    c.environment.source = source
    c.train.update(dict(problems_per_step=3, total_steps=1, learning_rate=1e-3,
                        micro_batch_size=0) | train)
    c.eval.every = 0
    c.checkpoint.every = 1
    return c


def sampled_through(config, model, tokenizer):
    """PROBLEMS, 2 episodes each, sampled and scored through config's environment."""
    external = EnvironmentSettings.from_config(config).episode_source(tokenizer, 256)
    request = scoring.RolloutRequest(
        contexts=[ChatPrompts(tokenizer).question(p) for p in PROBLEMS], problems=PROBLEMS,
        tags={}, n=2)
    return scoring.sample_and_score(model, tokenizer, request, reward_settings(config), seed=3,
                                    rollout=RolloutSpec.from_config(config.rollout),
                                    stop_ids=[tokenizer.eos_id],
                                    episodes=scoring.EpisodeSource(external, rewarded=True))


def test_rows_are_the_servers_tokens_and_logprobs_and_rewards_reach_the_advantage(
        model, tokenizer, source):
    config = _config(source)
    scored = sampled_through(config, model, tokenizer)
    seen = _recorded(source)
    assert len(seen) == 6 and all(s is not None for s in seen)
    # The rewards are the environment's, grouped n per problem in the episodes' order.
    assert [s[0].id for s in seen] == ["p0", "p0", "p1", "p1", "p2", "p2"]
    np.testing.assert_array_equal(scored.rewards,
                                  np.float32([s[3] for s in seen]).reshape(3, 2))
    assert scored.rewards.std() > 0  # the brevity bonus varies
    _, batch = loop._batch([scored], loop_settings(config))
    advantages = np.asarray(objectives.group_advantages(scored.rewards, "grpo")).reshape(-1)
    np.testing.assert_allclose(batch["advantages"], advantages, rtol=1e-6)
    assert np.abs(batch["advantages"]).max() > 0
    for row, (_, first, second, _) in enumerate(seen):
        prompt1, sampled1 = first.prompt_token_ids, first.choices[0].token_ids
        prompt2, sampled2 = second.choices[0].prompt_token_ids, second.choices[0].token_ids
        # The second turn's prompt continues the first turn's ids (the environment wrote it so).
        assert prompt2[:len(prompt1)] == prompt1
        expected = prompt2 + sampled2
        length = len(expected)
        assert batch["token_mask"][row].sum() == length
        np.testing.assert_array_equal(batch["tokens"][row, :length], expected)
        # Loss only on the two policy turns' tokens, as the server returned them.
        mask = np.zeros(length, np.float32)
        start1 = len(prompt1)
        assert prompt2[start1:start1 + len(sampled1)] == sampled1
        mask[start1:start1 + len(sampled1)] = 1
        mask[len(prompt2):] = 1
        np.testing.assert_array_equal(batch["completion_mask"][row, :length], mask)
        assert batch["completion_mask"][row, length:].sum() == 0
        logprobs = np.zeros(length, np.float32)
        logprobs[start1:start1 + len(sampled1)] = [
            c.logprob for c in first.choices[0].logprobs.content]
        logprobs[len(prompt2):] = second.choices[0].logprobs.token_logprobs
        np.testing.assert_allclose(batch["old_logprobs"][row, :length], logprobs, rtol=1e-6)
    # ... and they are the policy's own: the learner's teacher-forced log-probs of the rows
    # (temperature 1) agree on every policy token, so the first ratio is 1.
    forced, _ = models.token_logprobs(model, batch["tokens"], batch["token_mask"])
    policy = batch["completion_mask"] > 0
    np.testing.assert_allclose(np.asarray(forced)[policy], batch["old_logprobs"][policy],
                               atol=2e-3)


def test_a_grpo_step_of_the_loop_trains_on_the_environment(model, tokenizer, source, tmp_path):
    """loop.train, one GRPO step: the method's problems run as the environment's episodes
    against the live server, its rewards in the metrics, the update made (the policy moved);
    then the evaluation, sampled and greedy, runs its problem through the environment too."""
    config = _config(source)
    config.eval.update(every=1, greedy=True)
    settings = resolve(config)
    assert settings.environment.source == source
    method = GrpoMethod(ChatPrompts(tokenizer), PROBLEMS, problems_per_step=3, n=2, seed=0,
                        eval_problems=PROBLEMS[2:], eval_n=3)
    before = {k: np.asarray(v) for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    result = _train(config, settings, method, model, tokenizer, tmp_path)
    assert result["step"] == 1
    seen = _recorded(source)
    assert len(seen) == 6 + 3 + 1
    training, evaluation, greedy = seen[:6], seen[6:9], seen[9:]
    assert sorted(s[0].id for s in training) == ["p0", "p0", "p1", "p1", "p2", "p2"]
    assert [s[0].id for s in evaluation + greedy] == ["p2"] * 4
    (record,) = read_metrics(str(tmp_path / "run"))
    np.testing.assert_allclose(record["reward/mean"], np.mean([s[3] for s in training]),
                               rtol=1e-5)
    np.testing.assert_allclose(record["eval/reward_mean"], np.mean([s[3] for s in evaluation]),
                               rtol=1e-5)
    np.testing.assert_allclose(record["eval/pass@1"],
                               np.mean([s[3] > 0.5 for s in evaluation]), rtol=1e-5)
    np.testing.assert_allclose(record["eval_greedy/reward_mean"], greedy[0][3], rtol=1e-5)
    assert record["rollout/turns_mean"] == 2.0
    assert record["tokens/generated"] == sum(len(r.choices[0].token_ids)
                                             for s in training for r in s[1:3])
    assert np.isfinite(record["loss"])
    trained = nnx.state(result["learner"].sampling_model(result["state"], None), nnx.Param)
    moved = [k for k, v in nnx.to_flat_state(trained)
             if not np.allclose(np.asarray(v), before[k])]
    assert moved, "one update on nonzero advantages changed no weight"


def test_a_turn_that_does_not_extend_the_episode_is_refused():
    first = Turn((1, 2, 3), (4, 5), (-0.5, -0.25), "stop")
    ok = Turn((1, 2, 3, 4, 5, 6), (7,), (-1.0,), "length")
    episode = episode_of([first, ok], group=1)
    np.testing.assert_array_equal(episode.tokens, [1, 2, 3, 4, 5, 6, 7])
    np.testing.assert_array_equal(episode.sampled, [0, 0, 0, 1, 1, 0, 1])
    np.testing.assert_allclose(episode.logprobs, [0, 0, 0, -0.5, -0.25, 0, -1.0])
    assert (episode.turn_starts, episode.ended, episode.group) == ((3, 6), TRUNCATED, 1)
    assert episode.reprefilled == 5  # the server prefilled the first turn again
    assert episode_of([first], group=0).ended == ANSWER
    retokenized = Turn((1, 2, 3, 9, 5, 6), (7,), (-1.0,), "stop")
    with pytest.raises(ValueError, match="turn 2 of an episode: its prompt does not begin with "
                                         "the episode so far .they differ at token 3 of 5"):
        episode_of([first, retokenized], group=0)


def test_a_turn_without_token_ids_or_logprobs_is_refused():
    response = {"choices": [{"token_ids": [4, 5], "finish_reason": "stop",
                             "logprobs": {"content": [{"logprob": -0.5}, {"logprob": -0.25}]}}],
                "prompt_token_ids": [1, 2, 3]}
    assert turn_of(response) == Turn((1, 2, 3), (4, 5), (-0.5, -0.25), "stop")
    with pytest.raises(ValueError, match="without token ids"):
        turn_of({**response, "prompt_token_ids": None})
    del response["choices"][0]["logprobs"]
    with pytest.raises(ValueError, match="without a log-prob per token"):
        turn_of(response)


def test_settings_refuse_what_an_environment_cannot_run(source, tmp_path):
    with pytest.raises(ValueError, match="expected method=grpo"):
        c = _config(source)
        c.method = "pope"
        resolve(c)
    with pytest.raises(ValueError, match="expected rollout.max_turns=1"):
        c = _config(source)
        c.rollout.max_turns = 2
        c.tools.names = ("calculator",)
        resolve(c)
    with pytest.raises(ValueError, match="has no function 'missing'"):
        EnvironmentSettings(source=source.replace(":make", ":missing"))
    (tmp_path / "wrong.py").write_text("def make(tokenizer):\n    return object()\n")
    with pytest.raises(ValueError, match="expected an object with `async def run_episode"):
        EnvironmentSettings(source=f"{tmp_path}/wrong.py:make").environment(None)
    # The rl job's preflight builds it over the policy's tokenizer, before any work.
    c = run_config.from_file(os.path.join(ROOT, "configs", "grpo.py"), "smoke")
    c.environment.source = f"{tmp_path}/wrong.py:make"
    with pytest.raises(ConfigError, match="returned object, expected an object with `async"):
        preflight.check(c, str(tmp_path / "run"))
    c.environment.source = source
    assert preflight.check(c, str(tmp_path / "run")).environment.source == source


class _Colder:
    """An environment that asks for another temperature than the run samples at."""

    async def run_episode(self, client, model, problem, sampling_args):
        response = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": problem.question}],
            **dict(sampling_args, temperature=0.5))
        return EpisodeResult([response], 1.0)


def test_a_request_for_other_sampling_than_the_runs_is_refused(model, tokenizer):
    """The learner scores the run's temperature: a request for another is a 400, and the round
    fails naming it rather than training on log-probs of another distribution."""
    keywords = RolloutSpec(temperature=1.0, max_new_tokens=4).sampler_keywords()
    with pytest.raises(external.EnvironmentFailed, match="BadRequestError: .*temperature=0.5: "
                                                         "this server samples a policy in "
                                                         "training"):
        external.rollout(_Colder(), model, PROBLEMS[:1], tokenizer=tokenizer,
                         context_length=256, n=1, stop_ids=[tokenizer.eos_id], seed=0,
                         **keywords)


def test_sampling_ahead_runs_the_environment_on_the_sampler_thread(model, tokenizer, source,
                                                                   tmp_path):
    """train.max_staleness=1: the sampler thread (rl/overlap.py) serves the policy and runs the
    episodes, a step ahead of the learner; two steps, each its own six episodes, rewards and
    metrics row."""
    config = _config(source, total_steps=2, max_staleness=1)
    settings = resolve(config)
    method = GrpoMethod(ChatPrompts(tokenizer), PROBLEMS, problems_per_step=3, n=2, seed=0)
    result = _train(config, settings, method, model, tokenizer, tmp_path)
    assert result["step"] == 2
    seen = _recorded(source)
    assert len(seen) == 12 and all(s is not None for s in seen)
    records = read_metrics(str(tmp_path / "run"))
    assert [r["step"] for r in records] == [1, 2]
    for record, episodes in zip(records, (seen[:6], seen[6:])):
        np.testing.assert_allclose(record["reward/mean"], np.mean([s[3] for s in episodes]),
                                   rtol=1e-5)


@pytest.mark.slow  # minutes on 2 cores: SmolLM2-135M's sampling and update
@pytest.mark.parametrize("fixture,devices", [("two_turn_env.py", 8), ("verifiers_math_env.py", 1)],
                         ids=["openai_client", "verifiers"])
def test_smollm2_grpo_step_through_the_environment(tmp_path, fixture, devices):
    """The rl job as docs/TOOLS.md prints it, cut to one step without evaluation: SmolLM2-135M-
    Instruct (the bundled GGUF) on gsm_symbolic, 2 problems x 4 episodes of the fixture's two
    turns against the live server (an environment of the openai client's, or a verifiers v1
    one), GRPO (dr_grpo) on what came back. The first on the suite's 8 simulated devices, the
    weights and Adam's moments sharded over them (fsdp): the server's sampler calls decode
    under that mesh (with data parallelism, the default, each of the 8 holds them whole: past
    19 GB on one host); the second on one device, as the command runs outside the tests."""
    import subprocess
    import sys

    count = "--xla_force_host_platform_device_count"
    flags = " ".join([f for f in os.environ.get("XLA_FLAGS", "").split()
                      if not f.startswith(count)] + [f"{count}={devices}"])
    mesh = ["--config.mesh.data=1", "--config.mesh.fsdp=-1"] if devices > 1 else []
    result = subprocess.run(
        [sys.executable, "-m", "jaxprefix.main", "--config=configs/grpo.py:smollm2",
         f"--workdir={tmp_path}",
         f"--config.environment.source={os.path.join(os.path.dirname(ENVIRONMENT), fixture)}:make",
         "--config.train.total_steps=1", "--config.rollout.max_new_tokens=64",
         "--config.eval.every=0", "--config.checkpoint.every=1", *mesh],
        cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=flags),
        capture_output=True, text=True, timeout=1800)
    assert result.returncode == 0, f"exit {result.returncode}:\n{result.stderr[-4000:]}"
    (record,) = read_metrics(str(tmp_path))
    assert record["rollout/turns_mean"] == 2.0
    assert record["tokens/generated"] > 0 and np.isfinite(record["loss"])
    assert 0.0 <= record["reward/mean"] <= 1.5


STALLED = os.path.join(os.path.dirname(__file__), "fixtures", "stalled_env.py")


@pytest.mark.parametrize("name", ["make", "make_blocking"], ids=["awaits", "blocks_its_loop"])
def test_an_episode_that_never_ends_stops_the_round_in_one_line_at_its_deadline(
        model, tokenizer, name):
    """A hung environment: an episode past config.environment.episode_timeout_s ends the round
    with EpisodeStalled naming the problem, the seconds and the field, whether it awaits forever
    or blocks its event loop."""
    import time

    config = _config(f"{STALLED}:{name}")
    config.environment.episode_timeout_s = 1.0
    start = time.monotonic()
    with pytest.raises(external.EpisodeStalled,
                       match=r"^a round of 6 episodes \(one blocks the event loop, .*\) did "
                             r"not end within 2 s .*; raise config.environment.episode_timeout_s "
                             r"if its episodes take longer$"
                       if name == "make_blocking" else
                       r"^an episode of problem 'p\d' did not end within 1 s .*; raise "
                       r"config.environment.episode_timeout_s if its episodes take longer$"):
        returns_within(60, sampled_through, config, model, tokenizer)
    assert time.monotonic() - start < 60  # the server's start and stop included


class _Garbage:
    """An environment whose episode comes back as something else than an EpisodeResult."""

    async def run_episode(self, client, model, problem, sampling_args):
        return {"reward": 1.0}


class _Dies:
    """An environment that fails mid-episode (its process gone, say), after a real turn."""

    async def run_episode(self, client, model, problem, sampling_args):
        await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": problem.question}],
            **sampling_args)
        raise ConnectionResetError("the environment's process went away")


@pytest.mark.parametrize("environment,why", [
    (_Garbage(), r"episode 0 \(problem .*\) came back malformed: TypeError: run_episode returned "
                 r"dict"),
    (_Dies(), r"an episode of problem .* raised: ConnectionResetError: the environment's process "
              r"went away"),
])
def test_a_garbage_or_dying_environment_ends_the_round_in_one_line(model, tokenizer, environment,
                                                                   why):
    from jaxprefix import errors

    keywords = RolloutSpec(temperature=1.0, max_new_tokens=4).sampler_keywords()
    with pytest.raises(external.EnvironmentFailed, match=why) as failed:
        external.rollout(environment, model, PROBLEMS[:1], tokenizer=tokenizer,
                         context_length=256, n=1, stop_ids=[tokenizer.eos_id], seed=0,
                         **keywords)
    line = errors.one_line(failed.value)
    assert line.startswith("error: ") and "\n" not in line
