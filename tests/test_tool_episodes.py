"""Multi-turn episodes with a real tool: the re-prefilling reference rollout, and the KV-kept one
(rows leave the continuous decode for their tools) that must equal it.

The policy is tests/calculator_policy.py's: a tiny Decoder trained to call the calculator on
arithmetic questions, read the observation and answer; greedy rollouts really parse calls, run
the calculator and append its turn.
"""
import threading
import time

import numpy as np
import pytest
from flax import nnx

from jaxprefix import run_config, tools
from jaxprefix.data.problem import Problem
from jaxprefix.methods.grpo import GrpoMethod
from jaxprefix.methods.prompting import TaskPrompts
from jaxprefix.models import make_mesh, shard_model, token_logprobs
from jaxprefix.rl import loop, scoring
from jaxprefix.run_setup.learner_settings import loop_settings, reward_settings, validate
from jaxprefix.rl.dynamic_sampling import GroupSelection, build_batch
from jaxprefix.rl.metrics import read_metrics
from jaxprefix.rl.train_config import TrainConfig
from jaxprefix.rl.train_step import Learner
from jaxprefix.sampling import RolloutSpec, continuous, turns
from jaxprefix.sampling.layout import MIN_NEW_TOKENS_BUCKET, bucket
from jaxprefix.tools.calculator import CALCULATOR
from jaxprefix.tools.calls import ToolCall
from jaxprefix.tools.episodes import ANSWER, BUDGET, MAX_TURNS, as_rollouts, \
    episode_metrics, reprefilled_tokens, rollout_episodes, sampler_tokens
from jaxprefix.tools.observations import observation_tokens
from jaxprefix.tools.settings import ToolSettings

from tests.calculator_policy import CALL, CONVERSATIONS, MAX_NEW, conversation_text, \
    train_calculator_policy


@pytest.fixture(scope="module")
def policy():
    return train_calculator_policy()


def _rollout(policy, **overrides):
    model, tokenizer, contexts = policy
    kwargs = dict(tokenizer=tokenizer, tools=tools.registry(["calculator"]), n=2, max_turns=3,
                  episode_token_budget=400, max_new_tokens=MAX_NEW, temperature=0.0,
                  stop_ids=[tokenizer.eos_id], tool_workers=2)
    return rollout_episodes(model, contexts, **{**kwargs, **overrides})


@pytest.fixture(scope="module")
def episodes(policy):
    return _rollout(policy)


def test_episodes_call_the_calculator_and_answer(policy, episodes):
    _, tokenizer, _ = policy
    assert [e.group for e in episodes] == [0, 0, 1, 1, 2, 2]
    for e, (question, expression, observation, answer) in zip(episodes[::2], CONVERSATIONS):
        assert e.ended == ANSWER
        assert tokenizer.decode(e.tokens.tolist()) == conversation_text(
            question, expression, observation, answer)
        assert (e.turns, e.tool_calls, e.tool_failures) == ((2, 1, 0) if expression else
                                                             (1, 0, 0))
    assert episode_metrics(episodes) == {
        "rollout/tool_calls": 4.0, "rollout/tool_failures": 0.0, "rollout/turns_mean": 5 / 3,
        "rollout/reprefilled_tokens": float(sum(map(reprefilled_tokens, episodes))),
        "rollout/sandbox_refusals": 0.0, "rollout/sandbox_kills": 0.0}


