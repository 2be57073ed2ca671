"""Student-t confidence intervals.

The t quantile is scipy's (``scipy.stats.t.ppf``, imported when first needed). A device
machine may lack scipy: it installs only the wheels carried to it, and scipy's (about 35 MB)
does not fit beside smg's or Dynamo's in the 64 MiB a run may carry. There the quantile
falls back to inverting the t CDF by bisection, the CDF taken from the regularized incomplete
beta function, ``P(|T| > t) = I_{df / (df + t^2)}(df / 2, 1 / 2)``, evaluated with a continued
fraction (modified Lentz). The two agree to a few parts in 1e9 (``tests/bench/test_student_t.py``),
far below the noise of any benchmark and the precision any result prints.

Intervals are two-sided: ``mean +- t_{(1 + confidence) / 2, n - 1} * s / sqrt(n)`` with
the sample standard deviation ``s``; fewer than two values give no interval.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

_EPS = 1e-15
_TINY = 1e-300


def _beta_fraction(a: float, b: float, x: float) -> float:
    """The continued fraction of I_x(a, b), converging for x < (a + 1) / (a + b + 2)."""
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > _TINY else _TINY)
    result = d
    for m in range(1, 1000):
        # Even step, then odd step, of the fraction's terms.
        for numerator in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                          -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > _TINY else _TINY)
            c = 1.0 + numerator / c
            c = c if abs(c) > _TINY else _TINY
            result *= c * d
        if abs(c * d - 1.0) < _EPS:
            return result
    raise ArithmeticError(f"incomplete beta fraction did not converge for a={a}, b={b}, x={x}")


def betainc(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b) for a, b > 0 and 0 <= x <= 1."""
    if a <= 0 or b <= 0:
        raise ValueError(f"betainc needs a, b > 0, got a={a}, b={b}")
    if not 0.0 <= x <= 1.0:
        raise ValueError(f"betainc needs 0 <= x <= 1, got {x}")
    if x in (0.0, 1.0):
        return x
    log_front = (math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b)
                 + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _beta_fraction(a, b, x) / a
    # The symmetry I_x(a, b) = 1 - I_{1-x}(b, a) keeps the fraction in its fast region.
    return 1.0 - math.exp(log_front) * _beta_fraction(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with ``df`` degrees of freedom."""
    if df <= 0:
        raise ValueError(f"degrees of freedom must be > 0, got {df}")
    tail = 0.5 * betainc(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t > 0 else tail


@functools.cache
def _scipy_t():
    """scipy's t distribution, or None without scipy. Imported on first use: scipy.stats
    takes a good part of a second to import, which a runner's --help need not pay."""
    try:
        from scipy.stats import t
    except ImportError:
        return None
    return t


def t_quantile(p: float, df: float) -> float:
    """The t with ``P(T <= t) = p``."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"p must be in (0, 1), got {p}")
    if df <= 0:
        raise ValueError(f"degrees of freedom must be > 0, got {df}")
    t = _scipy_t()
    return float(t.ppf(p, df)) if t is not None else bisect_t_quantile(p, df)


def bisect_t_quantile(p: float, df: float) -> float:
    """``t_quantile`` without scipy: the CDF inverted by bisection, which is monotone and
    cannot diverge."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"p must be in (0, 1), got {p}")
    if p < 0.5:
        return -bisect_t_quantile(1.0 - p, df)
    if p == 0.5:
        return 0.0
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        lo, hi = hi, hi * 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-12 * hi:
            break
    return 0.5 * (lo + hi)


def mean(values: Sequence[float]) -> float:
    if not values:
        raise ValueError("mean of no values")
    return math.fsum(values) / len(values)


def sample_std(values: Sequence[float]) -> float:
    if len(values) < 2:
        raise ValueError("a sample standard deviation needs at least two values")
    m = mean(values)
    return math.sqrt(math.fsum((v - m) ** 2 for v in values) / (len(values) - 1))


def confidence_interval(values: Sequence[float], confidence: float = 0.95) -> dict:
    """``{"mean", "half_width", "low", "high", "n"}``; the interval fields are None for n < 2."""
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    n = len(values)
    m = mean(values)
    if n < 2:
        return {"mean": m, "half_width": None, "low": None, "high": None, "n": n}
    half = t_quantile((1.0 + confidence) / 2.0, n - 1) * sample_std(values) / math.sqrt(n)
    return {"mean": m, "half_width": half, "low": m - half, "high": m + half, "n": n}


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100), interpolating linearly between order statistics."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"q must be in [0, 100], got {q}")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)
