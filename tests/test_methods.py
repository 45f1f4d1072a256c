"""PrefixRL as a batch builder, the schedules inside methods, checkpointed method state and
mining (methods/{prefixrl,probing,schedules}.py; POPE's batches: test_pope.py).

Everything runs for real: the demo task's problems and character tokenizer, a tiny random
decoder, the sampler and the learner's batch layout. Mining is scored by verifiers registered in
tests/method_helpers.py whose outcome is known in advance (by problem id, or by how much of the
oracle solution a text starts with), so the hard set, the shortest prefixes and the sample counts
can be checked against numbers counted by hand.
"""
import json
import types

import numpy as np
import pytest

from jaxprefix import sampling
from jaxprefix.data.tasks import carry_multiplication as task
from jaxprefix.methods import pope, prefixrl
from jaxprefix.methods.prompting import oracle_prefix_text
from jaxprefix.methods.prefix_schedules import AdaptivePrefix, AnnealedPrefix, FixedPrefix
from jaxprefix.rl import dynamic_sampling, objectives
from jaxprefix.rl.compute_ledger import sampling_flops
from jaxprefix.sampling import SharedContext
from tests.method_helpers import model  # noqa: F401 (a fixture)
from tests.method_helpers import (EASY, MODEL, PROBLEMS, PROMPTS, SOLVED_IDS, STEPS_NEEDED, STOP,
                                  TOKENIZER, context_ids, pope_method, prefixrl_method, prober)




@pytest.mark.parametrize("prefixes,unprefixed", [(3, 1), (2, 2)])
def test_prefixrl_mix(prefixes, unprefixed):
    method = prefixrl_method(prefixes_per_problem=prefixes, unprefixed_copies=unprefixed)
    request = method.next_request(0)
    assert len(request.contexts) == 4 * (prefixes + unprefixed)
    guided = request.tags["guided"]
    assert guided.sum() == 4 * prefixes
    for problem in PROBLEMS[:4]:
        rows = [i for i, p in enumerate(request.problems) if p.id == problem.id]
        assert guided[rows].sum() == prefixes and (~guided[rows]).sum() == unprefixed
        trace = method.pool.traces[problem.id].tokens
        assert trace == tuple(TOKENIZER.encode(problem.solution))  # oracle traces
        for i in rows:
            context = request.contexts[i]
            if guided[i]:
                assert context.prompt == tuple(PROMPTS.question(problem))
                assert tuple(context.suffix) == trace[:len(context.suffix)]
                assert request.response_prefixes[i] == TOKENIZER.decode(list(context.suffix))
            else:
                assert list(context) == PROMPTS.question(problem)
                assert request.response_prefixes[i] == ""
        suffixes = [len(request.contexts[i].suffix) for i in rows if guided[i]]
        assert suffixes == method.cuts[problem.id]


# --- PrefixRL cut points ---------------------------------------------------------------------

def test_cut_points_by_hand():
    rng = np.random.default_rng(0)
    assert prefixrl.cut_points(10, 5, 0.5, 0.5, rng) == [5] * 5
    cuts = prefixrl.cut_points(4, 200, 0.0, 1.0, rng)
    assert min(cuts) == 1 and max(cuts) == 3  # one token kept, one left to generate
    assert prefixrl.cut_points(1, 3, 0.4, 0.8, rng) == [1, 1, 1]
    with pytest.raises(ValueError, match="0 <= lo <= hi <= 1"):
        prefixrl.cut_points(10, 1, 0.8, 0.4, rng)


