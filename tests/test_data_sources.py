"""TFDS and reasoning-gym sources load small fixtures into Problems; the reasoning-gym verifier."""

import os
import re

import pytest

from jaxprefix import rewards
from jaxprefix.data import DataError, load_problems
from jaxprefix.data.reasoning_gym_source import reasoning_gym_problems
from jaxprefix.rewards.reasoning_gym import (_entry, boxed_or_last, final_answer,
                                             reasoning_gym_box_nudged_verifier,
                                             reasoning_gym_box_own_verifier,
                                             reasoning_gym_boxed_verifier,
                                             reasoning_gym_right_boxed_verifier,
                                             reasoning_gym_verifier)

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")


def test_tfds_round_trip_through_array_record(tmp_path):
    from jaxprefix.data import tfds_source

    path = os.path.join(FIXTURES, "math_problems.jsonl")
    name = tfds_source.build_from_file(path, "fixture_math", tmp_path)
    assert name == "jaxprefix_problems/fixture_math"
    assert list((tmp_path / "jaxprefix_problems" / "fixture_math" / "1.0.0").glob("*.array_record*"))
    loaded = tfds_source.tfds_problems(name, data_dir=tmp_path)
    original = load_problems(path)
    assert sorted(loaded, key=lambda p: p.id) == sorted(original, key=lambda p: p.id)
    with pytest.raises(DataError, match="exists; pass overwrite=True"):
        tfds_source.build_from_file(path, "fixture_math", tmp_path)
    tfds_source.build_problem_dataset(original[:2], "fixture_math", tmp_path, overwrite=True)
    assert len(tfds_source.tfds_problems(name, data_dir=tmp_path)) == 2
    with pytest.raises(DataError, match="cannot be opened"):
        tfds_source.tfds_problems("jaxprefix_problems/absent", data_dir=tmp_path)


def test_reasoning_gym_problems_are_deterministic_with_oracle_text():
    problems = reasoning_gym_problems("gsm_symbolic", size=3, seed=7)
    assert [p.id for p in problems] == ["rg/gsm_symbolic/7/0", "rg/gsm_symbolic/7/1", "rg/gsm_symbolic/7/2"]
    assert problems == reasoning_gym_problems("gsm_symbolic", size=3, seed=7)
    assert all(p.solution and len(p.solution) > len(p.answer) for p in problems)  # answer_cot
    assert problems[0].metadata["rg_task"] == "gsm_symbolic"
    arithmetic = reasoning_gym_problems("basic_arithmetic", size=2, seed=1)
    assert arithmetic[0].solution is None  # this generator writes no worked solution
    with pytest.raises(DataError, match="cannot be created"):
        reasoning_gym_problems("no_such_task", size=2, seed=0)


def test_reasoning_gym_verifier_uses_the_generators_scoring():
    [problem] = reasoning_gym_problems("basic_arithmetic", size=1, seed=1)
    right = f"Thinking...\n<answer>{problem.answer}</answer>"
    wrong = f"<answer>{int(problem.answer) + 1}</answer>"
    assert reasoning_gym_verifier(right, problem) == 1.0
    assert reasoning_gym_verifier(wrong, problem) == 0.0
    assert reasoning_gym_verifier(f"so \\boxed{{{problem.answer}}}", problem) == 1.0
    scores, stats = rewards.score_batch("reasoning_gym", [right, wrong], [problem] * 2, workers=0)
    assert scores.tolist() == [1.0, 0.0] and stats["errors"] == 0


def test_boxed_verifier_values_the_right_answer_and_the_box():
    [problem] = reasoning_gym_problems("chain_sum", size=1, seed=3, min_terms=2, max_terms=2)
    answer, wrong = problem.answer, str(int(problem.answer) + 1)
    score = reasoning_gym_boxed_verifier
    assert score(f"so it is \\boxed{{{answer}}}.", problem) == pytest.approx(1.0)
    assert score(f"{answer} is the sum, I think.", problem) == pytest.approx(0.8)  # last number
    assert score(f"{answer}, no: \\boxed{{{wrong}}}", problem) == pytest.approx(0.2)  # the box wins
    assert score(f"{answer} then {wrong}", problem) == 0.0
    assert score(f"{answer} \\boxed{{}}", problem) == pytest.approx(0.8)  # an empty box is none
    # pass@k's threshold (reward > 0.5) is the right answer, boxed or not
    assert score(f"{wrong} \\boxed{{{answer}}}", problem) > 0.5 > score(f"\\boxed{{{wrong}}}", problem)


