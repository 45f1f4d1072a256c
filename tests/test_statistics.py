"""The study's statistics against hand computations (jaxprefix/statistics.py)."""
import itertools

import numpy as np
import pytest

from jaxprefix import statistics


def _exact_interval(table, level=0.95):
    """Every crossed resample of a small [seeds, problems] table, enumerated by hand: the seeds
    drawn with replacement and ONE draw of the problems used for every drawn seed; each
    resample's mean, then the inverted-CDF percentiles."""
    table = np.asarray(table, float)
    seeds, problems = table.shape
    means = [table[np.ix_(seed_pick, problem_pick)].mean()
             for seed_pick in itertools.product(range(seeds), repeat=seeds)
             for problem_pick in itertools.product(range(problems), repeat=problems)]
    means = np.sort(means)
    cdf = np.arange(1, len(means) + 1) / len(means)
    tail = (1 - level) / 2
    return means[np.searchsorted(cdf, tail)], means[np.searchsorted(cdf, 1 - tail)]


def _crossed_table(seed_ms, problem_ms, noise_ms, seeds=3, problems=128, rng_seed=0):
    """A [seeds, problems] table m + r_s + c_p + e_sp whose variance components are set by
    hand: mean(r^2), mean(c^2), mean(e^2) exactly the given values (r, c centred; e centred
    along both axes, so the three are the table's exact two-way decomposition)."""
    rng = np.random.default_rng(rng_seed)

    def scaled(x, ms):
        return x * np.sqrt(ms / np.mean(x ** 2))

    r = rng.normal(size=seeds)
    c = rng.normal(size=problems)
    e = rng.normal(size=(seeds, problems))
    e = e - e.mean(0) - e.mean(1, keepdims=True) + e.mean()
    return (0.5 + scaled(r - r.mean(), seed_ms)[:, None]
            + scaled(c - c.mean(), problem_ms)[None, :] + scaled(e, noise_ms))


def _analytic_crossed_width(seed_ms, problem_ms, noise_ms, seeds=3, problems=128):
    """2 x 1.96 x the crossed design's sd of the mean: sqrt(ms_r/S + ms_c/P + ms_e/(S P))."""
    return 2 * 1.959964 * np.sqrt(seed_ms / seeds + problem_ms / problems
                                  + noise_ms / (seeds * problems))


def _nested_interval(table, resamples=10_000, seed=0):
    """The old design (before issue 28): a fresh problem resample for every seed slot."""
    table = np.asarray(table, float)
    seeds, problems = table.shape
    rng = np.random.default_rng(seed)
    seed_idx = rng.integers(0, seeds, size=(resamples, seeds))
    problem_idx = rng.integers(0, problems, size=(resamples, seeds, problems))
    means = np.take_along_axis(table[seed_idx], problem_idx, axis=2).mean(axis=(1, 2))
    return statistics.percentile_interval(means)


def test_bootstrap_interval_of_a_hand_made_table_equals_the_hand_computation():
    # One seed, scores 0 0 0 1: a resample's mean is K/4, K ~ Binomial(4, 1/4);
    # P(K <= 0) = 0.316 > 0.025 and P(K <= 2) = 0.949 < 0.975 <= P(K <= 3) = 0.996.
    table = [[0.0, 0.0, 0.0, 1.0]]
    assert _exact_interval(table) == (0.0, 0.75)
    assert statistics.bootstrap_interval(table, seed=3) == (0.0, 0.75)


def test_crossed_bootstrap_over_seeds_and_problems_equals_the_enumeration():
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


# Problems dominate (as on a held-out set: a hard problem is hard at every seed), the seeds
# and the residual are small: the crossed mean is close to normal, so its 95% percentile
# interval is 2 x 1.96 sd. Tolerance 5%: with 10,000 draws each percentile end has a Monte
# Carlo sd of sqrt(0.025 x 0.975 / 1e4) / phi(1.96) = 0.027 sd, so the width's is ~1% of
# itself; the rest of the 5% is the mean's small departure from normal (3 seeds). The nested
# design's width is ~0.65x this here: 7 tolerances away.
SEED_MS, PROBLEM_MS, NOISE_MS = 2.5e-5, 1e-2, 2.5e-3


def test_interval_of_a_crossed_table_has_the_analytic_crossed_width():
    table = _crossed_table(SEED_MS, PROBLEM_MS, NOISE_MS)
    analytic = _analytic_crossed_width(SEED_MS, PROBLEM_MS, NOISE_MS)
    low, high = statistics.bootstrap_interval(table)
    assert high - low == pytest.approx(analytic, rel=0.05)
    assert low < table.mean() < high
    low, high = _nested_interval(table)
    assert (high - low) / analytic < 0.75  # the old design: too narrow, fails the check above


def test_crossed_draws_have_the_exact_crossed_variance_whatever_dominates():
    # crossed_variance is the draws' exact variance for any table (module docstring); with
    # 10,000 draws the sample variance's relative sd is sqrt((kurtosis - 1) / 1e4) <= 3% for
    # these tables (kurtosis <= 10, the 3-seed one), so 10% is >3 sd.
    for components in [(SEED_MS, PROBLEM_MS, NOISE_MS), (1e-2, 1e-4, 1e-3), (0, 0, 1e-2)]:
        table = _crossed_table(*components)
        expected = (components[0] / 3 + components[1] / 128 + components[2] / (3 * 128))
        assert statistics.crossed_variance(table) == pytest.approx(expected, rel=1e-9)
        assert np.var(statistics.bootstrap_means(table)) == pytest.approx(expected, rel=0.10)


def test_paired_difference_uses_one_problem_draw_for_both_arms():
    # Both arms share a large problem effect (it cancels) and differ by a small arm x problem
    # effect: the paired interval has the crossed width of the difference table alone.
    shared = _crossed_table(SEED_MS, 4e-2, NOISE_MS, rng_seed=1)
    gap = _crossed_table(SEED_MS, PROBLEM_MS, NOISE_MS, rng_seed=2) - 0.5 + 0.03
    low, high = statistics.paired_difference_interval(shared + gap, shared)
    assert high - low == pytest.approx(_analytic_crossed_width(SEED_MS, PROBLEM_MS, NOISE_MS),
                                       rel=0.05)
    assert low < 0.03 < high


def test_zero_success_upper_bound_is_the_exact_binomial_one():
    # By hand: ln 0.05 = -2.995732; / 6144 = -4.87586e-4; 1 - exp(-4.87586e-4) = 4.87467e-4.
    assert statistics.zero_upper_bound(6144) == pytest.approx(4.87467e-4, rel=1e-5)
    assert (1 - statistics.zero_upper_bound(6144)) ** 6144 == pytest.approx(0.05)
    assert statistics.zero_upper_bound(1) == pytest.approx(0.95)  # 0 of 1 bounds little
    zeros = np.zeros((1, 384))  # 384 problems x 16 samples, one seed
    cell = statistics.summary(zeros, samples=384 * 16, resamples=200)
    assert statistics.format_cell(cell) == "0.000 [0.000, 0.000] (rate < 4.9e-4, 0 of 6144)"
    one = zeros.copy()
    one[0, 3] = 1 / 16  # a success: no zero bound
    assert "rate <" not in statistics.format_cell(statistics.summary(one, samples=6144,
                                                                     resamples=200))
    assert "rate <" not in statistics.format_cell(statistics.summary(zeros, resamples=200))


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
