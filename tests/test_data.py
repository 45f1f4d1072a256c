"""Problem records, file sources with their bad-input errors, and the checkpointable loader."""

import json
import os
import pickle

import pytest

from jaxprefix.data import DataError, Problem, load_problems, read_problem_file
from jaxprefix.data.loader import ProblemLoader

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")


# --- Problem -------------------------------------------------------------------------------------

def test_problem_is_hashable_picklable_and_round_trips_json():
    problem = Problem("p1", "What is 1+1?", "2", solution="1+1=2", steps=("1+1=2",), source="s",
                      metadata={"difficulty": 3, "tags": ("easy", "sum")})
    assert pickle.loads(pickle.dumps(problem)) == problem
    assert Problem.from_json(problem.to_json()) == problem
    assert {problem: 1}[Problem.from_json(problem.to_json())] == 1
    assert problem.metadata["tags"] == ["easy", "sum"]  # JSON-normalised on construction
    with pytest.raises(TypeError):
        problem.metadata["x"] = 1  # read-only
    with pytest.raises(TypeError, match="Problem.answer"):
        Problem("p", "q", 2)


def test_oracle_steps_from_solution_lines():
    assert Problem("p", "q", "a", solution="one\n\ntwo\n").oracle_steps == ("one", "two")
    assert Problem("p", "q", "a", solution="x", steps=("s1", "s2")).oracle_steps == ("s1", "s2")


# --- files ---------------------------------------------------------------------------------------

def test_jsonl_fixture_loads_with_metadata_and_stable_ids():
    problems = load_problems(os.path.join(FIXTURES, "math_problems.jsonl"))
    assert [p.answer for p in problems] == ["\\frac{5}{6}", "4", "(-2, 2)", "9"]  # 9 was a number
    assert problems[0].metadata == {"difficulty": 1, "tags": ["fractions"]}
    assert problems[1].solution.startswith("Subtract 3")
    assert problems[0].source == "math_problems"
    again = load_problems(os.path.join(FIXTURES, "math_problems.jsonl"))
    assert [p.id for p in again] == [p.id for p in problems]
    assert len({p.id for p in problems}) == 4


def test_parquet_fixture_with_nested_fields_and_chat_prompt():
    problems = load_problems(os.path.join(FIXTURES, "dapo_style.parquet"), question_field="prompt",
                             answer_field="reward_model.ground_truth", id_field="extra_info.index")
    assert [p.id for p in problems] == ["0", "1", "2"]
    assert problems[0].question == "Compute $3 \\cdot 7 - 1$."  # the user turn, not the system one
    assert problems[1].answer == "\\frac{1}{4}"
    assert problems[2].solution == "2^5 = 32, 32^2 = 1024."
    assert problems[0].metadata["data_source"] == "dapo-like"


def test_json_list_and_solution_given_as_steps(tmp_path):
    path = tmp_path / "set.json"
    path.write_text(json.dumps([{"id": "a", "question": "q", "answer": "1", "solution": ["s1", "s2"]}]))
    [problem] = load_problems(path, id_field="id")
    assert problem.steps == ("s1", "s2") and problem.solution == "s1\ns2"


def _write(tmp_path, name, content: bytes):
    path = tmp_path / name
    path.write_bytes(content)
    return str(path)


GOOD = b'{"question": "q1", "solution": "s", "answer": "1"}\n'

BAD_CASES = {
    "malformed JSON": (b'{"question": "q2", "answer": ', "line 2", "malformed JSON"),
    "missing field": (b'{"question": "q2", "solution": "s"}', "line 2", "field 'answer' is missing"),
    "wrong type": (b'{"question": ["q2"], "answer": "2"}', "line 2", "field 'question': expected a non-empty string"),
    "answer wrong type": (b'{"question": "q2", "answer": {"v": 2}}', "line 2", "field 'answer'"),
    "not an object": (b'[1, 2]', "line 2", "expected a JSON object"),
    "non-UTF-8": (b'{"question": "caf\xe9", "answer": "2"}', "line 2", "not valid UTF-8"),
    "duplicate id": (GOOD, "line 2", "duplicate id"),
}


