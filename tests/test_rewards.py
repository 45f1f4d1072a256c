"""Verifiers: math equivalence on a table of answers, answer extraction, exact match, the registry."""

import pytest

from jaxprefix import rewards
from jaxprefix.data import Problem
from jaxprefix.rewards.exact import exact_match
from jaxprefix.rewards.math import FALLBACKS, answer_key, extract_answer, last_boxed

# (completion, reference answer, expected reward)
MATH_TABLE = [
    # fractions and decimals
    ("So the result is \\boxed{\\frac{1}{2}}.", "0.5", 1.0),
    ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
    ("\\boxed{\\dfrac{3}{4}}", "3/4", 1.0),
    ("\\boxed{0.333}", "\\frac{1}{3}", 0.0),
    ("\\boxed{\\frac{2}{3}}", "\\frac{1}{3}", 0.0),
    ("\\boxed{3}", "3.0", 1.0),
    ("\\boxed{1000}", "1,000", 1.0),
    # LaTeX forms
    ("\\boxed{\\sqrt{2}/2}", "\\frac{\\sqrt{2}}{2}", 1.0),
    ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt{2}}{2}", 0.0),
    ("we get \\boxed{x = 3}", "3", 1.0),
    ("\\boxed{\\pi}", "3.14159", 0.0),
    # units, percent, degrees
    ("\\boxed{5\\text{ cm}}", "5", 1.0),
    ("\\boxed{50^\\circ}", "50", 1.0),
    ("\\boxed{6 \\text{ cm}}", "5", 0.0),
    # intervals and sets
    ("\\boxed{(1, 2]}", "(1,2]", 1.0),
    ("\\boxed{(1, 2)}", "(1,2]", 0.0),
    ("\\boxed{[1,2]}", "1 \\le x \\le 2", 1.0),
    ("\\boxed{\\{2, 1\\}}", "\\{1,2\\}", 1.0),
    # multiple boxed answers: the last one counts
    ("First \\boxed{3}, but wait, it is \\boxed{4}.", "4", 1.0),
    ("First \\boxed{3}, but wait, it is \\boxed{4}.", "3", 0.0),
    ("\\boxed{\\frac{1}{\\boxed{2}}} then \\boxed{7}", "7", 1.0),
    # no answer at all / an unclosed box / answer-is fallback (on by default)
    ("I do not know.", "3", 0.0),
    ("\\boxed{3", "3", 0.0),
    ("The final answer is $\\frac{1}{2}$.", "0.5", 1.0),
    ("Answer: 12", "12", 1.0),
    ("", "12", 0.0),
]


@pytest.mark.parametrize("completion,answer,expected", MATH_TABLE)
def test_math_reward_table(completion, answer, expected):
    assert rewards.math_reward(completion, answer) == expected


def test_last_boxed_balances_braces():
    assert last_boxed("a \\boxed{\\frac{1}{2}} b") == "\\frac{1}{2}"
    assert last_boxed("\\boxed{1} \\fbox{{2}}") == "{2}"
    assert last_boxed("\\boxed{1} then \\boxed{2") == "1"  # unclosed last box: the one before
    assert last_boxed("no box") is None


def test_fallbacks_are_configurable():
    text = "we count 9 apples and then 10 more"
    assert extract_answer(text) is None  # default: boxes and "answer is" only
    assert extract_answer(text, FALLBACKS) == "10"
    assert rewards.math_reward(text, "10", fallbacks=FALLBACKS) == 1.0
    assert rewards.math_reward(text, "10") == 0.0
    with pytest.raises(ValueError, match="unknown answer fallback"):
        extract_answer(text, ("nearest_guess",))


def test_answer_key_folds_spacing_and_dfrac():
    assert answer_key("\\boxed{\\dfrac{1}{ 2}}") == answer_key("so \\boxed{\\frac{1}{2}}.") == "\\frac{1}{2}"
    assert answer_key("nothing") is None


def test_exact_and_format_verifiers():
    problem = Problem("t", "reverse abc", "cba")
    assert exact_match("Let me think.\nThe answer is CBA.", problem) == 1.0
    assert exact_match("\\boxed{cba}", problem) == 1.0
    assert exact_match("work\ncba ", problem) == 1.0  # the last line
    assert exact_match("\\boxed{abc}", problem) == 0.0
    assert rewards.get("format")("so \\boxed{1}", problem) == 1.0
    assert rewards.get("format")("so 1", problem) == 0.0


