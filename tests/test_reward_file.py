"""rewards.path: a reward function from a Python file, run in the worker pool with failures counted."""
import textwrap

import pytest

from jaxprefix import rewards
from jaxprefix.data.problem import Problem
from jaxprefix.run_setup.problem_sets import load_problem_sets
from jaxprefix.run_setup.learner_settings import validate
from jaxprefix.run_config import base_config

REWARDS = textwrap.dedent("""\
    import time

    def share_of_sevens(completion, problem):
        return completion.count("7") / max(len(completion), 1) + (problem.answer == "1")

    def raises(completion, problem):
        raise RuntimeError("no reward for you")

    def hangs(completion, problem):
        time.sleep(600)

    def text(completion, problem):
        return "1.0"

    def nothing(completion, problem):
        pass

    def not_finite(completion, problem):
        return float("nan")

    def flag(completion, problem):
        return True
    """)
PROBLEMS = [Problem(id=str(i), question="q", answer=str(i)) for i in range(2)]


@pytest.fixture
def reward_file(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(REWARDS)
    return str(path)


def test_a_reward_file_scores_in_the_worker_pool(reward_file):
    name = rewards.verifier_name(f"{reward_file}:share_of_sevens", default="math")
    assert name in rewards.names() and name != "math"
    scores, stats = rewards.score_batch(name, ["777x", "abc"], PROBLEMS, timeout_s=30, workers=1)
    assert scores.tolist() == [0.75, 1.0] and stats["errors"] == stats["timeouts"] == 0
    assert rewards.verifier_name("", default="math") == "math"


def test_raising_hanging_and_non_number_rewards_are_counted_not_raised(reward_file):
    failing = ["raises", "text", "nothing", "not_finite", "flag"]
    for function in failing:
        name = rewards.verifier_name(f"{reward_file}:{function}", default="math")
        scores, stats = rewards.score_batch(name, ["a", "b"], PROBLEMS, timeout_s=30, workers=1)
        assert scores.tolist() == [0.0, 0.0], function
        assert (stats["errors"], stats["timeouts"]) == (2, 0), function
    name = rewards.verifier_name(f"{reward_file}:hangs", default="math")
    scores, stats = rewards.score_batch(name, ["a"], PROBLEMS[:1], timeout_s=1.0, workers=1)
    assert scores.tolist() == [0.0] and (stats["errors"], stats["timeouts"]) == (0, 1)


@pytest.mark.parametrize("spec, message", [
    ("{dir}/absent.py:share_of_sevens", "config.rewards.path='.*absent.py:share_of_sevens': no such file"),
    ("{file}:missing", r"has no function 'missing' \(it defines: flag, hangs, not_finite, nothing, "
                       r"raises, share_of_sevens, text\)"),
    ("{file}", "expected FILE.py:FUNCTION"),
    ("{dir}/broken.py:f", r"broken.py \(line 1\) fails to load: SyntaxError"),
])
def test_a_missing_file_or_function_is_a_one_line_error_before_any_work(reward_file, tmp_path,
                                                                          spec, message):
    (tmp_path / "broken.py").write_text("def f(:\n")
    c = base_config()
    c.rewards.path = spec.format(dir=tmp_path, file=reward_file)
    with pytest.raises((ValueError, FileNotFoundError), match=message) as error:
        validate(c)  # what the rl job checks before it loads a model
    assert "\n" not in str(error.value)
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        load_problem_sets(c.data, rewards_path=c.rewards.path)  # eval and mine jobs


def test_problem_sets_carry_the_file_verifier(reward_file):
    c = base_config()
    c.data.update(train_size=4, eval_size=2)
    sets = load_problem_sets(c.data, rewards_path=f"{reward_file}:share_of_sevens")
    assert sets.verifier.endswith("my_rewards.py:share_of_sevens")
    assert load_problem_sets(c.data).verifier == c.data.verifier