def test_episode_is_exactly_the_sampled_and_appended_ids(policy, episodes):
    """tokens == prompt + turn 1's sampled ids + the calculator's observation tokens + turn 2's
    sampled ids; observation tokens carry mask 0 and no log-prob. One forward pass over the
    whole episode checks the sampled parts: each greedy token is the argmax given everything
    before it (observation included) and its log-prob is the teacher-forced one."""
    model, tokenizer, contexts = policy
    e, stop = episodes[0], tokenizer.eos_id
    prompt, (first, second) = contexts[0], (tokenizer.encode(t) for t in (
        f"{CALL % '2+3'}<eos>", "=5<eos>"))
    observation = observation_tokens(tokenizer, ["5"], sampled_stop=stop)
    assert e.tokens.tolist() == prompt + first + observation + second
    assert e.sampled.tolist() == ([0] * len(prompt) + [1] * len(first) +
                                  [0] * len(observation) + [1] * len(second))
    assert e.turn_starts == (len(prompt), len(prompt) + len(first) + len(observation))
    assert tokenizer.decode(e.tokens[e.observation_mask == 1].tolist()) == "t:5<eos>a:"
    assert not e.logprobs[e.sampled == 0].any()
    logits = np.asarray(model(e.tokens[None]))[0]
    predicted = np.concatenate([[-1], logits[:-1].argmax(-1)])
    np.testing.assert_array_equal(predicted[e.sampled == 1], e.tokens[e.sampled == 1])
    forced, _ = token_logprobs(model, e.tokens[None], np.ones((1, len(e.tokens)), np.int32))
    np.testing.assert_allclose(e.logprobs[e.sampled == 1],
                               np.asarray(forced)[0][e.sampled == 1], atol=1e-4)
    assert e.sampled_texts(tokenizer) == [f"{CALL % '2+3'}<eos>", "=5<eos>"]
    # turn 2 prefilled the prompt and turn 1 again: the reference arm's cost
    assert reprefilled_tokens(e) == len(prompt) + len(first)


def test_episodes_end_at_max_turns_and_at_the_budget(policy):
    _, tokenizer, contexts = policy
    one_turn = _rollout(policy, max_turns=1)
    assert [e.ended for e in one_turn] == [MAX_TURNS] * 4 + [ANSWER] * 2
    assert sum(e.tool_calls for e in one_turn) == 0  # a call in the last turn is not run
    budget = len(contexts[0]) + 40  # mid-call
    cut = _rollout(policy, episode_token_budget=budget)
    for e in cut[:4]:
        assert e.ended == BUDGET and len(e.tokens) == budget and e.turns == 1
    assert cut[4].ended == ANSWER
    # room for the call, not for its observation and one more token
    call_length = len(tokenizer.encode(f"{CALL % '2+3'}<eos>"))
    tight = _rollout(policy, episode_token_budget=len(contexts[0]) + call_length + 5)
    assert tight[0].ended == BUDGET and tight[0].tool_calls == 1 and tight[0].turns == 1
    assert len(tight[0].tokens) == len(contexts[0]) + call_length


def test_turns_are_parsed_without_their_stop_token(policy):
    """The text a turn's calls are parsed from leaves out the stop token it ended on (an open
    Hermes block runs to the end of the text: SmolLM2 left one open, and '<|im_end|>' made its
    JSON 'Extra data'); a turn cut without one is parsed whole."""
    from jaxprefix.tools.calls import parse_hermes

    seen = []
    _rollout(policy, parse=lambda text: seen.append(text) or parse_hermes(text))
    assert f"{CALL % '2+3'}" in seen and "hello" in seen and "=5" in seen
    assert not any(text.endswith("<eos>") for text in seen)


@pytest.mark.slow  # its longer observation lands in another context bucket: one more compile
def test_tool_failures_are_observations(policy):
    """A registry without the calculator: the call fails as an observation and the episode
    goes on to another turn."""
    _, tokenizer, _ = policy
    episodes = _rollout(policy, tools=tools.registry([]), max_turns=2)
    e = episodes[0]
    assert e.tool_calls == 1 and e.tool_failures == 1 and e.turns == 2
    assert "error: no tool named 'calculator'" in tokenizer.decode(
        e.tokens[e.observation_mask == 1].tolist())


