"""The demo task: generator, oracle solutions, notations, guidance and verifier agree."""

import dataclasses
import itertools
import random

import pytest

from jaxprefix.data.tasks import carry_multiplication as task


@pytest.fixture(scope="module")
def problems():
    return task.generate(300, seed=1) + task.hard_set(50, seed=2)


def test_hand_computed_problem():
    # 47 * 6 = 282: 7*6 = 42 -> write 2 carry 4; 4*6 + 4 = 28 -> write 8 carry 2.
    problem = task.make_problem(47, 6)
    assert problem.question == "7__4__" + "_" * 54 + "x6="  # slots: digit, then hint sum, carry
    assert problem.steps == ("+24", "+82")
    assert problem.answer == "282"
    assert task.verify("+24+82<eos>", problem) == 1.0
    assert task.verify("^42^28", problem) == 1.0  # tens first: t = 42, then t = 28
    assert task.verify("+24^28<eos><pad><pad>", problem) == 1.0
    assert task.verify("+24+83", problem) == 0.0  # wrong final carry
    assert task.verify("+42+82", problem) == 0.0  # '+' means sum digit first
    assert task.verify("+24", problem) == 0.0  # stopped early
    assert task.verify("+24+82+00", problem) == 0.0  # an extra step
    assert task.verify("+24+82x", problem) == 0.0  # trailing junk
    assert task.verify("", problem) == 0.0


def test_generator_respects_difficulty_knob():
    for problem in task.generate(200, digits=(3, 5), multipliers=(6, 7), seed=3):
        assert 3 <= problem.metadata["digits"] <= 5 and 6 <= problem.metadata["multiplier"] <= 7
        assert len(problem.steps) == problem.metadata["digits"]
        assert len(problem.question) == task.QUESTION_LENGTH
    hard = task.hard_set(20)
    assert all(len(p.steps) == task.SLOTS and p.metadata["multiplier"] >= 6 for p in hard)
    assert task.generate(5, seed=7) == task.generate(5, seed=7)


def test_oracle_scores_one_and_corrupted_answer_zero(problems):
    rng = random.Random(0)
    for problem in problems:
        number, multiplier = problem.id.split("-")[-1].split("x")
        assert problem.answer == str(int(number) * int(multiplier))
        assert task.verify(problem.solution, problem) == 1.0
        assert task.verify(problem.solution + task.EOS, problem) == 1.0
        # Change one digit of one step: the answer no longer matches.
        position = rng.randrange(len(problem.solution) // 3) * 3 + rng.choice((1, 2))
        wrong = str((int(problem.solution[position]) + rng.randint(1, 9)) % 10)
        corrupted = problem.solution[:position] + wrong + problem.solution[position + 1:]
        assert task.verify(corrupted, problem) == 0.0
        wrong_answer = dataclasses.replace(problem, answer=str(int(problem.answer) + 1))
        assert task.verify(problem.solution, wrong_answer) == 0.0


def test_every_notation_path_scores_one():
    problem = task.make_problem(98765, 9)
    for notations in itertools.product((task.SUM_FIRST, task.TENS_FIRST), repeat=5):
        assert task.verify(task.spell_solution(problem, notations), problem) == 1.0
    rng = random.Random(0)
    for problem in task.hard_set(30, seed=5):
        sampled = task.sample_solution(problem, rng)
        assert sampled != problem.solution  # 2^20 spellings: one draw is never the oracle
        assert task.verify(sampled, problem) == 1.0


def test_guided_problem_is_scored_on_its_continuation(problems):
    for problem in problems[:100]:
        for k in range(len(problem.steps) + 1):
            guided = task.guided(problem, k)
            assert guided.question == problem.question + "".join(problem.steps[:k])
            assert guided.answer == problem.answer
            assert guided.metadata["prefix_steps"] == k
            assert task.verify(guided.solution, guided) == 1.0
            if 0 < k < len(problem.steps):
                # A continuation is not a full solution, and a full solution is no continuation.
                assert task.verify(guided.solution, problem) == 0.0
                assert task.verify(problem.solution, guided) == 0.0
    twice = task.guided(task.guided(problems[0], 1), 1)
    assert twice.question == task.guided(problems[0], 2).question
    assert twice.metadata["prefix_steps"] == 2


def test_hinted_problem_gives_steps_in_the_prompt_and_wants_the_whole_solution(problems):
    problem = task.make_problem(47, 6)
    assert task.hinted(problem, 1).question == "7244__" + "_" * 54 + "x6="
    assert task.hinted(problem, 2).question == "724482" + "_" * 54 + "x6="
    for problem in problems[:100]:
        for k in range(len(problem.steps) + 1):
            hinted = task.hinted(problem, k)
            assert len(hinted.question) == task.QUESTION_LENGTH  # every slot stays where it was
            # Step i of the answer sits one question length after slot i: a fixed-distance copy.
            for i, step in enumerate(problem.steps[:k]):
                slot = hinted.question[i * task.SLOT_LENGTH:(i + 1) * task.SLOT_LENGTH]
                assert slot[1:] == step[1:]
            assert task.verify(problem.solution, hinted) == 1.0  # the whole answer is wanted
            if k:
                assert task.verify(task.guided(problem, k).solution, hinted) == 0.0
                assert hinted.metadata["hint_steps"] == k
            rng = random.Random(k)
            target = task.hinted_solution(hinted, rng)
            assert target.startswith("".join(problem.steps[:k]))  # hinted steps copied as given
            assert task.verify(target, problem) == 1.0
    with pytest.raises(ValueError, match="already guided"):
        task.hinted(task.guided(problem, 1), 1)


def test_bad_input_errors():
    with pytest.raises(ValueError, match="multiplier"):
        task.make_problem(12, 10)
    with pytest.raises(ValueError, match="digits"):
        task.make_problem(10**task.SLOTS, 3)
    with pytest.raises(ValueError, match="prefix_steps"):
        task.guided(task.make_problem(12, 3), 3)
    with pytest.raises(ValueError, match="digits range"):
        task.generate(1, digits=(0, 4))
    broken = task.make_problem(12, 3).__class__(id="x", question="12x3=", answer="36")
    assert task.verify("+63+03", broken) == 0.0


def test_tokenization_round_trip(problems):
    tokenizer = task.tokenizer()
    assert tokenizer.vocab_size == len(task.SYMBOLS) + 2
    for problem in problems[:50]:
        for k in (0, len(problem.steps) // 2):
            context = task.format_context(problem, k, tokenizer)
            guided = task.guided(problem, k)
            assert len(context) == len(guided.question)  # one token per character
            assert tokenizer.decode(context) == guided.question
        ids, mask = task.training_ids(problem, problem.solution, tokenizer)
        assert ids[-1] == tokenizer.eos_id and len(ids) == len(mask)
        assert sum(mask) == len(problem.solution) + 1
        completion = tokenizer.decode(ids[len(ids) - sum(mask):])
        assert task.verify(completion, problem) == 1.0
    assert len(ids) <= task.SEQUENCE_LENGTH


def test_verifier_is_registered():
    from jaxprefix import rewards

    assert task.NAME in rewards.names()  # rewards registers every built-in task's verifier
    problem = task.make_problem(47, 6)
    scores, _ = rewards.score_batch(task.NAME, ["+24+82<eos>", "+24+81", "^42+82"], [problem] * 3)
    assert scores.tolist() == [1.0, 0.0, 1.0]
