"""The study's statistics (jaxprefix/statistics.py): the intervals' coverage measured by
simulation, and the rest against hand computations."""
import numpy as np
import pytest
from scipy import stats

from jaxprefix import statistics

REPLICATES = 2000  # binomial sd of a coverage near 0.95: sqrt(0.95 x 0.05 / 2000) = 0.005
BAND = (0.93, 0.97)
# Each regime: the shares of Var(mean) carried by the seeds, the problems and the residual.
REGIMES = {"seeds dominate": (0.8, 0.1, 0.1), "problems dominate": (0.1, 0.8, 0.1),
           "residual dominates": (0.1, 0.1, 0.8)}
MEAN_VARIANCE = 1e-4  # sd of a table's mean 0.01, a study's pass@k cell (section 1b's ~0.05 wide)


def crossed_tables(rng, shape, shares, replicates=REPLICATES, center=0.5):
    """[replicates, S, P] draws of the random-effects model m + r_s + c_p + e_sp whose
    Var(mean) = s2_seed/S + s2_problem/P + s2_resid/(S P) splits as `shares`; each replicate a
    fresh draw of the seeds and the problems, so the target is the population mean m."""
    seeds, problems = shape
    s2_seed, s2_problem, s2_resid = (share * MEAN_VARIANCE * n for share, n in
                                     zip(shares, (seeds, problems, seeds * problems)))
    return (center + rng.normal(0, np.sqrt(s2_seed), (replicates, seeds, 1))
            + rng.normal(0, np.sqrt(s2_problem), (replicates, 1, problems))
            + rng.normal(0, np.sqrt(s2_resid), (replicates, seeds, problems)))


def coverage(tables, truth, bounds=statistics.SCORE_RANGE) -> float:
    low, high = statistics.crossed_interval(tables, bounds=bounds)
    return float(np.mean((low <= truth) & (truth <= high)))


def old_crossed_bootstrap_coverage(tables, truth, resamples=1000, seed=0) -> float:
    """The interval before issue 43: a 95% percentile interval of crossed bootstrap means (one
    draw of the seeds, one of the problems used for every drawn seed)."""
    replicates, seeds, problems = tables.shape
    rng = np.random.default_rng(seed)
    w = rng.multinomial(seeds, np.full(seeds, 1 / seeds), size=resamples).astype(float)
    v = rng.multinomial(problems, np.full(problems, 1 / problems), size=resamples).astype(float)
    means = np.einsum("bs,rsp,bp->rb", w, tables, v) / (seeds * problems)
    low, high = np.quantile(means, [0.025, 0.975], axis=1, method="inverted_cdf")
    return float(np.mean((low <= truth) & (truth <= high)))


@pytest.mark.parametrize("seeds", [3, 5])
@pytest.mark.parametrize("regime", list(REGIMES))
def test_interval_covers_the_population_mean_93_to_97_percent(seeds, regime):
    rng = np.random.default_rng([seeds, list(REGIMES).index(regime)])
    tables = crossed_tables(rng, (seeds, 128), REGIMES[regime])
    assert BAND[0] <= coverage(tables, 0.5) <= BAND[1]


def test_the_old_crossed_bootstrap_fails_the_same_check_at_three_seeds():
    # What issue 43 measured: a 3-value seed resample cannot show the seeds' variance.
    rng = np.random.default_rng(7)
    tables = crossed_tables(rng, (3, 128), REGIMES["seeds dominate"], replicates=1000)
    assert old_crossed_bootstrap_coverage(tables, 0.5) < 0.88
    tables = crossed_tables(rng, (3, 128), REGIMES["residual dominates"], replicates=1000)
    assert old_crossed_bootstrap_coverage(tables, 0.5) > 0.985


@pytest.mark.parametrize("seeds", [3, 5])
def test_paired_difference_covers_the_true_difference(seeds):
    # Both arms share a large problem effect (it cancels in a - b); a's own seed, problem and
    # residual effects make the difference table seed-dominated, its true mean 0.03.
    rng = np.random.default_rng([seeds, 99])
    shared = rng.normal(0, 0.25, (REPLICATES, 1, 128))
    a = 0.53 + shared + crossed_tables(rng, (seeds, 128), REGIMES["seeds dominate"], center=0)
    b = 0.50 + shared + crossed_tables(rng, (seeds, 128), (0.1, 0.1, 0.8), center=0) * 0.5
    assert BAND[0] <= coverage(a - b, 0.03, statistics.DIFFERENCE_RANGE) <= BAND[1]
    # The public function is the batched one, table by table.
    low, high = statistics.crossed_interval(a[:2] - b[:2], bounds=(-1, 1))
    assert statistics.paired_difference_interval(a[1], b[1]) == (low[1], high[1])


def _binomial_tables(rng, shape, intercept, sds, samples, replicates=REPLICATES):
    """Per-problem pass@1 from `samples` draws at logit p = intercept + seed + problem +
    interaction effects (sds); the target is E[p] over seeds and problems (Gauss-Hermite)."""
    seeds, problems = shape
    logit = (intercept + rng.normal(0, sds[0], (replicates, seeds, 1))
             + rng.normal(0, sds[1], (replicates, 1, problems))
             + rng.normal(0, sds[2], (replicates, seeds, problems)))
    tables = rng.binomial(samples, 1 / (1 + np.exp(-logit))) / samples
    x, w = np.polynomial.hermite_e.hermegauss(200)
    truth = np.sum(w / (1 + np.exp(-(intercept + np.sqrt(np.sum(np.square(sds))) * x))))
    return tables, truth / w.sum()


