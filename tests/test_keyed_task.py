"""keyed_multiplication: POPE's short-prefix regime, a key step first (docs/DEMO_TASK.md)."""
import random

import ml_collections
import pytest

from jaxprefix import rewards
from jaxprefix.data import tasks
from jaxprefix.data.tasks import keyed_multiplication as task


def test_hand_computed_problem():
    # 47 * 6 + 3 = 285; rule '>': d and c are the second digits of the pairs (2 6) and (8 3).
    p = task.make_problem(47, 6, 3, ">", (2, 8))
    assert p.question == ">__7__4__" + "_" * 18 + "x2683="
    assert len(p.question) == task.QUESTION_LENGTH
    # key *63; 7*6+3 = 45: write 5 carry 4; 4*6+4 = 28: write 8 carry 2; product 285.
    assert p.steps == ("*63", "+54", "+82") and p.answer == "285"
    assert task.verify(p.solution + "<eos>", p) == 1.0


def test_reading_the_key_by_the_other_rule_scores_zero():
    p = task.make_problem(47, 6, 3, ">", (2, 8))
    # What rule '<' reads (d = 2, c = 8): 7*2+8 = 22, 4*2+2 = 10 -> a consistent wrong answer.
    assert task.verify("*28+22+01", p) == 0.0
    assert task.verify("*63^45+82", p) == 1.0  # the other notation of a step is as good
    assert task.verify("*63+54+82+00", p) == 0.0  # nothing after the last step
    assert task.verify("*63+54", p) == 0.0


def test_every_generated_problem_is_solved_by_its_oracle_and_has_distinct_key_digits():
    for rule in ("<", ">"):
        for p in task.generate(50, rule=rule, seed=3):
            assert task.verify(p.solution, p) == 1.0
            u, v, q1, q2 = p.question[-5:-1]
            assert u != v and q1 != q2  # reading the wrong digit of a pair is always wrong
    hard = task.hard_set(20, seed=1)
    assert {p.metadata["rule"] for p in hard} == {">"}
    assert {p.metadata["digits"] for p in hard} == {task.SLOTS}
    assert all(len(p.steps) == task.HARD_STEPS for p in hard)


def test_hint_puts_each_step_one_question_length_before_its_place_in_the_answer():
    p = task.make_problem(47, 6, 3, ">", (2, 8))
    h = task.hinted(p, 2)
    assert h.question == ">637544" + "_" * 20 + "x2683="
    text = h.question + p.solution
    for i, step in enumerate(p.steps[:2]):  # a hinted step's digits, then the answer's
        answer = task.QUESTION_LENGTH + task.STEP_LENGTH * i + 1
        assert text[answer - task.QUESTION_LENGTH:][:2] == step[1:] == text[answer:answer + 2]
    assert task.verify(p.solution, h) == 1.0  # the policy writes the whole solution
    assert task.verify(p.solution[3:], h) == 0.0  # the hint is not part of the answer
    with pytest.raises(ValueError, match="already guided"):
        task.hinted(h, 1)


def test_guided_problem_is_scored_on_its_continuation():
    p = task.make_problem(47, 6, 3, ">", (2, 8))
    g = task.guided(p, 1)
    assert g.question.endswith("=*63") and g.steps == ("+54", "+82")
    assert task.verify("+54+82", g) == 1.0 and task.verify("+54+83", g) == 0.0


def test_sft_rows_never_show_what_the_second_rule_means():
    """Every SFT row under '>' has equal key digits, so nothing the base reads ties v, q to d, c;
    rows with their key overridden are '<' rows whose hint, not u and p, names d and c."""
    data = ml_collections.ConfigDict(dict(
        batch_size=64, digits=(1, 8), full_length_fraction=0.5, multipliers=(2, 9),
        tens_first=0.5, hinted_fraction=0.5, key_override_fraction=0.5,
        second_rule_fraction=0.25))
    second = overridden = 0
    for seed in range(5):
        for problem, target in task.sft_batch(data, seed):
            u, v, p, q = (int(x) for x in problem.question[-5:-1])
            d, c = problem.metadata["multiplier"], problem.metadata["carry_in"]
            assert target.startswith(f"*{d}{c}")
            if problem.question[0] == ">":
                second += 1
                assert (u, v, p, q) == (d, d, c, c)
            elif (u, p) != (d, c):
                overridden += 1
                assert problem.metadata["hint_steps"] >= 1 and problem.question[1:3] == f"{d}{c}"
            clean = problem.metadata.get("base_id") or problem.id
            assert clean  # every row is a problem the generator can write
    assert 40 < second < 120 and overridden > 20