def test_right_boxed_verifier_pays_the_box_on_right_answers_only():
    [problem] = reasoning_gym_problems("chain_sum", size=1, seed=3, min_terms=2, max_terms=2)
    answer, wrong = problem.answer, str(int(problem.answer) + 1)
    score = reasoning_gym_right_boxed_verifier
    assert score(f"so it is \\boxed{{{answer}}}.", problem) == pytest.approx(1.0)
    assert score(f"{answer} is the sum, I think.", problem) == pytest.approx(0.6)
    assert score(f"{answer}, no: \\boxed{{{wrong}}}", problem) == 0.0  # a wrong box earns nothing
    assert score(f"{answer} \\boxed{{}}", problem) == pytest.approx(0.6)
    # pass@k's threshold (reward > 0.5) is the right answer, boxed or not
    assert score(f"{answer} is the sum", problem) > 0.5


def test_box_nudges_pay_a_wrong_box_a_little_and_box_own_only_around_its_own_result():
    [problem] = reasoning_gym_problems("chain_sum", size=1, seed=3, min_terms=2, max_terms=2)
    answer, wrong = problem.answer, str(int(problem.answer) + 1)
    assert "7" not in (answer, wrong) and "1234" not in (answer, wrong)
    cases = {  # completion: (reasoning_gym_box_nudged, reasoning_gym_box_own)
        f"so it is \\boxed{{{answer}}}.": (1.0, 1.0),
        f"{answer} is the sum": (0.6, 0.6),
        f"1 + 2 = {wrong}\n\\boxed{{{wrong}}}": (0.1, 0.1),
        "it is 1,234\n\\boxed{1234}": (0.1, 0.1),
        "7 + 2 = 9\n\n\\boxed{7}": (0.1, 0.0),     # run 5's copy of the prompt's example
        "\\boxed{7}": (0.1, 0.0),                    # no result of its own
        "\\boxed{7} then \\boxed{": (0.1, 0.0),      # the number before is the box's own
        f"{wrong} then \\boxed{{}}": (0.0, 0.0),      # an empty box is none
        wrong: (0.0, 0.0),
    }
    for completion, expected in cases.items():
        got = (reasoning_gym_box_nudged_verifier(completion, problem),
               reasoning_gym_box_own_verifier(completion, problem))
        assert got == pytest.approx(expected), completion


def test_box_own_pays_no_nudge_for_an_operand_copied_from_the_question():
    [problem] = reasoning_gym_problems("chain_sum", size=1, seed=3, min_terms=2, max_terms=2)
    operand = re.findall(r"\d+", problem.question)[0]
    assert operand != problem.answer
    restated = f"We add {operand} first.\n\\boxed{{{operand}}}"  # boxes the last number written
    assert reasoning_gym_box_nudged_verifier(restated, problem) == pytest.approx(0.1)
    assert reasoning_gym_box_own_verifier(restated, problem) == 0.0


def test_partial_credit_is_not_a_right_answer():
    # chain_sum's score_answer pays len(answer)/len(read) when the read answer contains the right
    # one: a boxed "-15" for 15 scores 0.67 there, above pass@k's 0.5; here it is wrong.
    [problem] = reasoning_gym_problems("chain_sum", size=1, seed=3, min_terms=2, max_terms=2)
    padded = f"\\boxed{{{problem.answer}0}}" if problem.answer.startswith("-") else \
        f"\\boxed{{-{problem.answer}}}"
    dataset, entry = _entry(problem)
    read = boxed_or_last(padded, problem.answer)
    assert 0.5 < dataset.score_answer(read, entry) < 1.0  # the generator's partial credit
    for verifier in (reasoning_gym_verifier, reasoning_gym_boxed_verifier,
                     reasoning_gym_right_boxed_verifier, reasoning_gym_box_own_verifier):
        assert verifier(padded, problem) <= 0.5, verifier.__name__
    assert reasoning_gym_verifier(f"\\boxed{{{problem.answer}}}", problem) == 1.0


def test_boxed_or_last_reads_numbers_only_for_numeric_answers():
    assert boxed_or_last("1,234 then 5,678.", "5678") == "5678"
    assert boxed_or_last("-3 and \\boxed{x}", "-3") == "x"
    assert boxed_or_last("the word is\n  cat  \n", "cat") == "cat"
    assert boxed_or_last("no digits", "12") == ""


def test_held_out_reasoning_gym_problems_share_no_question_with_training():
    # reasoning-gym seeds entry i with seed + i: seeds 1 and 2 share all but one entry
    from jaxprefix import run_config
    from jaxprefix.errors import ConfigError
    from jaxprefix.run_setup.problem_sets import load_problem_sets

    config = run_config.base_config()
    config.data.update(source="reasoning_gym", task="chain_sum", train_size=64, eval_size=32,
                       seed=1, eval_seed=2, verifier="reasoning_gym_boxed",
                       task_config='{"min_terms": 2, "max_terms": 3, "max_digits": 2}')
    sets = load_problem_sets(config.data)
    assert len(sets.eval) >= 28  # a few exact repeats of small sums may be dropped
    assert not {p.question for p in sets.eval} & {p.question for p in sets.train}
    assert all(len(p.question.split(":")[-1].split("=")[0].split()) <= 5 for p in sets.train)
    config.data.task_config = "[2, 3]"
    with pytest.raises(ConfigError, match="config.data.task_config='\\[2, 3\\]': expected a JSON "):
        load_problem_sets(config.data)