def test_observation_tokens_carry_no_loss(policy, episodes):
    """Episodes through the learner's own path (as_rollouts -> build_batch -> Learner.update):
    the observation tokens' old log-probs do not touch the gradient; unmasking them does."""
    model, _, _ = policy
    rollouts = as_rollouts(episodes, n=2)
    for row, e in enumerate(episodes):
        assert rollouts.tokens[row, :len(e.tokens)].tolist() == e.tokens.tolist()
        assert rollouts.completion_mask[row].sum() == e.sampled.sum()
    selection = GroupSelection(picks=[(0, 0), (0, 1), (0, 2)], trainable=np.ones(3, bool),
                               zero_variance_fraction=0.0)
    advantages = [np.array([[1.0, 0.5], [-0.5, 1.0], [0.25, -1.0]], np.float32)]
    batch = build_batch([rollouts], advantages, selection)
    observation = np.zeros(batch["tokens"].shape, bool)  # batch rows are the episodes, in order
    for row, e in enumerate(episodes):
        observation[row, :len(e.tokens)] = e.observation_mask == 1
    assert observation.sum() > 0 and not batch["completion_mask"][observation].any()
    assert batch["token_mask"][observation].all()  # in the sequence, out of the loss
    learner = Learner(model, TrainConfig(learning_rate=1e-3, micro_batch_size=6))

    def grad_norm(batch):
        return float(learner.update(learner.init_state(), batch)[1]["grad_norm"])
    masked = grad_norm(batch)
    garbage = np.where(observation, -7.0, batch["old_logprobs"]).astype(np.float32)
    assert grad_norm({**batch, "old_logprobs": garbage}) == masked
    unmasked = {**batch, "completion_mask": np.where(observation, 1.0, batch["completion_mask"])
                .astype(np.float32)}
    assert abs(grad_norm(unmasked) - masked) > 1e-3 * masked


def _every_turn_calls(text):
    """A parser that reads every turn as a call of the calculator on its length: at a high
    temperature the policy writes no calls, and this keeps its episodes going for every turn."""
    return [ToolCall("calculator", {"expression": f"{len(text)}*3"})]


# Sampled (T = 2, random text), every turn a call: three-turn episodes of different lengths.
STOCHASTIC_DRAWS = dict(temperature=2.0, parse=_every_turn_calls)
# f32 log-probs of two computations in other orders: generate's static and continuous decodes of
# this model (code that predates turns) already differ by up to 1.4e-6 on the first turn, and a
# later turn adds the reference's prefill of the conversation against the decode steps that
# computed the same keys; measured across turns up to 3.6e-6 (logits up to 11 in magnitude), and
# 4.05e-6 once (a full suite on a loaded 2-core box; the test alone passed at 4e-6 right after).
# A wrong key or value moves a log-prob by far more (1e-3 and up): 1e-5 keeps that apart.
LOGPROB_ATOL = 1e-5


@pytest.fixture(scope="module")
def stochastic_settings(policy):
    """The draws with a token budget one short of the longest episode's, so that episode meets
    it in its last turn whatever the draws are (the trained policy's numbers, and so its draws,
    differ between CPUs: a fixed budget of 120 met no episode on some)."""
    free = _rollout(policy, **STOCHASTIC_DRAWS)  # _rollout's budget, 400, meets none
    assert all(e.ended != BUDGET for e in free)
    return dict(STOCHASTIC_DRAWS, episode_token_budget=max(len(e.tokens) for e in free) - 1)


@pytest.fixture(scope="module")
def stochastic(policy, stochastic_settings):
    return _rollout(policy, **stochastic_settings)


def assert_same_episodes(kept, reference):
    for a, b in zip(kept, reference, strict=True):
        assert a.tokens.tolist() == b.tokens.tolist()
        assert a.sampled.tolist() == b.sampled.tolist()
        assert (a.turn_starts, a.tool_calls, a.tool_failures, a.ended, a.group) == \
            (b.turn_starts, b.tool_calls, b.tool_failures, b.ended, b.group)
        np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=0, atol=LOGPROB_ATOL)