def test_the_overlap_knob_shows_the_second_rule_in_that_share_of_its_rows():
    data = ml_collections.ConfigDict(dict(
        batch_size=64, digits=(1, 8), full_length_fraction=0.5, multipliers=(2, 9),
        tens_first=0.5, hinted_fraction=0.5, key_override_fraction=0.5,
        second_rule_fraction=0.25))
    plain = task.sft_batch(data, 3)
    data.second_rule_taught = 0.0
    assert task.sft_batch(data, 3) == plain  # at 0: the very batches of the demo's base
    data.second_rule_taught = 1.0
    second = 0
    for seed in range(5):
        for problem, target in task.sft_batch(data, seed):
            if problem.question[0] == ">":
                second += 1
                u, v, p, q = (int(x) for x in problem.question[-5:-1])
                d, c = problem.metadata["multiplier"], problem.metadata["carry_in"]
                assert (v, q) == (d, c) and u != v and p != q and target.startswith(f"*{d}{c}")
                assert task.verify(target, problem) == 1.0
    assert 40 < second < 120
    data.second_rule_taught = 1.5
    with pytest.raises(ValueError, match="second_rule_taught=1.5"):
        task.sft_batch(data, 0)


def test_registered_as_a_built_in_task_with_a_hint_layout():
    assert tasks.get(task.NAME) is task and task.NAME in tasks.HINTS
    assert task.NAME in rewards.names()
    tok = task.tokenizer()
    p = task.hard_set(1, seed=0)[0]
    assert tok.decode(tok.encode(p.question + p.solution)) == p.question + p.solution
    assert len(tok.encode(p.question + p.solution)) + 1 <= task.SEQUENCE_LENGTH
    with pytest.raises(ValueError, match="unknown built-in task"):
        tasks.get("nope")
    rng = random.Random(0)
    assert task.verify(task.sample_solution(p, rng), p) == 1.0


def _sft_data(**extra):
    return ml_collections.ConfigDict(dict(
        batch_size=64, digits=(1, 8), full_length_fraction=0.5, multipliers=(2, 9),
        tens_first=0.5, hinted_fraction=0.5, key_override_fraction=0.5,
        second_rule_fraction=0.25, **extra))


def test_restating_hint_is_the_oracle_prefix_ending_at_the_rule_name():
    p = task.make_problem(47, 6, 3, ">", (2, 8), names_rule=True)
    assert p.steps == (">63", "+54", "+82")  # the key step names rule '>', then reads d, c
    prefix = task.restating_prefix(p)
    assert prefix == ">" and p.solution.startswith(prefix)
    ids = task.tokenizer().encode(p.question + p.solution)
    hint = task.tokenizer().encode(p.question + prefix)
    assert ids[:len(hint)] == hint and task.tokenizer().decode(hint[-1:]) == ">"
    r = task.restated(p)
    assert r.question == p.question + ">" and r.question + r.solution == p.question + p.solution
    # After the name the policy does the read: by rule '>' (6, 3) it verifies ...
    assert task.verify("63+54+82<eos>", r) == 1.0
    assert task.verify("63+54+82", r) == task.verify(">63+54+82", p) == 1.0
    # ... by rule '<' (2, 8), a consistent computation, it does not.
    assert task.verify("28+22+01", r) == 0.0 and task.verify("63+54+83", r) == 0.0
    assert task.verify("*63+54+82", p) == 0.0  # the named notation is the only one
    assert task.restating_prefix(task.make_problem(47, 6, 3, ">", (2, 8))) == ""
    with pytest.raises(ValueError, match="no rule name"):
        task.restated(task.make_problem(47, 6, 3, ">", (2, 8)))
    with pytest.raises(ValueError, match="already guided"):
        task.restating_prefix(task.guided(p, 1))


