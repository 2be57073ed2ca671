"""``benchmarks/stats/student_t.py``: the t quantile (scipy's, and the bisection a machine
without scipy falls back to) against printed tables and against each other, the incomplete
beta against closed forms, and the interval arithmetic."""

from __future__ import annotations

import math

import pytest

from benchmarks.stats import student_t
from benchmarks.stats.student_t import (betainc, bisect_t_quantile, confidence_interval, percentile, sample_std,
                                        t_cdf, t_quantile)

# Two-sided 95% critical values t_{0.975, df}, as printed in statistics tables.
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 9: 2.262, 10: 2.228,
        20: 2.086, 30: 2.042, 60: 2.000, 120: 1.980}
QUANTILES = [t_quantile, bisect_t_quantile]


@pytest.fixture
def without_scipy(monkeypatch):
    """t_quantile as it runs where scipy cannot be imported."""
    monkeypatch.setattr(student_t, "_scipy_t", lambda: None)


@pytest.mark.parametrize("quantile", QUANTILES)
@pytest.mark.parametrize("df,expected", sorted(T975.items()))
def test_t_975_matches_the_table(quantile, df, expected):
    assert quantile(0.975, df) == pytest.approx(expected, abs=5e-4)


@pytest.mark.parametrize("quantile", QUANTILES)
def test_other_quantiles_match_the_table(quantile):
    assert quantile(0.95, 4) == pytest.approx(2.132, abs=5e-4)
    assert quantile(0.995, 10) == pytest.approx(3.169, abs=5e-4)
    assert quantile(0.9, 1) == pytest.approx(3.078, abs=5e-4)
    assert quantile(0.975, 1e7) == pytest.approx(1.95996, abs=1e-4)  # the normal limit


def test_the_quantile_is_scipys():
    stats = pytest.importorskip("scipy.stats")
    for df in (1, 2.5, 4, 17, 1000):
        for p in (0.01, 0.3, 0.5, 0.8, 0.975, 0.999):
            assert t_quantile(p, df) == float(stats.t.ppf(p, df))


def test_scipy_and_the_fallback_agree_to_far_below_printed_precision():
    """Every interval the suite prints takes t at 0.975 with n - 1 degrees of freedom; results
    computed before scipy (or on a machine without it) give the same figures."""
    pytest.importorskip("scipy.stats")
    for df in [*range(1, 121), 1e3, 1e6]:
        for p in (0.9, 0.95, 0.975, 0.995, 0.3, 0.01):
            assert bisect_t_quantile(p, df) == pytest.approx(t_quantile(p, df), rel=1e-8, abs=1e-12)


def test_without_scipy_the_quantile_is_the_bisection(without_scipy):
    for df in (1, 4, 30):
        assert t_quantile(0.975, df) == bisect_t_quantile(0.975, df)


def test_quantile_inverts_the_cdf_and_is_antisymmetric():
    for quantile in QUANTILES:
        for df in (1, 2.5, 4, 17):
            for p in (0.01, 0.3, 0.5, 0.8, 0.999):
                assert t_cdf(quantile(p, df), df) == pytest.approx(p, abs=1e-9)
                assert quantile(1 - p, df) == pytest.approx(-quantile(p, df), abs=1e-9)


def test_cdf_of_one_degree_of_freedom_is_the_cauchy_cdf():
    for t in (-7.0, -1.0, 0.0, 0.4, 3.0):
        assert t_cdf(t, 1) == pytest.approx(0.5 + math.atan(t) / math.pi, abs=1e-12)


def test_incomplete_beta_closed_forms():
    # I_x(a, 1) = x^a; I_x(1, b) = 1 - (1 - x)^b; I_0.4(2, 3) by the binomial sum.
    assert betainc(3.5, 1, 0.3) == pytest.approx(0.3 ** 3.5, rel=1e-12)
    assert betainc(1, 4.0, 0.7) == pytest.approx(1 - 0.3 ** 4, rel=1e-12)
    assert betainc(2, 3, 0.4) == pytest.approx(0.5248, rel=1e-12)
    assert betainc(2, 3, 0.0) == 0.0 and betainc(2, 3, 1.0) == 1.0


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="a, b > 0"):
        betainc(0, 1, 0.5)
    with pytest.raises(ValueError, match="0 <= x <= 1"):
        betainc(1, 1, 1.5)
    with pytest.raises(ValueError, match="p must be in"):
        t_quantile(1.0, 3)
    with pytest.raises(ValueError, match="p must be in"):
        bisect_t_quantile(0.0, 3)
    with pytest.raises(ValueError, match="degrees of freedom"):
        t_quantile(0.975, 0)
    with pytest.raises(ValueError, match="degrees of freedom"):
        t_cdf(1.0, 0)
    with pytest.raises(ValueError, match="at least two"):
        sample_std([1.0])


def test_confidence_interval_by_hand():
    values = [10.0, 12.0, 11.0, 13.0, 14.0]  # mean 12, s = sqrt(2.5)
    ci = confidence_interval(values)
    half = t_quantile(0.975, 4) * math.sqrt(2.5) / math.sqrt(5)
    assert ci["mean"] == 12.0 and ci["n"] == 5
    assert ci["half_width"] == pytest.approx(half)
    assert (ci["low"], ci["high"]) == pytest.approx((12.0 - half, 12.0 + half))
    single = confidence_interval([3.0])
    assert single == {"mean": 3.0, "half_width": None, "low": None, "high": None, "n": 1}


def test_percentile_interpolates_between_order_statistics():
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 99) == pytest.approx(4.96)
    assert percentile([7.0], 99) == 7.0
