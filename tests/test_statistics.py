"""The study's statistics against hand computations (jaxprefix/statistics.py)."""
import itertools

import numpy as np
import pytest

from jaxprefix import statistics


def _exact_interval(table, level=0.95):
    """Every two-stage resample of a small [seeds, problems] table, enumerated by hand: its
    mean and its probability, then the inverted-CDF percentiles."""
    table = np.asarray(table, float)
    seeds, problems = table.shape
    means, weights = [], []
    for seed_pick in itertools.product(range(seeds), repeat=seeds):
        for problem_picks in itertools.product(
                itertools.product(range(problems), repeat=problems), repeat=seeds):
            values = [table[s, p] for s, picks in zip(seed_pick, problem_picks) for p in picks]
            means.append(np.mean(values))
            weights.append(1.0)
    order = np.argsort(means)
    means = np.asarray(means)[order]
    cdf = np.cumsum(np.asarray(weights)[order]) / np.sum(weights)
    tail = (1 - level) / 2
    return means[np.searchsorted(cdf, tail)], means[np.searchsorted(cdf, 1 - tail)]


def test_bootstrap_interval_of_a_hand_made_table_equals_the_hand_computation():
    # One seed, scores 0 0 0 1: a resample's mean is K/4, K ~ Binomial(4, 1/4);
    # P(K <= 0) = 0.316 > 0.025 and P(K <= 2) = 0.949 < 0.975 <= P(K <= 3) = 0.996.
    table = [[0.0, 0.0, 0.0, 1.0]]
    assert _exact_interval(table) == (0.0, 0.75)
    assert statistics.bootstrap_interval(table, seed=3) == (0.0, 0.75)


def test_two_stage_bootstrap_over_seeds_and_problems_equals_the_enumeration():
    table = [[0.0, 0.5, 1.0], [1.0, 1.0, 0.5]]
    exact = _exact_interval(table)
    assert statistics.bootstrap_interval(table, resamples=50_000, seed=1) == exact
    # Resampling the seeds widens the interval beyond the problems' alone (pooled per seed).
    one_seed = statistics.bootstrap_interval([table[0]], resamples=50_000, seed=1)
    assert exact[0] < np.mean(table) < exact[1] and one_seed != exact


def test_paired_difference_draws_the_same_problems_for_both_runs():
    a = [[1.0, 1.0, 1.0, 1.0]]
    b = [[0.0, 0.0, 0.0, 1.0]]
    # a - b = 1 1 1 0: the mirror of the table above.
    assert statistics.paired_difference_interval(a, b, seed=5) == (0.25, 1.0)
    # Unpaired, a problem both solve could not cancel: the paired interval is the narrower.
    shifted = [[0.0, 1.0, 1.0, 1.0]]
    assert statistics.paired_difference_interval(shifted, shifted) == (0.0, 0.0)
    with pytest.raises(ValueError, match="one shape"):
        statistics.paired_difference_interval(a, [[1.0, 0.0]])


def test_per_group_table_sums_to_the_overall_one():
    rng = np.random.default_rng(0)
    table = rng.random((3, 10))
    groups = [6, 7, 7, 8, 9, 9, 9, 6, 8, 7]
    by_group = statistics.group_table(table, groups)
    assert [g["problems"] for g in by_group.values()] == [2, 3, 2, 3]
    assert by_group[9]["mean"] == pytest.approx(table[:, [4, 5, 6]].mean())
    assert statistics.overall_from_groups(by_group) == pytest.approx(table.mean())


def test_seed_std_is_the_sample_std_of_the_seed_means():
    table = [[0.2, 0.2], [0.4, 0.4], [0.5, 0.7]]  # seed means 0.2, 0.4, 0.6
    assert statistics.seed_std(table) == pytest.approx(0.2)  # ddof=1; ddof=0 gives 0.163
    assert np.isnan(statistics.seed_std([[0.1, 0.3]]))


def test_pass_at_k_table_is_the_unbiased_estimate_per_problem():
    counts = [[0, 1, 16], [2, 0, 3]]
    table = statistics.pass_at_k_table(counts, n=16, k=1)
    assert table.tolist() == [[0.0, 1 / 16, 1.0], [2 / 16, 0.0, 3 / 16]]
    assert statistics.pass_at_k_table([[1]], n=16, k=16)[0, 0] == 1.0
    cell = statistics.format_cell(statistics.summary(table, resamples=200))
    assert cell.startswith(f"{np.mean(table):.3f} ± ")