def test_key_step_names_the_first_rule_that_reads_the_key_right():
    assert task.make_problem(47, 6, 3, "<", (2, 8), names_rule=True).steps[0] == "<63"
    same = task.make_problem(47, 6, 3, ">", (6, 3), names_rule=True)  # SFT's '>' rows
    assert same.steps[0] == "<63" and task.verify(same.solution, same) == 1.0
    assert task.verify(">63+54+82", same) == 1.0  # both rules read this key right
    hard = task.hard_set(30, seed=1, names_rule=True)
    assert {p.steps[0][0] for p in hard} == {">"}
    assert all(task.verify(p.solution, p) == 1.0 for p in hard)
    # a value hint still works: the policy names its habit and copies the hinted digits
    p = hard[0]
    assert task.verify("<" + p.solution[1:], task.hinted(p, 1)) == 1.0
    with pytest.raises(ValueError, match="key_names_rule='yes'"):
        task.problem_sets(ml_collections.ConfigDict(dict(
            digits=(8, 8), multipliers=(2, 9), train_size=2, eval_size=2, seed=0, eval_seed=1,
            key_names_rule="yes")))


def test_with_the_notation_off_problems_and_sft_batches_are_as_before():
    plain = task.sft_batch(_sft_data(), 7)
    assert task.sft_batch(_sft_data(key_names_rule=False), 7) == plain
    sets = dict(digits=(8, 8), multipliers=(2, 9), train_size=4, eval_size=4, seed=0,
                eval_seed=1, easy_size=4, easy_digits=(1, 8))
    before = task.problem_sets(ml_collections.ConfigDict(sets))
    assert task.problem_sets(ml_collections.ConfigDict(dict(sets, key_names_rule=False))) == before
    assert all(p.steps[0][0] == "*" and "key_names_rule" not in p.metadata
               for group in before for p in group)
    # on: the same rows, only the key step's first token named; '>' as a name never shown
    named = task.sft_batch(_sft_data(key_names_rule=True), 7)
    assert [p.question for p, _ in named] == [p.question for p, _ in plain]
    assert [t[1:] for _, t in named] == [t[1:] for _, t in plain]
    assert {t[0] for _, t in named} == {"<"}
    taught = task.sft_batch(_sft_data(key_names_rule=True, second_rule_taught=1.0), 7)
    for problem, target in taught:
        if problem.question[0] == ">":  # the knob's rows name '>' and are right
            assert target[0] == ">" and task.verify(target, problem) == 1.0


def test_restated_rows_teach_going_on_from_the_name_and_never_writing_it():
    """data.restated_taught (issue 43's continuation knob): that share of the '>' rows the knob
    leaves is given '>' at the answer's start, out of the loss; the target reads v, q and
    carries. The name is trained on no row (the overlap knob at 0), and at 0 no draw is made."""
    plain = task.sft_batch(_sft_data(key_names_rule=True), 4)
    assert task.sft_batch(_sft_data(key_names_rule=True, restated_taught=0.0), 4) == plain
    tok = task.default_tokenizer()
    restated = 0
    for seed in range(4):
        for problem, target in task.sft_batch(_sft_data(key_names_rule=True,
                                                        restated_taught=1.0), seed):
            ids, mask = task.training_ids(problem, target)
            trained = tok.decode([i for i, m in zip(ids, mask) if m])
            assert trained[0] != ">"  # the name never carries loss
            if not problem.metadata.get("restated"):
                continue
            restated += 1
            u, v, p, q = (int(x) for x in problem.question[-6:-2])
            d, c = problem.metadata["multiplier"], problem.metadata["carry_in"]
            assert problem.question.endswith(">") and (v, q) == (d, c) and (u, p) != (v, q)
            assert target.startswith(f"{d}{c}") and task.verify(target, problem) == 1.0
    assert 20 < restated < 100
    with pytest.raises(ValueError, match="restated_taught=0.5: expected 0 without"):
        task.sft_batch(_sft_data(restated_taught=0.5), 0)