def test_held_out_file_problems_leave_out_training_questions(tmp_path, caplog):
    import json

    from jaxprefix import run_config
    from jaxprefix.run_setup.problem_sets import load_problem_sets

    rows = [{"question": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(6)]
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows[:4]))
    (tmp_path / "test.jsonl").write_text("\n".join(json.dumps(r) for r in rows[2:]))
    config = run_config.base_config()
    config.data.update(source="file", path=str(tmp_path / "train.jsonl"),
                       eval_path=str(tmp_path / "test.jsonl"), verifier="exact")
    with caplog.at_level("WARNING"):
        sets = load_problem_sets(config.data)
    assert [p.question for p in sets.eval] == ["What is 4 + 1?", "What is 5 + 1?"]
    assert "2 of 4 held-out problems left out" in caplog.text


def test_chain_sum_gets_a_worked_solution_one_operation_a_line():
    from jaxprefix.data.worked_solutions import chain_sum
    from jaxprefix.methods.prompting import oracle_units

    problems = reasoning_gym_problems("chain_sum", size=16, seed=5, min_terms=5, max_terms=6,
                                      min_digits=2, max_digits=3)
    for problem in problems:
        lines = problem.solution.split("\n")
        terms = problem.metadata["entry"]["num_terms"]
        assert len(lines) == terms and lines[-1] == f"So the answer is \\boxed{{{problem.answer}}}."
        for line in lines[:-1]:  # each line's arithmetic is right, and the next starts from it
            left, right = line.split(" = ")
            assert eval(left) == int(right)
        assert reasoning_gym_boxed_verifier(problem.solution, problem) == pytest.approx(1.0)
        assert oracle_units(problem) == terms  # the methods cut it a line at a time
    entry = {"answer": "5", "metadata": {"expression": "2 + 3"}}
    assert chain_sum(entry) == "2 + 3 = 5\nSo the answer is \\boxed{5}."
    assert chain_sum({"answer": "6", "metadata": {"expression": "2 + 3"}}) is None  # no wrong oracle
    assert chain_sum({"answer": "6", "metadata": {"expression": "2 * 3"}}) is None


def test_final_answer_prefers_tags_then_box_then_last_line():
    assert final_answer("<answer>a</answer> \\boxed{b}") == "a"
    assert final_answer("x \\boxed{b}\nmore") == "b"
    assert final_answer("work\n 42 \n\n") == "42"


def _counted(monkeypatch, name: str) -> list:
    """jaxprefix.data.<name> wrapped to record its calls (the loader reads it from there)."""
    import jaxprefix.data

    calls, real = [], getattr(jaxprefix.data, name)

    def counted(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(jaxprefix.data, name, counted)
    return calls


def test_a_generated_source_is_generated_once_a_process(monkeypatch):
    """Preflight, the job and each of a study's runs load the problem sets: a generated source
    (reasoning-gym, the built-in tasks) is generated once for the same fields (issue 42), each
    load getting its own lists; other fields generate again."""
    from jaxprefix import run_config
    from jaxprefix.run_setup import problem_sets

    calls = _counted(monkeypatch, "reasoning_gym_problems")
    config = run_config.base_config()
    config.data.update(source="reasoning_gym", task="chain_sum", train_size=8, eval_size=4,
                       seed=11, eval_seed=12, verifier="reasoning_gym_boxed")
    first = problem_sets.load_problem_sets(config.data)
    again = problem_sets.load_problem_sets(config.data)
    assert len(calls) == 2  # train and held out, once
    assert again == first and again.train is not first.train
    config.data.seed = 13
    problem_sets.load_problem_sets(config.data)
    assert len(calls) == 4


def test_a_problem_file_is_read_once_a_process_until_it_changes(monkeypatch, tmp_path):
    """Preflight and the job both load a file source: read once, with each problem's file:line
    kept for the error messages; a file that changed since is read again."""
    import json

    from jaxprefix import run_config
    from jaxprefix.run_setup import problem_sets

    path = tmp_path / "problems.jsonl"
    path.write_text("".join(json.dumps({"question": f"{i} + 1 = ?", "answer": str(i + 1)}) + "\n"
                            for i in range(4)))
    calls = _counted(monkeypatch, "read_problem_file")
    config = run_config.base_config()
    config.data.update(source="file", path=str(path), verifier="math")
    first_where, again_where = {}, {}
    first = problem_sets._load(config.data, first_where)
    again = problem_sets._load(config.data, again_where)
    assert len(calls) == 1 and again == first and again.train is not first.train
    assert again_where == first_where and first_where[first.train[2].id].endswith(":line 3")
    with open(path, "a") as f:
        f.write(json.dumps({"question": "9 + 1 = ?", "answer": "10"}) + "\n")
    assert len(problem_sets._load(config.data, {}).train) == 5 and len(calls) == 2