def test_kv_kept_episodes_equal_the_reference_across_a_preemption(policy, stochastic,
                                                                   stochastic_settings):
    """Every row in flight on the pages of one row (8 of 16 tokens, or as many as the longest
    row needs), one promised to each: rows that grow past them make the youngest give their
    pages back and start again, replaying their earlier turns (counted as re-prefilled); the
    episodes are the reference's all the same."""
    _, tokenizer, contexts = policy
    assert [e.turns for e in stochastic] == [3] * 6 and len({len(e.tokens) for e in stochastic}) > 3
    # The premise: the longest episode runs into the token budget.
    assert BUDGET in {e.ended for e in stochastic}
    assert all(reprefilled_tokens(e) > 0 for e in stochastic)
    page = 2 * 2 * 16 * 4 * 2  # K and V of 2 layers, 2 KV heads of 16, f32
    # A row's pages: its room in the budget, bucketed (the budget follows this CPU's draws).
    room = stochastic_settings["episode_token_budget"] - min(map(len, contexts))
    row_pages = max(8, bucket(room, MIN_NEW_TOKENS_BUCKET) // 16)
    timings = {}
    kept = _rollout(policy, **stochastic_settings, kv_kept=True, max_rows_in_flight=6, page_size=16,
                    reserve_fraction=1 / 8, kv_budget_bytes=(4 * 16 + row_pages * 16) * page,
                    timings=timings)
    assert_same_episodes(kept, stochastic)
    assert sum(reprefilled_tokens(e) for e in kept) > 0  # earlier turns replayed: preempted
    # The tail ran on part of the rows (turns.rows_to_compute), with the same episodes.
    assert 0 < timings['narrow_chunks'] < timings['chunks']


def test_chunks_are_short_while_a_tool_runs(policy, stochastic, stochastic_settings,
                                            monkeypatch):
    """While a tool runs, a chunk takes at most turns.TOOL_WAIT_STEPS steps, so that its answer
    goes in soon after it is ready; while none runs, up to chunk_steps. The same episodes."""
    running, lock, chunks = [0], threading.Lock(), []

    def slow_calculator(arguments):
        with lock:
            running[0] += 1
        try:
            time.sleep(0.2)
            return CALCULATOR.fn(arguments)
        finally:
            with lock:
                running[0] -= 1
    advance = continuous.advance

    # (a tool runs, the chunk's steps): a tool running now was submitted before they were chosen
    def recorded(*args, **kwargs):
        chunks.append((running[0] > 0, int(args[9])))
        return advance(*args, **kwargs)
    monkeypatch.setattr(continuous, "advance", recorded)
    registry = tools.Registry([tools.Tool("calculator", slow_calculator, CALCULATOR.description)])
    kept = _rollout(policy, **stochastic_settings, tools=registry, kv_kept=True, chunk_steps=16)
    assert_same_episodes(kept, stochastic)
    assert {steps for tool, steps in chunks if tool} == {turns.TOOL_WAIT_STEPS}
    assert 16 in {steps for tool, steps in chunks if not tool}


@pytest.mark.slow  # two more compiles of the continuous decode
@pytest.mark.parametrize("rows", [1, 3])
def test_kv_kept_episodes_equal_the_reference(policy, stochastic, stochastic_settings, rows):
    """1 and 3 rows in flight (waiting rows included): the same episodes, and no token of an
    earlier turn prefilled again."""
    kept = _rollout(policy, **stochastic_settings, kv_kept=True, max_rows_in_flight=rows,
                    chunk_steps=8)
    assert_same_episodes(kept, stochastic)
    assert episode_metrics(kept)["rollout/reprefilled_tokens"] == 0


@pytest.mark.slow  # the chunk program compiled for eight devices
def test_kv_kept_episodes_on_eight_devices_equal_the_reference(policy, stochastic,
                                                               stochastic_settings, monkeypatch):
    """The rows over 8 devices (the 'data' axis: a block of row slots each, admitting its own
    contexts, its rows leaving for their tools and coming back on its own pages): the
    reference's episodes on one device."""
    model, tokenizer, contexts = policy
    sharded = shard_model(nnx.merge(*nnx.split(model)), make_mesh(8, 1, 1))  # a copy
    assert len(sharded.embed[...].sharding.device_set) == 8
    blocks, advance = set(), continuous.advance

    def recorded(*args, shape, **kwargs):
        blocks.add(shape.layout.blocks)
        return advance(*args, shape=shape, **kwargs)
    monkeypatch.setattr(continuous, "advance", recorded)
    kept = _rollout((sharded, tokenizer, contexts), **stochastic_settings, kv_kept=True,
                    max_rows_in_flight=16, chunk_steps=8)
    assert blocks == {8}
    assert_same_episodes(kept, stochastic)
    assert episode_metrics(kept)["rollout/reprefilled_tokens"] == 0


@pytest.mark.slow  # one more compile
def test_kv_kept_greedy_episodes_call_the_calculator_as_the_reference(policy, episodes):
    kept = _rollout(policy, kv_kept=True)
    assert_same_episodes(kept, episodes)
    assert episode_metrics(kept) == {**episode_metrics(episodes),
                                     "rollout/reprefilled_tokens": 0.0}


# --- the RL loop on episodes (rl/loop.py with ToolSettings) ----------------------------------

REWARD = "def reward(completion, problem):\n    return float(completion == problem.answer)\n"
PROBLEMS = [Problem(f"p{i}", f"u:{q}<eos>a:", answer) for i, (q, _, _, answer)
            in enumerate(CONVERSATIONS)]


def _config(tmp_path, **tool_fields):
    """An RL config of the tiny calculator policy: 3 problems a step, 2 greedy episodes each,
    scored by a reward file (the final answer equals the problem's answer)."""
    (tmp_path / "reward.py").write_text(REWARD)
    c = run_config.base_config()
    c.rollout.update(n=2, temperature=0.0, max_new_tokens=MAX_NEW, max_turns=3)
    c.tools.update(names=("calculator",), episode_token_budget=400, workers=2)
    c.tools.update(tool_fields)
    c.rewards.update(path=f"{tmp_path}/reward.py:reward", workers=1)
    c.train.update(problems_per_step=3, total_steps=1, learning_rate=1e-3, micro_batch_size=0)
    c.eval.every = 0
    c.checkpoint.every = 1
    return c


def train_one_step(model, tokenizer, config, workdir: str) -> dict:
    """The metrics row of one GRPO step (loop.train) of `config` on the three problems."""
    method = GrpoMethod(TaskPrompts(tokenizer), PROBLEMS, problems_per_step=3, n=2, seed=0)
    result = loop.train(loop_settings(config), workdir, method=method, model=model,
                        tokenizer=tokenizer, stop_ids=[tokenizer.eos_id],
                        learner_config=validate(config, contexts_per_step=3),
                        rollout=RolloutSpec.from_config(config.rollout), contexts_per_step=3,
                        episodes=scoring.episode_source(
                            ToolSettings.from_config(config), None, tokenizer,
                            model.config.max_position_embeddings), progress=False)
    (record,) = read_metrics(workdir)
    assert result["step"] == 1
    return record


def _scored(policy, config, seed=0, record_routes=False, **sampler) -> scoring.Scored:
    """scoring.sample_and_score's episodes of the three problems (`sampler`: generate()'s keywords
    over the config's)."""
    model, tokenizer, contexts = policy
    request = scoring.RolloutRequest(contexts=contexts, problems=PROBLEMS, tags={}, n=2)
    rollout = ToolSettings.from_config(config).episode_rollout(tokenizer, 512)
    return scoring.sample_and_score(model, tokenizer, request, reward_settings(config), seed=seed,
                                 rollout=RolloutSpec.from_config(config.rollout),
                                 stop_ids=[tokenizer.eos_id], record_routes=record_routes,
                                 episodes=scoring.EpisodeSource(
                                     lambda *args, **kwargs: rollout(*args, **{**kwargs,
                                                                     **sampler})))


def test_the_loop_trains_on_exactly_the_sampled_and_appended_tokens(policy, episodes,
                                                                   tmp_path):
    """The loop's own path (sample_and_score with the run's ToolSettings, then _batch): each
    batch row is its episode's tokens exactly, the loss mask its sampled mask (observations 0),
    pi_old the sampler's log-probs; the verifier scored the final answers; the ledger's tokens
    are the prompt, observations, re-prefills and sampled tokens. The in-graph rollout
    (tools.rollout='kv_kept') gives the same episodes, rewards and sampled tokens, and books
    no re-prefill."""
    config = _config(tmp_path)
    scored = _scored(policy, config)
    assert [e.tokens.tolist() for e in scored.episodes] == [e.tokens.tolist() for e in episodes]
    np.testing.assert_array_equal(scored.rewards, np.ones((3, 2)))  # "=5", "=24", "hello"
    _, batch = loop._batch([scored], loop_settings(config))
    for row, e in enumerate(scored.episodes):
        assert batch["tokens"][row, :len(e.tokens)].tolist() == e.tokens.tolist()
        assert batch["completion_mask"][row, :len(e.tokens)].tolist() == e.sampled.tolist()
        np.testing.assert_array_equal(batch["old_logprobs"][row, :len(e.tokens)], e.logprobs)
        assert not batch["token_mask"][row, len(e.tokens):].any()
    prefilled, sampled = (sum(x) for x in zip(*map(sampler_tokens, scored.episodes)))
    assert (scored.prefilled, scored.generated) == (prefilled, sampled)
    assert sampled == sum(int(e.sampled.sum()) for e in scored.episodes)
    assert prefilled == sum(e.prompt_length + int(e.observation_mask.sum()) +
                            reprefilled_tokens(e) for e in scored.episodes)
    assert scoring.turn_metrics([scored]) == episode_metrics(scored.episodes)

    kept = _scored(policy, _config(tmp_path, rollout="kv_kept"))
    assert_same_episodes(kept.episodes, scored.episodes)
    np.testing.assert_array_equal(kept.rewards, scored.rewards)
    assert (kept.prefilled, kept.generated) == (
        prefilled - sum(map(reprefilled_tokens, scored.episodes)), sampled)
    assert scoring.turn_metrics([kept]) == {**scoring.turn_metrics([scored]),
                                         "rollout/reprefilled_tokens": 0.0}


# A calculator that fails every way a tool can: raising in process, then, in the python tool's
# sandbox (the capped subprocess where none starts), a hang, a memory bomb and a crash
# (SIGABRT), in turn over its calls.
FAILING_TOOL = """
from jaxprefix import tools
from jaxprefix.tools import sandbox

_python = tools.python_tool(tools.PythonLimits(
    cpu_s=1, memory_mb=256, wall_s=3, output_bytes=4096,
    isolation="capped_subprocess" if sandbox.unavailable() else "sandbox"))
_FAILURES = ["raise", "while True: pass", "bytearray(10**10)", "import os; os.abort()"]
_calls = [0]


def calculator(arguments):
    \"\"\"Fails.\"\"\"
    code = _FAILURES[_calls[0] % len(_FAILURES)]
    _calls[0] += 1
    if code == "raise":
        raise RuntimeError("boom")
    return _python.fn({"code": code})
"""


def test_failing_tools_inside_an_rl_step_are_error_observations_and_counted(policy, tmp_path):
    """A tool that raises, hangs, allocates without bound or crashes, plugged as a user file:
    each call ends as a one-line error observation within its caps, the episode goes on to its
    next turn, and an RL step (loop.train, its episodes from the in-graph rollout: the calls
    run in its worker thread while the device decodes) counts them in rollout/tool_failures and
    re-prefills nothing."""
    model, tokenizer, contexts = policy
    (tmp_path / "failing.py").write_text(FAILING_TOOL)
    config = _config(tmp_path, names=(f"{tmp_path}/failing.py:calculator",), workers=1)
    config.rollout.max_turns = 2  # a call in the second turn is not run: 4 calls exactly
    scored = _scored(policy, config)
    calls = [e for e in scored.episodes if e.tool_calls]
    assert len(calls) == 4 and all(e.tool_failures == 1 and e.turns == 2 for e in calls)
    seen = [tokenizer.decode(e.tokens[e.observation_mask == 1].tolist()) for e in calls]
    assert "error: calculator: RuntimeError: boom" in seen[0]
    assert "CPU time limit" in seen[1] or "timed out" in seen[1]
    assert "MemoryError" in seen[2] and "SIGABRT" in seen[3]
    assert all(len(text) <= 300 + len("t:<eos>a:") for text in seen)  # one capped line
    np.testing.assert_array_equal(scored.rewards[2], [1, 1])  # small talk: no call

    config.tools.rollout = "kv_kept"
    record = train_one_step(model, tokenizer, config, str(tmp_path / "run"))
    assert (record["rollout/tool_calls"], record["rollout/tool_failures"]) == (4.0, 4.0)
    # The hang and the memory bomb met caps; the raise and the crash did not.
    assert (record["rollout/sandbox_kills"], record["rollout/sandbox_refusals"]) == (2.0, 0.0)
    assert record["rollout/turns_mean"] == 5 / 3 and record["rollout/reprefilled_tokens"] == 0