def test_registry_checks_what_workers_can_import():
    assert {"math", "math_lenient", "exact", "format", "reasoning_gym",
            "reasoning_gym_boxed"} <= set(rewards.names())
    with pytest.raises(ValueError, match="cannot be sent to worker processes"):
        rewards.register("anon", lambda text, problem: 1.0)
    rewards.register("anon_in_process", lambda text, problem: 1.0, in_process=True)
    with pytest.raises(ValueError, match="already registered"):
        rewards.register("math", exact_match)
    with pytest.raises(KeyError, match="no verifier named 'nope'; registered: "):
        rewards.get("nope")


def test_in_process_scoring_counts_errors():
    problems = [Problem("a", "q", "x"), Problem("b", "q", "y")]
    scores, stats = rewards.score_batch("exact", ["\\boxed{x}", "\\boxed{x}"], problems)
    assert scores.tolist() == [1.0, 0.0] and stats["errors"] == 0 and stats["count"] == 2
    scores, stats = rewards.score_batch("reasoning_gym", ["1"], problems[:1], workers=0)
    assert scores.tolist() == [0.0] and stats["errors"] == 1  # not a reasoning-gym problem
    with pytest.raises(ValueError, match="2 texts but 1 problems"):
        rewards.score_batch("exact", ["a", "b"], problems[:1])


# --- untrusted output: every verifier bounded -----------------------------------------------

ADVERSARIAL = {  # a megabyte each, the shapes that made extraction quadratic
    "unclosed boxes": "\\boxed{" * ((1 << 20) // len("\\boxed{")),
    "unclosed answer tags": "<answer>" * ((1 << 20) // len("<answer>")),
}


def _problem_for(name):
    from jaxprefix.data import reasoning_gym_problems
    from jaxprefix.data.tasks import TASKS

    if name.startswith("reasoning_gym"):
        return reasoning_gym_problems("gsm_symbolic", 1, 0)[0]
    if name in TASKS:
        return TASKS[name].generate(1, seed=0)[0]
    return Problem("p", "q", "1")


@pytest.mark.parametrize("kind", sorted(ADVERSARIAL))
def test_every_verifier_scores_a_megabyte_of_adversarial_output_within_the_timeout(kind):
    # In this process, so the verifier's own time counts (no worker start-up); the interval
    # timer turns a verifier past 10 s into a counted timeout, where it used to run for hours.
    text = ADVERSARIAL[kind]
    for name in sorted(rewards.names()):
        if name.startswith(("anon", "test_", "slow")) or ".py:" in name:
            continue  # verifiers registered by tests (and reward files they wrote)
        problem = _problem_for(name)
        rewards.score_batch(name, ["1"], [problem], workers=0)  # one-time set-up is not scoring
        scores, stats = rewards.score_batch(name, [text], [problem], timeout_s=10.0, workers=0,
                                            max_chars=0)
        assert stats["timeouts"] == 0 and stats["too_long"] == 0, (name, stats)
        assert scores.tolist() == [0.0] or name == "reasoning_gym", (name, scores)


def test_last_boxed_and_answer_tags_pair_like_before():
    from jaxprefix.rewards.reasoning_gym import final_answer

    assert last_boxed("\\boxed{1}\\boxed{2") == "1"  # an unclosed last box: the one before
    assert last_boxed("}\\boxed{x}}") == "x"
    assert last_boxed("\\fbox {a{b}c}") == "a{b}c"
    assert final_answer("<answer>1</answer> <answer>2</answer> <answer>3") == "2"
    assert final_answer("<answer>a<answer>b</answer>") == "a<answer>b"


def slow_verifier(text, problem):
    while True:  # pure Python: the interval timer interrupts it
        pass


def test_in_process_verifier_past_its_timeout_scores_zero_and_is_counted():
    rewards.register("slow_in_process", slow_verifier, in_process=True, overwrite=True)
    problem = Problem("p", "q", "1")
    scores, stats = rewards.score_batch("slow_in_process", ["a", "b"], [problem] * 2,
                                        timeout_s=0.2)
    assert scores.tolist() == [0.0, 0.0] and stats["timeouts"] == 2


def test_completions_over_the_length_cap_score_zero_unread_and_are_counted():
    problem = Problem("p", "q", "1")
    scores, stats = rewards.score_batch("exact", ["\\boxed{1}" + " " * 100, "\\boxed{1}"],
                                        [problem] * 2, max_chars=50)
    assert scores.tolist() == [0.0, 1.0] and stats["too_long"] == 1