BINOMIAL = {"seeds dominate": (0.0, (0.6, 0.3, 0.3), 16),
            "problems dominate": (-1.0, (0.05, 2.0, 0.3), 16),
            "residual dominates": (-1.0, (0.0, 0.0, 0.0), 1)}  # 0/1 successes, nothing else


@pytest.mark.slow
@pytest.mark.parametrize("problems", [64, 256])
@pytest.mark.parametrize("seeds", [3, 5])
def test_interval_coverage_over_the_studies_shapes_and_on_pass_rate_tables(seeds, problems):
    rng = np.random.default_rng([seeds, problems])
    for shares in REGIMES.values():
        assert BAND[0] <= coverage(crossed_tables(rng, (seeds, problems), shares), 0.5) <= BAND[1]
    for intercept, sds, samples in BINOMIAL.values():
        tables, truth = _binomial_tables(rng, (seeds, problems), intercept, sds, samples)
        assert BAND[0] <= coverage(tables, truth) <= BAND[1]


def test_mean_squares_of_a_hand_made_table():
    # Grand mean 2/3; seed means 1/2, 5/6: MS_seed = 3 (1/36 + 1/36) = 1/6; problem means
    # 1/2, 3/4, 3/4: MS_problem = 2 (1/36 + 1/144 + 1/144) / 2 = 1/24; the total sum of
    # squares 5/6 = 1/6 + 1/12 + SS_resid, so MS_resid = (7/12) / ((2 - 1)(3 - 1)) = 7/24.
    table = [[0.0, 0.5, 1.0], [1.0, 1.0, 0.5]]
    mean, ms_seed, ms_problem, ms_resid = statistics.mean_squares(table)
    assert mean == pytest.approx(2 / 3)
    assert ms_seed == pytest.approx(1 / 6) and ms_problem == pytest.approx(1 / 24)
    assert ms_resid == pytest.approx(7 / 24)
    # MS_seed + MS_problem - MS_resid < 0: the ANOVA estimate floors at 0, and the
    # generalized pivot's draws still give the interval a width.
    assert statistics.mean_variance(table) == 0.0
    low, high = statistics.bootstrap_interval(table)
    assert low < mean < high


def test_satterthwaite_interval_by_hand():
    # Seeds differ by a constant, problems by another, no residual: MS_resid = 0,
    # MS_seed = 4 x 0.02 = 0.08 (seed means 0.4, 0.6), MS_problem = 2 x 0.08 / 3 = 0.0533
    # (problem means 0.3, 0.5, 0.5, 0.7); Var(mean) = 0.1333 / 8; df = 0.1333^2 / (0.08^2 / 1
    # + 0.0533^2 / 3) = 2.42: the t quantile lies between t(3) 3.18 and t(2) 4.30.
    table = np.array([[0.2, 0.4, 0.4, 0.6], [0.4, 0.6, 0.6, 0.8]])
    low, high = statistics.satterthwaite_interval(table)
    df = (0.08 + 0.16 / 3) ** 2 / (0.08 ** 2 + (0.16 / 3) ** 2 / 3)
    assert df == pytest.approx(2.42, abs=0.01)
    half = stats.t.ppf(0.975, df) * np.sqrt((0.08 + 0.16 / 3) / 8)
    assert (low, high) == pytest.approx((0.5 - half, 0.5 + half))
    assert 3.18 < half / np.sqrt(0.4 / 24) < 4.30


def test_pivot_interval_with_seeds_alone_is_the_t_interval_over_seed_means():
    # Only the seed mean square varies: the pivot is mean - z sqrt(MS_seed x 2 / chi2(2) / (S P)),
    # a t with S - 1 = 2 df: the interval is mean -+ 4.303 x sd(seed means) / sqrt(3).
    table = np.array([[0.1] * 8, [0.3] * 8, [0.2] * 8])
    low, high = statistics.pivot_interval(table, resamples=400_000)
    half = 4.3027 * 0.1 / np.sqrt(3)
    assert (low, high) == pytest.approx((0.2 - half, 0.2 + half), abs=0.02 * half)


def test_one_seed_is_the_t_interval_over_problems_and_a_constant_table_has_no_width():
    scores = [0.4, 0.6, 0.5, 0.9]  # mean 0.6, sd 0.2160: half-width 3.182 x 0.2160 / 2
    assert statistics.bootstrap_interval(scores) == pytest.approx((0.6 - 0.3437, 0.6 + 0.3437),
                                                                  abs=1e-4)
    # Clipped to the score range.
    assert statistics.bootstrap_interval([[0.0, 0.0, 0.0, 1.0]])[0] == 0.0
    assert statistics.bootstrap_interval(np.full((3, 16), 0.25)) == (0.25, 0.25)
    assert statistics.bootstrap_interval(np.zeros((5, 64))) == (0.0, 0.0)


def test_paired_difference_is_the_interval_of_the_difference_table():
    rng = np.random.default_rng(0)
    a, b = rng.random((3, 32)), rng.random((3, 32))
    low, high = statistics.paired_difference_interval(a, b)
    assert (low, high) == pytest.approx(tuple(-x for x in
                                              statistics.paired_difference_interval(b, a)[::-1]))
    assert low < (a - b).mean() < high
    # What the arms share cancels: adding a problem effect to both changes nothing.
    shared = rng.normal(0, 1, 32)
    assert statistics.paired_difference_interval(a + shared, b + shared) == pytest.approx(
        (low, high))
    assert statistics.paired_difference_interval(a, a) == (0.0, 0.0)
    with pytest.raises(ValueError, match="one shape"):
        statistics.paired_difference_interval(a, [[1.0, 0.0]])


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