def test_prefixrl_cut_points_in_range_reproducible_and_order_free():
    problems = task.generate(32, digits=(2, 20), seed=3)
    lo, hi = 0.4, 0.8
    method = prefixrl_method(problems, cut_range=(lo, hi), problems_per_step=4)
    for problem in problems:
        length = len(method.pool.traces[problem.id].tokens)
        cuts = method.cuts[problem.id]
        assert len(cuts) == 3 and all(isinstance(c, int) for c in cuts)
        for cut in cuts:
            assert round(lo * length) <= cut <= round(hi * length), (problem.id, length, cut)
            assert 1 <= cut <= length - 1
    assert prefixrl_method(problems, problems_per_step=4).cuts == method.cuts
    assert prefixrl_method(problems[::-1], problems_per_step=4).cuts == method.cuts
    other = prefixrl_method(problems, problems_per_step=4, seed=1).cuts
    assert other != method.cuts
    assert sum(other[p.id] != method.cuts[p.id] for p in problems) > len(problems) // 2


def test_prefixrl_needs_a_trace():
    pool = prefixrl.oracle_trace_pool(PROMPTS, PROBLEMS[:2])
    with pytest.raises(ValueError, match="no trace for any training problem"):
        prefixrl.PrefixRLMethod(PROMPTS, PROBLEMS[2:4], pool, schedule=FixedPrefix(),
                                problems_per_step=2, n=2, seed=0)


# --- the loss mask on a real batch -----------------------------------------------------------

@pytest.mark.parametrize("make", [prefixrl_method, pope_method], ids=["prefixrl", "pope"])
def test_prefix_tokens_carry_no_loss(model, make):
    request = make().next_request(0)
    rollouts = sampling.generate(model, request.contexts, n=request.n, max_new_tokens=5,
                                 stop_ids=STOP, seed=0)
    group_rewards = np.random.default_rng(0).uniform(size=(len(request.contexts), request.n))
    advantages = np.asarray(objectives.group_advantages(group_rewards))
    selection = dynamic_sampling.select_groups([group_rewards], len(request.contexts))
    batch = dynamic_sampling.build_batch([rollouts], [advantages], selection)
    assert rollouts.tokens.shape[0] == batch["tokens"].shape[0] == len(request.contexts) * request.n
    prefixed_rows = 0
    for row, group in enumerate(rollouts.group_ids):
        context = context_ids(request.contexts[group])
        start, length = len(context), int(rollouts.lengths[row])
        assert rollouts.context_lengths[row] == start and length >= 1
        assert batch["tokens"][row, :start].tolist() == context  # the prefix is in the context
        expected = np.zeros(batch["tokens"].shape[1], np.float32)
        expected[start:start + length] = 1.0
        np.testing.assert_array_equal(batch["completion_mask"][row], expected)
        width = rollouts.tokens.shape[1]
        np.testing.assert_array_equal(rollouts.completion_mask[row], expected[:width])
        assert batch["token_mask"][row].sum() == start + length
        prefixed_rows += isinstance(request.contexts[group], SharedContext) and bool(
            request.contexts[group].suffix)
    assert prefixed_rows > 0


# --- schedules inside methods ----------------------------------------------------------------

def test_pope_annealed_prefix_shortens_with_steps():
    hard = PROBLEMS[:4]
    method = pope_method(hard, units=4, schedule=AnnealedPrefix(steps=4))
    lengths = []
    for step in range(5):
        request = method.next_request(step)
        guided = [len(c.suffix) for c, g in zip(request.contexts, request.tags["guided"]) if g]
        assert len(set(guided)) == 1  # every problem's prefix is 4 steps here
        lengths.append(guided[0])
    assert lengths == [12, 9, 6, 3, 0]  # 4, 3, 2, 1, 0 steps of 3 tokens


def test_pope_adaptive_prefix_shortens_after_successes():
    hard = PROBLEMS[:3]
    method = pope_method(hard, units=3, schedule=AdaptivePrefix(window=2, threshold=0.5))
    request = method.next_request(0)
    guided = request.tags["guided"]
    ids = [p.id for p in request.problems]
    step_rewards = np.zeros((len(request.contexts), 2))
    step_rewards[[i for i, pid in enumerate(ids) if pid == hard[0].id and guided[i]]] = 1
    # Unguided successes say nothing of the prefix: hard[1]'s stays.
    step_rewards[[i for i, pid in enumerate(ids) if pid == hard[1].id and not guided[i]]] = 1
    method.observe(request, step_rewards)
    after = method.next_request(1)
    units = {p.id: len(c.suffix) // task.STEP_LENGTH
             for c, p, g in zip(after.contexts, after.problems, after.tags["guided"]) if g}
    assert units == {hard[0].id: 2, hard[1].id: 3, hard[2].id: 3}


