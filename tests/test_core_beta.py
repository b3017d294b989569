"""Beta quantiles and credible intervals (``specpilot.controller.core.beta``) against a
high-resolution reference and closed forms."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from specpilot.controller.core.beta import beta_quantiles, credible_bounds, credible_bounds_of

# The sweep: alpha, beta log-spaced over [1e-2, 1e5] (every pair), plus the extreme asymmetric
# corners and both sides of the Cornish-Fisher switch.
_SWEEP = np.logspace(-2, 5, 22)
_PAIRS = np.array([(a, b) for a in _SWEEP for b in _SWEEP] + [
    (1e-2, 1e5), (1e5, 1e-2), (1e-2, 1.0), (1.0, 1e-2), (1e5, 1.0), (1.0, 1e5), (1e-2, 1e-2),
    (1e5, 1e5), (19.99, 1e5), (20.0, 1e5), (19.99, 19.99), (20.0, 20.0), (0.5, 0.5)])
_QS = (0.05, 0.95)
TOLERANCE = 2e-3  # the check the brief asked for; display resolution is 1e-3


def _ppf(q: float, a: np.ndarray | float, b: np.ndarray | float) -> np.ndarray:
    """The ``q`` quantile of Beta(a, b) per element."""
    return beta_quantiles((q,), a, b)[0]


def _reference_ppf(qs: tuple[float, ...], a: np.ndarray, b: np.ndarray,
                   points: int = 20_001) -> list[np.ndarray]:
    """A high-resolution reference, independent of the production rule: the plain trapezoid
    rule on ``points`` points (400 times as many), inverted by linear interpolation. In logit
    space y (density exp(a y - (a + b) log(1 + e^y)), smooth for every a, b), on
    y = mode + s sinh(u) with u uniform over where the density is above e^-40 of its mode."""
    out: list[list[float]] = [[] for _ in qs]
    for ai, bi in zip(a, b, strict=True):
        mode, s = np.log(ai / bi), np.sqrt(1.0 / ai + 1.0 / bi)
        g_max = ai * np.log(ai) + bi * np.log(bi) - (ai + bi) * np.log(ai + bi)
        u = np.linspace(np.arcsinh(((g_max - 40.0) / ai - mode) / s),
                        np.arcsinh(((40.0 - g_max) / bi - mode) / s), points)
        y = mode + s * np.sinh(u)
        log_p = ai * y - (ai + bi) * np.logaddexp(0.0, y) + np.log(np.cosh(u))
        p = np.exp(log_p - log_p.max())
        cdf = np.concatenate(([0.0], np.cumsum((p[1:] + p[:-1]) / 2.0)))
        for o, q in zip(out, qs, strict=True):
            yq = np.interp(q * cdf[-1], cdf, y)
            o.append(float(np.exp(-np.logaddexp(0.0, -yq))))
    return [np.array(o) for o in out]


_REFERENCE = _reference_ppf(_QS, _PAIRS[:, 0], _PAIRS[:, 1])


def _worst_error(ppf: Callable[[float, np.ndarray, np.ndarray], np.ndarray],
                 rows: np.ndarray | None = None) -> float:
    """The largest |ppf - reference| over the sweep (``rows``: a mask of its pairs)."""
    rows = np.ones(len(_PAIRS), dtype=bool) if rows is None else rows
    a, b = _PAIRS[rows, 0], _PAIRS[rows, 1]
    return max(float(np.max(np.abs(ppf(q, a, b) - ref[rows])))
               for q, ref in zip(_QS, _REFERENCE, strict=True))


def _former_grid_ppf(q: float, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The method before: the CDF on a 1/4096 grid in x, summed (as it was, for the check)."""
    grid = np.linspace(0.0, 1.0, 4097)[1:-1]
    log_pdf = (a[:, None] - 1.0) * np.log(grid) + (b[:, None] - 1.0) * np.log1p(-grid)
    log_pdf -= log_pdf.max(axis=1, keepdims=True)
    cdf = np.cumsum(np.exp(log_pdf), axis=1)
    cdf /= cdf[:, -1:]
    return np.asarray(grid[np.argmax(cdf >= q, axis=1)], dtype=np.float64)


def test_the_reference_matches_closed_forms() -> None:
    """Beta(a, 1): q^(1/a); Beta(1, b): 1 - (1 - q)^(1/b); Beta(1/2, 1/2): sin^2(pi q / 2)."""
    ends = np.array([1e-2, 0.3, 1.0, 7.0, 1e3, 1e5])
    ones = np.ones_like(ends)
    for q, lo_a, lo_b in zip(_QS, _reference_ppf(_QS, ends, ones), _reference_ppf(_QS, ones, ends),
                             strict=True):
        assert np.allclose(lo_a, q ** (1.0 / ends), rtol=0, atol=1e-7)
        assert np.allclose(lo_b, 1.0 - (1.0 - q) ** (1.0 / ends), rtol=0, atol=1e-7)
    half = _reference_ppf(_QS, np.array([0.5]), np.array([0.5]))
    assert [float(h[0]) for h in half] == pytest.approx([np.sin(np.pi * q / 2) ** 2 for q in _QS],
                                                        abs=1e-7)