@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_bad_record_names_file_line_and_field(tmp_path, case):
    bad, line, message = BAD_CASES[case]
    path = _write(tmp_path, "data.jsonl", GOOD + bad + b"\n" + GOOD.replace(b"q1", b"q3"))
    with pytest.raises(DataError) as error:
        load_problems(path)
    assert f"{path}:{line}" in str(error.value) and message in str(error.value)
    # The explicit option skips exactly that record and reports it.
    report = read_problem_file(path, skip_invalid=True)
    assert [p.question for p in report.problems] == ["q1", "q3"]
    assert len(report.skipped) == 1 and line in report.skipped[0]


def test_byte_order_mark_is_tolerated(tmp_path):
    path = _write(tmp_path, "bom.jsonl", b"\xef\xbb\xbf" + GOOD)
    assert load_problems(path)[0].question == "q1"


def test_empty_file_and_all_invalid_and_unknown_suffix(tmp_path):
    with pytest.raises(DataError, match="empty"):
        load_problems(_write(tmp_path, "empty.jsonl", b"\n \n"))
    with pytest.raises(DataError, match="all 1 records invalid"):
        load_problems(_write(tmp_path, "bad.jsonl", b"{}\n"), skip_invalid=True)
    with pytest.raises(DataError, match="unknown file type '.csv'"):
        load_problems(_write(tmp_path, "x.csv", b"question,answer\n"))
    with pytest.raises(DataError, match="no such file"):
        load_problems(tmp_path / "missing.jsonl")


def test_required_solution_and_bad_parquet(tmp_path):
    path = _write(tmp_path, "nosol.jsonl", b'{"question": "q", "answer": "1"}\n')
    assert load_problems(path)[0].solution is None
    with pytest.raises(DataError, match=r"line 1: field 'solution': an oracle solution is required"):
        load_problems(path, require_solution=True)
    with pytest.raises(DataError, match="not a readable parquet file"):
        load_problems(_write(tmp_path, "broken.parquet", b"not parquet at all"))


def test_json_file_errors_name_the_line(tmp_path):
    with pytest.raises(DataError, match=r"set.json:line 3: malformed JSON"):
        load_problems(_write(tmp_path, "set.json", b'[\n{"question": "q", "answer": "1"},\n{oops}\n]'))
    with pytest.raises(DataError, match=r"set2.json:record 1: field 'answer' is missing"):
        load_problems(_write(tmp_path, "set2.json", b'[{"question": "q", "answer": "1"}, {"question": "r"}]'))


# --- loader --------------------------------------------------------------------------------------

def _problems(n):
    return [Problem(f"p{i}", f"q{i}", str(i)) for i in range(n)]


def test_loader_is_deterministic_and_covers_each_epoch():
    problems = _problems(10)
    a, b = ProblemLoader(problems, 5, seed=3), ProblemLoader(problems, 5, seed=3)
    first = [p.id for _ in range(2) for p in a.next_batch()]
    assert first == [p.id for _ in range(2) for p in b.next_batch()]
    assert sorted(first) == sorted(p.id for p in problems)  # one epoch is a permutation
    second = [p.id for _ in range(2) for p in a.next_batch()]
    assert sorted(second) == sorted(first) and second != first  # a new order each epoch
    assert [p.id for p in ProblemLoader(problems, 10, seed=4).next_batch()] != first


def test_loader_shards_are_disjoint_and_equal():
    problems = _problems(11)
    shards = [ProblemLoader(problems, 5, seed=0, shard_index=i, shard_count=2).next_batch() for i in range(2)]
    ids = [{p.id for p in shard} for shard in shards]
    assert len(ids[0]) == len(ids[1]) == 5 and not ids[0] & ids[1]


def test_loader_restore_continues_the_same_order():
    problems = _problems(7)
    loader = ProblemLoader(problems, 3, seed=1)
    for _ in range(3):
        loader.next_batch()
    state = json.loads(json.dumps(loader.state()))  # survives a checkpoint as JSON
    expected = [[p.id for p in loader.next_batch()] for _ in range(4)]
    resumed = ProblemLoader(problems, 3, seed=1)
    resumed.restore(state)
    assert [[p.id for p in resumed.next_batch()] for _ in range(4)] == expected
    with pytest.raises(ValueError, match="num_problems"):
        ProblemLoader(_problems(8), 3, seed=1).restore(state)


def test_parquet_bad_row_names_row_and_field(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = str(tmp_path / "rows.parquet")
    pq.write_table(pa.Table.from_pylist([{"question": "q1", "answer": [1]}, {"question": "q2", "answer": []}]), path)
    with pytest.raises(DataError, match=r"rows.parquet:row 0: field 'answer': expected a non-empty string or a number"):
        load_problems(path)
