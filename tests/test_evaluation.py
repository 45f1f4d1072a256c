"""pass@k and friends against hand-computed values and brute force over all k-subsets."""

import itertools
import json
import math

import numpy as np
import pytest

from jaxprefix.data import Problem
from jaxprefix.evaluation import (avg_at_k, best_at_k, evaluate_completions, maj_at_k, order_weights,
                                  pass_at_k, summarize, worst_at_k, write_report)


def test_pass_at_k_by_hand():
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)
    # 1 - C(7,5)/C(10,5) = 1 - 21/252
    assert pass_at_k(10, 3, 5) == pytest.approx(1 - 21 / 252)
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 3 of the 6 pairs hold the correct one
    assert pass_at_k(10, 0, 10) == 0.0
    assert pass_at_k(10, 8, 3) == 1.0  # only 2 wrong: every 3-subset holds a correct one
    assert pass_at_k(5, 5, 1) == 1.0


def test_pass_at_k_against_brute_force_and_large_n():
    rng = np.random.default_rng(0)
    for _ in range(20):
        n = int(rng.integers(1, 9))
        correct = rng.random(n) < 0.4
        for k in range(1, n + 1):
            subsets = list(itertools.combinations(range(n), k))
            brute = np.mean([correct[list(s)].any() for s in subsets])
            assert pass_at_k(n, int(correct.sum()), k) == pytest.approx(brute, abs=1e-12)
    # Large n, where C(n, k) overflows floats: the product form stays exact.
    exact = 1 - math.comb(2000 - 3, 500) / math.comb(2000, 500)
    assert pass_at_k(2000, 3, 500) == pytest.approx(exact, rel=1e-12)


@pytest.mark.parametrize("args", [(5, 6, 1), (5, 2, 0), (5, 2, 6), (5, -1, 1)])
def test_pass_at_k_rejects_impossible_counts(args):
    with pytest.raises(ValueError, match="pass_at_k"):
        pass_at_k(*args)


def test_best_and_worst_at_k_against_brute_force():
    rng = np.random.default_rng(1)
    rewards = rng.random((3, 7)).round(2)
    for k in range(1, 8):
        subsets = [list(s) for s in itertools.combinations(range(7), k)]
        best = np.mean([[row[s].max() for s in subsets] for row in rewards])
        worst = np.mean([[row[s].min() for s in subsets] for row in rewards])
        assert best_at_k(rewards, k) == pytest.approx(best)
        assert worst_at_k(rewards, k) == pytest.approx(worst)
        assert order_weights(7, k).sum() == pytest.approx(1.0)
    # By hand: rewards (0, 1, 0.5, 0.2); pair maxima 1, .5, .2, 1, 1, .5 -> 4.2 / 6.
    assert best_at_k([[0.0, 1.0, 0.5, 0.2]], 2) == pytest.approx(0.7)
    assert worst_at_k([[0.0, 1.0, 0.5, 0.2]], 2) == pytest.approx(0.15)


def test_binary_best_at_k_is_pass_at_k_and_avg_is_the_mean():
    correct = np.array([[1, 0, 0, 1, 0], [0, 0, 0, 0, 1]], float)
    for k in range(1, 6):
        expected = np.mean([pass_at_k(5, 2, k), pass_at_k(5, 1, k)])
        assert best_at_k(correct, k) == pytest.approx(expected)
        assert avg_at_k(correct, k) == pytest.approx(0.3)


def test_maj_at_k_by_hand_and_ties():
    answers = [["a", "b", "c", "a"]]
    correct = [[1, 0, 0, 1]]
    # Pairs: (a,b) (a,c) (b,a) (c,a) are ties, half right; (a,a) right; (b,c) a wrong tie.
    assert maj_at_k(answers, correct, 2) == pytest.approx(3 / 6)
    assert maj_at_k(answers, correct, 4) == 1.0
    assert maj_at_k([["x", "x", None, "y"]], [[0, 0, 0, 1]], 4) == 0.0  # x outvotes y
    assert maj_at_k([[None, None]], [[0, 0]], 2) == 0.0


def test_summarize_and_report(tmp_path):
    rewards = np.array([[1, 0, 0, 1], [0, 0, 0, 0]], float)
    report = summarize(rewards, ks=(1, 2, 8))
    assert report["pass@1"] == pytest.approx(0.25)
    assert report["pass@2"] == pytest.approx((1 - 1 / 6) / 2)
    assert report["worst@2"] == pytest.approx((1 / 6) / 2)
    assert report["solved_fraction"] == 0.5 and "pass@8" not in report
    write_report(tmp_path / "eval" / "report.json", report)
    assert json.loads((tmp_path / "eval" / "report.json").read_text()) == report
    with pytest.raises(ValueError, match=r"\[problems, samples\]"):
        summarize(np.zeros(4), ks=(1,))


def test_evaluate_completions_scores_and_summarises():
    problems = [Problem("a", "1/2?", "\\frac{1}{2}"), Problem("b", "2+2?", "4")]
    completions = [["\\boxed{0.5}", "\\boxed{1/3}"], ["\\boxed{5}", "\\boxed{5}"]]
    result = evaluate_completions(problems, completions, verifier="math", ks=(1, 2), workers=0)
    assert result["metrics"]["pass@1"] == pytest.approx(0.25)
    assert result["metrics"]["pass@2"] == pytest.approx(0.5)
    assert result["metrics"]["maj@2"] == pytest.approx(0.25)  # a: tie, half right; b: 5 wins
    assert result["problems"][0] == {"id": "a", "samples": 2, "correct": 1, "mean_reward": 0.5}
    assert result["verifier"]["count"] == 4