def test_beta_quantiles_agree_with_the_reference_over_the_whole_sweep() -> None:
    worst = _worst_error(_ppf)
    assert worst < TOLERANCE
    assert worst < 1e-4  # what the module promises (3e-5), with room


def test_the_closed_forms_directly() -> None:
    ends = np.array([1e-2, 0.3, 1.0, 7.0, 19.99, 20.0, 1e3, 1e5])
    for q in _QS:
        assert np.allclose(_ppf(q, ends, 1.0), q ** (1.0 / ends), rtol=0, atol=1e-4)
        assert np.allclose(_ppf(q, 1.0, ends), 1.0 - (1.0 - q) ** (1.0 / ends), rtol=0,
                           atol=1e-4)


def test_the_check_catches_a_wrong_quantile() -> None:
    """The controls: a quantile off by half a percent of probability, and the former grid
    method where a or b is below 1 (its grid misses the density's singular end), both fail the
    same check; the former method passes it where a, b >= 1."""
    assert _worst_error(lambda q, a, b: _ppf(q + 0.005, a, b)) > TOLERANCE
    assert _worst_error(_former_grid_ppf) > TOLERANCE
    assert _worst_error(_former_grid_ppf, np.asarray((_PAIRS >= 1.0).all(axis=1))) < TOLERANCE


log_uniform = st.floats(-2.0, 5.0).map(lambda e: 10.0 ** e)


@given(st.lists(st.tuples(log_uniform, log_uniform), min_size=1, max_size=9),
       st.sampled_from([0.5, 0.8, 0.9, 0.99]))
def test_credible_bounds_are_finite_ordered_and_around_the_mean(
        pairs: list[tuple[float, float]], level: float) -> None:
    a, b = np.array(pairs).T
    lower, upper = credible_bounds(a, b, level)
    mean = a / (a + b)
    assert np.isfinite(lower).all() and np.isfinite(upper).all()
    assert (lower >= 0.0).all() and (lower <= mean).all() and (mean <= upper).all()
    assert (upper <= 1.0).all()
    # One pass for many posteriors gives each one's own figures.
    for (lo, hi), ai, bi in zip(credible_bounds_of([a[:1], a[1:]], [b[:1], b[1:]], level),
                                (a[:1], a[1:]), (b[:1], b[1:]), strict=True):
        one_lo, one_hi = credible_bounds(ai, bi, level)
        assert np.array_equal(lo, one_lo) and np.array_equal(hi, one_hi)


def test_a_posterior_so_skewed_its_mean_is_outside_the_tails_gets_the_mean_as_its_end() -> None:
    # Beta(0.01, 1): the 95% quantile is 0.95^100 = 0.0059, below the mean 0.0099.
    a, b = np.array([0.01]), np.array([1.0])
    assert _ppf(0.95, a, b)[0] == pytest.approx(0.95**100, abs=1e-5)
    lower, upper = credible_bounds(a, b, 0.9)
    assert upper[0] == pytest.approx(0.01 / 1.01) and lower[0] < upper[0]


def test_the_prior_shared_by_many_estimates_and_empty_input() -> None:
    lower, upper = credible_bounds(np.ones(1000), np.ones(1000), 0.9)
    assert np.allclose(lower, 0.05, atol=1e-5) and np.allclose(upper, 0.95, atol=1e-5)
    empty = credible_bounds(np.array([]), np.array([]), 0.9)
    assert empty[0].shape == (0,) and empty[1].shape == (0,)
    assert credible_bounds_of([], [], 0.9) == []


def test_counts_far_past_the_sweep_stay_finite_and_ordered() -> None:
    # Decayed sums of uint64 histograms: far beyond any real traffic, never NaN or a warning.
    ends = np.array([1e-2, 1.0, 19.99, 20.0, 1e6, 1e12, 1.8e19, 1e25, 1e100, 1e300])
    a, b = (x.ravel() for x in np.meshgrid(ends, ends))
    with np.errstate(all="raise"):
        lower, upper = credible_bounds(a, b, 0.9)
    mean = a / (a + b)
    assert np.isfinite(lower).all() and np.isfinite(upper).all()
    assert (lower >= 0.0).all() and (lower <= mean).all() and (mean <= upper).all()
    assert (upper <= 1.0).all()