def test_prefixrl_adaptive_prefix_shortens_one_cut():
    method = prefixrl_method(PROBLEMS[:2], schedule=AdaptivePrefix(window=2, stride=2))
    first = PROBLEMS[0]
    request = method.next_request(0)
    step_rewards = np.zeros((len(request.contexts), 2))
    guided = request.tags["guided"]
    rows = [i for i, p in enumerate(request.problems) if p.id == first.id and guided[i]]
    step_rewards[rows[1]] = 1  # the second cut of the first problem succeeds
    method.observe(request, step_rewards)
    after = method.next_request(1)
    lengths = {p.id: [] for p in PROBLEMS[:2]}
    for c, p, g in zip(after.contexts, after.problems, after.tags["guided"]):
        if g:
            lengths[p.id].append(len(c.suffix))
    cuts = method.cuts[first.id]
    assert lengths[first.id] == [cuts[0], cuts[1] - 2, cuts[2]]
    assert lengths[PROBLEMS[1].id] == method.cuts[PROBLEMS[1].id]


def test_prefixrl_adaptive_with_a_problem_twice_in_a_batch():
    # 2 problems, 3 per step: the batch runs into the next epoch and repeats a problem.
    method = prefixrl_method(PROBLEMS[:2], problems_per_step=3, schedule=AdaptivePrefix(window=4))
    request = method.next_request(0)
    ids = [p.id for p in request.problems]
    twice = max(set(ids), key=ids.count)
    assert ids.count(twice) == 2 * 4  # two occurrences of 3 prefixed + 1 plain
    method.observe(request, np.ones((len(request.contexts), 2)))  # 2 x 2 successes per cut
    after = method.next_request(1)
    cuts = method.cuts[twice]
    shortened = [len(c.suffix) for c, p, g in zip(after.contexts, after.problems,
                                                   after.tags["guided"]) if g and p.id == twice]
    assert shortened[:3] == [c - 1 for c in cuts]


# --- checkpointed state ----------------------------------------------------------------------

def request_summary(request):
    return ([context_ids(c) for c in request.contexts], [p.id for p in request.problems],
            request.tags["guided"].tolist(), request.response_prefixes)


@pytest.mark.parametrize("make", [
    lambda: pope_method(PROBLEMS, problems_per_step=3, easy=EASY, easy_per_step=2,
                        schedule=AdaptivePrefix(window=2)),
    lambda: prefixrl_method(PROBLEMS, problems_per_step=3, schedule=AdaptivePrefix(window=2)),
], ids=["pope", "prefixrl"])
def test_state_round_trip_gives_the_same_next_requests(make):
    method = make()
    for step in range(3):
        request = method.next_request(step)
        method.observe(request, np.ones((len(request.contexts), 2)))
    state = json.loads(json.dumps(method.state()))  # as the checkpoint stores it
    resumed = make()
    resumed.restore(state)
    assert request_summary(resumed.next_request(3)) == request_summary(method.next_request(3))
    assert request_summary(resumed.next_request(4)) == request_summary(method.next_request(4))
    fresh = make()
    assert request_summary(fresh.next_request(3)) != request_summary(resumed.next_request(5))


# --- mining ----------------------------------------------------------------------------------