def test_tool_episode_rows_call_the_key_reader_and_leave_its_answer_untrained():
    """data.tool_fraction (the built-in tool task's base): that share of the unhinted rows is
    the call, the reader's answer and the solution; the loss mask is 0 on the answer (appended
    by the rollout, never sampled) and on nothing else of the target; hinted rows never call.
    At 0 the batches are the demo's own (no draw is made)."""
    plain = task.sft_batch(_sft_data(), 5)
    assert task.sft_batch(_sft_data(tool_fraction=0.0), 5) == plain
    calls = unread = 0
    for problem, target in task.sft_batch(_sft_data(tool_fraction=0.5), 5):
        u, v, p, q = (int(x) for x in problem.question[-5:-1])
        if not target.startswith(task.CALL):
            assert problem.question[0] == "<" or (u, p) == (v, q)  # '>' shown by the tool only
            continue
        calls += 1
        unread += (u, p) != (v, q) and problem.question[0] == ">"
        d, c = problem.metadata["multiplier"], problem.metadata["carry_in"]
        call, rest = target.split("<eos>", 1)
        assert "hint_steps" not in problem.metadata
        assert call == task.CALL + problem.question[0] + problem.question[-5:-1]
        assert rest.startswith(f"{d}{c}=*{d}{c}") and task.verify(rest[3:], problem) == 1.0
        ids, mask = task.training_ids(problem, target)
        tok = task.default_tokenizer()
        assert tok.decode([i for i, m in zip(ids, mask) if not m]) == problem.question + f"{d}{c}="
        assert len(ids) <= task.EPISODE_LENGTH
    assert 8 < calls < 30 and 3 < unread < calls  # a quarter of 64 rows; half of them '>'

    assert task.sequence_length(_sft_data(tool_fraction=0.5)) == task.EPISODE_LENGTH
    assert task.sequence_length(_sft_data()) == task.SEQUENCE_LENGTH


def test_the_key_reader_reads_by_the_rule_and_refuses_malformed_calls():
    assert task.read_key({"rule": ">", "key": "2683"}) == "63"
    assert task.read_key({"rule": "<", "key": "2683"}) == "28"
    assert task.call_arguments("x>2683<eos>") == {"rule": ">", "key": "2683"}
    assert task.call_arguments("*63+54<eos>") is None  # an answer, not a call
    for arguments in (task.call_arguments("x>26<eos>"), task.call_arguments("x*2683"),
                      {"rule": ">", "key": 2683}):
        with pytest.raises(ValueError, match="expected a rule"):
            task.read_key(arguments)
    assert task.observation_text("63") == "63=" and task.observation_text(None) == "__="


def test_the_key_given_and_the_blind_reader_controls():
    """data.key_given: every problem carries its key step in the hint slots (d and c in the
    prompt), verified as before; read_key_blind answers in read_key's format by rule '<'
    whatever is asked, so on a hard problem never the key's d and c."""
    sets = dict(digits=(8, 8), multipliers=(2, 9), train_size=4, eval_size=4, seed=0,
                eval_seed=1, key_names_rule=True)
    plain = task.problem_sets(ml_collections.ConfigDict(sets))
    given = task.problem_sets(ml_collections.ConfigDict(dict(sets, key_given=True)))
    for ours, theirs in zip(plain[:2], given[:2]):
        for p, g in zip(ours, theirs):
            d, c = p.metadata["multiplier"], p.metadata["carry_in"]
            assert g.metadata["hint_steps"] == 1 and g.question != p.question
            assert task.verify(p.solution, g) == 1.0
            key = p.question[-5:-1]
            call = {"rule": ">", "key": key}
            assert task.read_key(call) == f"{d}{c}"
            assert task.read_key_blind(call) == key[0] + key[2] != f"{d}{c}"
    with pytest.raises(ValueError):
        task.read_key_blind({"rule": "?", "key": "1234"})
