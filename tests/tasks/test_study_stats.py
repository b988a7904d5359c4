"""Bootstrap intervals, paired t-tests and Holm's correction against hand-computed cases and
scipy's own paired test."""

import math

import chex
import numpy as np
import pytest
from scipy import stats as scipy_stats

from bapo_jax.tasks import study_stats
from bapo_jax.tasks.study_stats import bootstrap_mean, holm, paired_t_test


def test_paired_t_test_hand_case():
    # d = (1, 2, 3): mean 2, sd 1, t = 2 / (1 / sqrt 3) = 2 sqrt 3 with 2 degrees of freedom,
    # where Student's t has a closed form: P(|T| > t) = 1 - t / sqrt(t^2 + 2).
    test = paired_t_test([3.0, 5.0, 7.0], [2.0, 3.0, 4.0])
    t = 2 * math.sqrt(3)
    assert test.n == 3
    chex.assert_trees_all_close(test.mean_diff, 2.0)
    chex.assert_trees_all_close(test.t, t, rtol=1e-12)
    chex.assert_trees_all_close(test.p, 1 - t / math.sqrt(t * t + 2), rtol=1e-10)


def test_paired_t_test_matches_scipy():
    rng = np.random.default_rng(3)
    a, b = rng.normal(size=7), rng.normal(size=7)
    ours = paired_t_test(a, b)
    reference = scipy_stats.ttest_rel(a, b)
    chex.assert_trees_all_close(ours.t, float(reference.statistic), rtol=1e-10)
    chex.assert_trees_all_close(ours.p, float(reference.pvalue), rtol=1e-10)


def test_paired_t_test_without_spread():
    same = paired_t_test([0.5, 0.6, 0.7], [0.5, 0.6, 0.7])
    assert (same.mean_diff, same.t, same.p) == (0.0, 0.0, 1.0)
    shifted = paired_t_test([1.5, 1.6], [0.5, 0.6])
    assert shifted.p == 0.0 and shifted.t == math.inf
    chex.assert_trees_all_close(shifted.mean_diff, 1.0)


def test_paired_t_test_refuses_bad_shapes():
    with pytest.raises(ValueError, match="same length >= 2"):
        paired_t_test([1.0, 2.0], [1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="same length >= 2"):
        paired_t_test([1.0], [2.0])


def test_holm_hand_case():
    # sorted 0.01, 0.03, 0.04 -> 3 x 0.01, max(0.03, 2 x 0.03), max(0.06, 1 x 0.04)
    chex.assert_trees_all_close(holm([0.01, 0.04, 0.03]), [0.03, 0.06, 0.06])
    chex.assert_trees_all_close(holm([0.5, 0.9]), [1.0, 1.0])  # capped at 1
    assert holm([]) == []
    with pytest.raises(ValueError, match="p_values must be numbers in"):
        holm([0.1, 1.5])


def test_bootstrap_mean_is_deterministic_and_brackets_the_mean():
    values = [0.61, 0.64, 0.58, 0.70, 0.66]
    first, again = bootstrap_mean(values), bootstrap_mean(values)
    assert first == again
    chex.assert_trees_all_close(first.mean, np.mean(values))
    assert min(values) <= first.low < first.mean < first.high <= max(values)
    # A wider level gives a wider interval from the same resamples.
    wide = bootstrap_mean(values, level=0.99)
    assert wide.low <= first.low and wide.high >= first.high


def test_bootstrap_mean_of_constant_values_and_bad_input():
    constant = bootstrap_mean([0.4, 0.4, 0.4])
    chex.assert_trees_all_close((constant.low, constant.mean, constant.high), (0.4, 0.4, 0.4))
    with pytest.raises(ValueError, match="non-empty 1-d array of finite numbers"):
        bootstrap_mean([])
    with pytest.raises(ValueError, match="non-empty 1-d array of finite numbers"):
        bootstrap_mean([0.1, float("nan")])
    with pytest.raises(ValueError, match="level must be in"):
        bootstrap_mean([0.1, 0.2], level=1.0)


def test_paired_interval_is_scipys_paired_t_interval():
    a, b = np.array([1, 2, 3, 4, 6.0]), np.array([0.5, 2.2, 2.1, 3, 5])
    got = study_stats.paired_interval(a, b)
    want = scipy_stats.ttest_rel(a, b).confidence_interval(0.95)
    assert got.mean_diff == pytest.approx(0.64)
    assert (got.low, got.high) == pytest.approx((want.low, want.high), rel=1e-12)
    assert got.n == 5 and got.sd == pytest.approx(np.std(a - b, ddof=1))
    with pytest.raises(ValueError, match="one length"):
        study_stats.paired_interval(a, b[:3])


@pytest.mark.parametrize("seed", range(6))
def test_tost_rejects_exactly_when_the_90_interval_lies_inside_the_margin(seed):
    rng = np.random.default_rng(seed)
    a, b = rng.normal(0, 1, 7), rng.normal(rng.uniform(-1, 1), 1, 7)
    interval = study_stats.paired_interval(a, b, level=0.90)
    inside = interval.low > -1.5 and interval.high < 1.5
    assert (study_stats.tost(a, b, 1.5) < 0.05) == inside
    # by hand: d = a - b = (1, 1, 1, 1, 2): mean 1.2, se = sqrt(0.2 / 5) = 0.2; the upper
    # one-sided test at margin 2 has t = (1.2 - 2) / 0.2 = -4 (df 4).
    d = study_stats.tost([2, 2, 2, 2, 3], [1, 1, 1, 1, 1], 2.0)
    assert d == pytest.approx(scipy_stats.t.cdf(-4.0, df=4))


def test_power_is_alpha_at_no_effect_and_matches_simulated_t_tests():
    assert study_stats.paired_power(0.0, 1.0, 5, 0.05) == pytest.approx(0.05)
    effect = study_stats.detectable_effect(1.0, 5, 0.05)  # 80% power with 5 pairs
    assert study_stats.paired_power(effect, 1.0, 5, 0.05) == pytest.approx(0.8)
    rng = np.random.default_rng(0)
    d = rng.normal(effect, 1.0, size=(40_000, 5))
    t = d.mean(axis=1) / (d.std(axis=1, ddof=1) / np.sqrt(5))
    rejected = np.mean(np.abs(t) > scipy_stats.t.ppf(0.975, df=4))
    assert rejected == pytest.approx(0.8, abs=0.01)
    # large n: the normal approximation (z_0.975 + z_0.8) sd / sqrt(n), a little above it
    large = study_stats.detectable_effect(1.0, 100, 0.05) * 10
    assert 2.8016 < large < 2.84


def test_seeds_needed_is_the_first_n_with_the_power():
    n = study_stats.seeds_needed(sd=0.06, effect=0.05, alpha=0.05)
    assert study_stats.paired_power(0.05, 0.06, n, 0.05) >= 0.8
    assert study_stats.paired_power(0.05, 0.06, n - 1, 0.05) < 0.8
    assert study_stats.seeds_needed(sd=1.0, effect=0.01, alpha=0.05, most=10) is None