def test_mine_hard_set_counts_and_ledger(model):
    probe = prober(model, "test_methods_solved_by_id", rows_per_call=6)  # 3 problems per call
    hard = pope.mine_hard_set(probe, PROMPTS, PROBLEMS, k=2, seed=0)
    assert [p.id for p in hard.problems] == [p.id for p in PROBLEMS if p.id not in SOLVED_IDS]
    assert hard.solve_counts == {p.id: 2 if p.id in SOLVED_IDS else 0 for p in PROBLEMS}
    assert hard.to_json()["hard_ids"] == [p.id for p in hard.problems] and hard.k == 2
    ledger = probe.ledger
    assert ledger.extra_rollouts == len(PROBLEMS) * 2 and ledger.rollouts == 0
    context_tokens = len(PROBLEMS) * 2 * task.QUESTION_LENGTH
    assert (sampling_flops(MODEL.num_params(), context_tokens + len(PROBLEMS) * 2)
            <= ledger.extra_flops
            <= sampling_flops(MODEL.num_params(), context_tokens + len(PROBLEMS) * 2 * 6))


def test_shortest_solvable_prefixes_by_hand(model):
    four = [p for p in task.generate(40, digits=(4, 4), seed=7)][:4]
    two = task.generate(1, digits=(2, 2), seed=8)[0]
    problems = four + [two]
    STEPS_NEEDED.update({four[0].id: 1, four[1].id: 2, four[2].id: 3, four[3].id: 4, two.id: 5})
    probe = prober(model, "test_methods_enough_steps", rows_per_call=4)
    search = pope.shortest_solvable_prefixes(probe, PROMPTS, problems, m=2, max_units=3,
                                             guidance="solution_prefix", seed=0)
    assert search.shortest == {four[0].id: 1, four[1].id: 2, four[2].id: 3, four[3].id: None,
                               two.id: None}
    # Pending per length: 1 step: all 5; 2 steps: the four 4-digit minus four[0] (two's limit
    # is 1 step: 2 would be its whole solution); 3 steps: four[2], four[3]. m = 2 samples each.
    assert probe.ledger.extra_rollouts == (5 + 3 + 2) * 2
    # The answers kept are whole solutions: the forced prefix, then the policy's continuation.
    for pid, units in search.shortest.items():
        if units:
            text = TOKENIZER.decode(search.answers[pid])
            assert text.startswith(oracle_prefix_text(next(p for p in problems if p.id == pid),
                                                      units))
    assert pope.revealed_fractions(problems, search.shortest) == [1 / 4, 2 / 4, 3 / 4]
    # A cap of half the solution: at most 2 of 4 steps, so four[2] (needs 3) finds none.
    capped = pope.shortest_solvable_prefixes(prober(model, "test_methods_enough_steps"), PROMPTS,
                                             problems, m=2, max_units=3, max_fraction=0.5,
                                             guidance="solution_prefix", seed=0)
    assert capped.shortest == {four[0].id: 1, four[1].id: 2, four[2].id: None, four[3].id: None,
                               two.id: None}


def test_build_trace_pool_respects_max_samples(model):
    probe = prober(model, "test_methods_solved_by_id", max_new_tokens=4)
    problems = PROBLEMS[:5]  # PROBLEMS[1] and PROBLEMS[4] are solved every time
    pool = prefixrl.build_trace_pool(probe, PROMPTS, problems, samples_per_round=2, max_samples=5,
                                     seed=0)
    assert sorted(pool.traces) == sorted([PROBLEMS[1].id, PROBLEMS[4].id])
    # Solved in round 1 (2 samples); unsolved ones draw 2 rounds (4 samples; a third would pass 5).
    assert pool.samples_per_problem == {p.id: 2 if p.id in SOLVED_IDS else 4 for p in problems}
    assert max(pool.samples_per_problem.values()) <= 5
    assert probe.ledger.extra_rollouts == sum(pool.samples_per_problem.values()) == 2 * 2 + 3 * 4
    for trace in pool.traces.values():
        assert trace.samples == 2 and len(trace.tokens) <= 4
        assert TOKENIZER.eos_id not in trace.tokens  # the stop token is the policy's to write


