"""Mining a run of tool episodes samples its episodes: POPE's hard set holds what the policy
fails with its tools, and PrefixRL's trace pool keeps a trace's tools' observations, masked, and
is cut only where the policy writes next (tests/calculator_policy.py's policy, greedy)."""
import types

import numpy as np
import pytest

from jaxprefix import rewards
from jaxprefix.data.problem import Problem
from jaxprefix.errors import ConfigError
from jaxprefix.methods import prefixrl
from jaxprefix.methods.prefix_schedules import FixedPrefix
from jaxprefix.methods.prompting import ChatPrompts, with_response_prefix
from jaxprefix.rl.compute_ledger import ComputeLedger, sampling_flops
from jaxprefix.run_setup.mining import Mining, MiningSettings, ProbeSettings
from jaxprefix.sampling import RolloutSpec
from jaxprefix.tools.settings import ToolSettings

from tests.calculator_policy import CALL, CONVERSATIONS, MAX_NEW, train_calculator_policy

PROBLEMS = [Problem(q.rstrip("?").replace("+", "plus").replace("*", "times"), q, answer)
            for q, _, _, answer in CONVERSATIONS]
# The final answer read as the verifier reads it (a response prefix's text before it).
VERIFIER = "test_tool_mining_answer"
rewards.register(VERIFIER, lambda text, problem: float(text.endswith(problem.answer)),
                 in_process=True)


@pytest.fixture(scope="module")
def policy():
    model, tokenizer, _ = train_calculator_policy()
    return types.SimpleNamespace(model=model, tokenizer=tokenizer, stop_ids=(tokenizer.eos_id,),
                                 context_length=400, prompts=ChatPrompts(tokenizer))


def probe_settings(max_turns: int) -> ProbeSettings:
    """How mining samples a run of `max_turns` turns with the calculator."""
    tools = (ToolSettings(max_turns, ("calculator",), workers=2) if max_turns > 1
             else ToolSettings())
    return ProbeSettings(RolloutSpec(max_new_tokens=MAX_NEW, temperature=0.0), rows_per_call=8,
                         verifier_timeout_s=10.0, verifier_max_chars=100_000, tools=tools)


def prober(policy, max_turns: int):
    return probe_settings(max_turns).prober(
        policy, ComputeLedger(policy.model.config.num_params()), VERIFIER)


def mining(policy, max_turns: int, directory) -> Mining:
    sets = types.SimpleNamespace(train=PROBLEMS, verifier=VERIFIER)
    return Mining(MiningSettings(k=2, prefix_samples=1, seed=0,
                                 probe=probe_settings(max_turns)), policy, sets, str(directory))


def test_the_hard_set_of_a_tool_run_is_mined_with_its_tools(policy, tmp_path):
    """The arithmetic questions, which the policy answers through the calculator, are solved
    in its episodes and failed in one turn (its first turn is the call); small talk is solved
    either way. The ledger books every episode's tokens, observations included. A hard set
    mined one way is refused in one line (a ConfigError), not reused, by a run that samples the
    other way."""
    with_tools = mining(policy, 3, tmp_path / "tools")
    hard = with_tools.hard_set()
    assert hard.solve_counts == {p.id: 2 for p in PROBLEMS} and not hard.problems
    episodes = with_tools.prober.episodes(policy.model, types.SimpleNamespace(
        contexts=[policy.prompts.question(p) for p in PROBLEMS], n=2),
        stop_ids=policy.stop_ids, seed=0, **with_tools.prober.spec.sampler_keywords())[0]
    assert [e.tool_calls for e in episodes] == [1, 1, 1, 1, 0, 0]
    ledger = with_tools.costs["hard_set"]
    assert ledger.extra_rollouts == 6
    assert ledger.extra_flops == sampling_flops(policy.model.config.num_params(),
                                                sum(len(e.tokens) for e in episodes))

    one_turn = mining(policy, 1, tmp_path / "one_turn").hard_set()
    assert [p.id for p in one_turn.problems] == [PROBLEMS[0].id, PROBLEMS[1].id]
    with pytest.raises(ConfigError, match="hard_set.json: mined with {'max_turns': 3, 'tools': "
                                         r"\['calculator'\]}, the config samples one turn"):
        mining(policy, 1, tmp_path / "tools").hard_set()


def test_a_tool_runs_trace_pool_keeps_its_observations_and_is_cut_where_the_policy_writes(
        policy, tmp_path):
    with_tools = prober(policy, max_turns=3)
    arithmetic = PROBLEMS[:2]
    pool = prefixrl.build_trace_pool(with_tools, policy.prompts, arithmetic, samples_per_round=1,
                                     max_samples=1, seed=0)
    decode = policy.tokenizer.decode
    trace = pool.traces[PROBLEMS[0].id]
    assert decode(list(trace.tokens)) == f"{CALL % '2+3'}<eos>t:5<eos>a:=5"  # no final stop
    observation = len(policy.tokenizer.encode("t:5<eos>a:"))
    call = len(policy.tokenizer.encode(f"{CALL % '2+3'}<eos>"))
    assert trace.sampled == (1,) * call + (0,) * observation + (1,) * 2
    pool.save_jsonl(str(tmp_path / "pool.jsonl"), policy.tokenizer)
    assert prefixrl.TracePool.load_jsonl(str(tmp_path / "pool.jsonl")).traces == pool.traces

    # Cut at 40-80% of its tokens, inside the call: a cut moves to the answer turn's start.
    method = prefixrl.PrefixRLMethod(policy.prompts, arithmetic, pool, schedule=FixedPrefix(),
                                     prefixes_per_problem=4, unprefixed_copies=1, seed=0,
                                     problems_per_step=2, n=1)
    for problem in arithmetic:
        tokens = pool.traces[problem.id].tokens
        answer_start = len(tokens) - len(problem.answer)  # a token a character
        assert method.cuts[problem.id] == [answer_start] * 4
        prefix = method.prefix_tokens(problem, 0, step=0)
        assert decode(list(prefix)).endswith("<eos>a:")
    # A shorter prefix (a schedule's) ends at a turn's start too: here the empty one.
    assert trace.prefix(len(trace.tokens) - 3) == ()
    assert np.flatnonzero(trace.can_cut()).tolist() == [0, call + observation,
                                                        call + observation + 1,
                                                        call + observation + 2]

    # Continued from that prefix, the policy answers in one turn, and is scored on it.
    prefix = method.prefix_tokens(arithmetic[0], 0, step=0)
    result = with_tools.probe([with_response_prefix(policy.prompts, arithmetic[0], prefix)],
                              arithmetic[:1], 1, seed=0, response_prefixes=[decode(list(prefix))],
                              keep_successes=True)
    assert result.correct.tolist() == [[True]]
    assert decode(result.first_success[0].tokens) == "=5<eos>"
