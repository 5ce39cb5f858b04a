"""``LengthDistribution``: the predicted length as a log-normal, with the figures planners use."""

import math

import numpy as np
import pytest

from streamrl.records import LengthDistribution


def test_quantiles_median_and_mean_are_the_log_normal_ones():
    d = LengthDistribution(math.log(100), 0.5)
    assert d.median == pytest.approx(100)
    # exp(0.5 * z_0.9) = exp(0.5 * 1.28155) = 1.8980
    assert d.quantile(0.9) == pytest.approx(189.80, abs=0.01)
    assert d.mean == pytest.approx(100 * math.exp(0.125))
    assert d.cdf(100) == pytest.approx(0.5)


def test_expected_max_matches_monte_carlo_and_grows_with_the_group():
    d = LengthDistribution(math.log(40), 0.8)
    draws = np.exp(np.random.default_rng(0).normal(d.mu, d.sigma, (200_000, 8)))
    for n in (2, 4, 8):
        assert d.expected_max(n) == pytest.approx(draws[:, :n].max(1).mean(), rel=0.01)
    assert d.expected_max(1) == pytest.approx(d.mean)
    assert d.expected_max(16) > d.expected_max(8) > d.expected_max(2) > d.mean


def test_remaining_is_the_conditional_expectation_past_what_was_generated():
    d = LengthDistribution(math.log(100), 0.5)
    draws = np.exp(np.random.default_rng(1).normal(d.mu, d.sigma, 2_000_000))
    for g in (30, 100, 250):
        assert d.remaining(g) == pytest.approx((draws[draws > g] - g).mean(), rel=0.02)
    assert d.remaining(0) == pytest.approx(d.mean)
    assert d.remaining(1e6) >= 1.0  # far past the tail: finite, at least one token


def test_a_point_is_a_distribution_without_spread():
    d = LengthDistribution.point(50)
    assert d.sigma == 0 and d.median == pytest.approx(50)
    assert d.expected_max(8) == pytest.approx(50)
    assert d.remaining(20) == pytest.approx(30)


def test_bad_parameters_are_refused():
    with pytest.raises(ValueError, match="sigma >= 0"):
        LengthDistribution(1.0, -0.1)
    with pytest.raises(ValueError, match="q must be"):
        LengthDistribution(1.0, 0.1).quantile(1.0)


def test_a_budget_cuts_the_expectations_as_cut_samples_would():
    d = LengthDistribution(math.log(100), 0.8)
    draws = np.exp(np.random.default_rng(2).normal(d.mu, d.sigma, (400_000, 8)))
    cap = 150
    assert d.expected_max(1, cap) == pytest.approx(np.minimum(draws[:, 0], cap).mean(), rel=0.01)
    assert d.expected_max(8, cap) == pytest.approx(np.minimum(draws.max(1), cap).mean(), rel=0.01)
    one = draws[:, 0]
    for g in (50, 140):
        cut = np.minimum(one[one > g], cap) - g
        assert d.remaining(g, cap) == pytest.approx(cut.mean(), rel=0.02)
    assert d.remaining(cap + 5, cap) == 1.0  # past the budget: it ends now
    assert d.mean_above(0.0, cap) < d.mean