def test_trace_pool_jsonl_round_trip(tmp_path):
    pool = prefixrl.oracle_trace_pool(PROMPTS, PROBLEMS[:3])
    path = str(tmp_path / "pool.jsonl")
    pool.save_jsonl(path, TOKENIZER)
    loaded = prefixrl.TracePool.load_jsonl(path, PROMPTS)
    assert loaded.traces == pool.traces
    text_only = tmp_path / "text.jsonl"
    text_only.write_text(json.dumps({"id": PROBLEMS[0].id, "text": PROBLEMS[0].solution}) + "\n")
    assert prefixrl.TracePool.load_jsonl(str(text_only), PROMPTS).traces[PROBLEMS[0].id].tokens == \
        tuple(TOKENIZER.encode(PROBLEMS[0].solution))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "x"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:line 1: expected fields 'id' and 'tokens' or 'text'"):
        prefixrl.TracePool.load_jsonl(str(bad), PROMPTS)


def test_imported_pool_keeps_only_traces_that_verify(tmp_path):
    """Another model's traces: one right, one wrong (a digit changed), one for a problem not in
    the training set; only the right one is kept, and the drops are counted by reason."""
    right, wrong = PROBLEMS[0], PROBLEMS[1]
    bad_text = wrong.solution[:-2] + str((int(wrong.solution[-2]) + 1) % 10) + wrong.solution[-1]
    path = tmp_path / "pool.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in (
        {"id": right.id, "text": right.solution}, {"id": wrong.id, "text": bad_text},
        {"id": "carry_multiplication-1x2", "text": "+20"})))
    pool = prefixrl.TracePool.load_jsonl(str(path), PROMPTS)
    kept, stats = prefixrl.verified_pool(pool, PROBLEMS[:4], verifier=task.NAME,
                                         decode=TOKENIZER.decode)
    assert set(kept.traces) == {right.id}
    assert stats == {"traces": 3, "kept": 1, "unknown_problem": 1, "failed_verification": 1}


def test_mining_states_what_it_will_sample_and_its_flops_before_it_starts():
    from jaxprefix.run_setup.mining import sampling_cost

    lengths = [len(PROMPTS.question(p)) for p in PROBLEMS[:3]]
    tokens = 16 * (sum(lengths) + 3 * 61)  # 16 samples of each, up to 61 new tokens
    line = sampling_cost("mining the hard set", lengths, 16, 61, num_params=1000)
    assert line == (f"mining the hard set: will sample 3 contexts x 16 samples x up to 61 new "
                    f"tokens (D <= {tokens:.3g} tokens, contexts included), <= "
                    f"{2 * 1000 * tokens:.3g} FLOPs (2 N D, N = 1e+03 parameters)")
    # On a TPU slice the line adds the roofline floor. 3 x 16 rows at 16 a call are 3 calls of 61
    # decode steps, each step reading the bf16 weights (2,000 bytes) shared over 8 v6e chips at
    # 1,640 GB/s: 3 * 61 * 2000 / 8 / 1.64e12 = 2.79e-08 s, above the FLOPs at 8 x 918 TFLOP/s.
    v6e = [types.SimpleNamespace(device_kind="TPU v6 lite")] * 8
    on_tpu = sampling_cost("mining the hard set", lengths, 16, 61, num_params=1000,
                           rows_per_call=16, devices=v6e)
    assert on_tpu == line + ("; on 8 x v6e at least 2.79e-08 s (the roofline: FLOPs at peak, or "
                             "the weights read at every decode step of 3 calls)")
    cpu = [types.SimpleNamespace(device_kind="cpu")]
    assert sampling_cost("mining the hard set", lengths, 16, 61, num_params=1000,
                         rows_per_call=16, devices=cpu) == line
    # A run of tool episodes samples episodes: each within its token budget, context included.
    episodes = sampling_cost("mining the hard set", lengths, 16, 61, num_params=1000,
                             episodes=(3, 400, ("calculator", "python")))
    assert episodes == (f"mining the hard set: will sample 3 contexts x 16 samples x an episode "
                        f"of up to 3 turns with calculator, python (up to 61 new tokens a turn, "
                        f"400 in all) (D <= {16 * 3 * 400:.3g} tokens, contexts included), <= "
                        f"{2 * 1000 * 16 * 3 * 400:.3g} FLOPs (2 N D, N = 1e+03 parameters)")
