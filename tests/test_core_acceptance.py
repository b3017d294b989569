"""Acceptance estimator: censoring, forgetting, credible intervals, change detection."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from specpilot.controller.core.acceptance import (
    AcceptanceEstimator,
    EstimatorConfig,
    position_counts,
)

histograms = st.lists(st.integers(0, 10_000), min_size=2, max_size=9)


def _estimator(**kw: float) -> AcceptanceEstimator:
    cfg = {"max_k": 8, "half_life_seconds": 100.0, **kw}
    return AcceptanceEstimator(EstimatorConfig(**cfg))  # type: ignore[arg-type]


def _histogram(rng: np.random.Generator, rates: np.ndarray, steps: int) -> np.ndarray:
    accepted = rng.random((steps, rates.size)) < rates
    first_reject = np.where(accepted.all(axis=1), rates.size, np.argmin(accepted, axis=1))
    return np.bincount(first_reject, minlength=rates.size + 1)


def test_position_counts_by_hand() -> None:
    # K=3: 5 steps accepted 0, 3 accepted 1, 2 accepted 2, 1 accepted all 3.
    tries, accepts = position_counts([5, 3, 2, 1])
    assert tries.tolist() == [11, 6, 3]
    assert accepts.tolist() == [6, 3, 1]


@given(histograms)
def test_position_counts_invariants(h: list[int]) -> None:
    tries, accepts = position_counts(h)
    assert tries[0] == sum(h)
    assert np.all(accepts <= tries)
    # What is accepted at position i is exactly what is tried at position i+1 (censoring).
    assert np.array_equal(accepts[:-1], tries[1:])
    assert np.all(np.diff(tries) <= 0)


@given(histograms)
def test_untried_positions_keep_the_prior(h: list[int]) -> None:
    est = _estimator()
    est.observe("c", "d", h, now=0.0)
    post = est.posterior("c", "d", now=0.0)
    k = len(h) - 1
    assert np.all(post.alpha[k:] == 1.0) and np.all(post.beta[k:] == 1.0)
    # A position is only informed by steps that reached it.
    assert post.effective_tries[:k] == pytest.approx(position_counts(h)[0])


def test_censoring_is_unbiased_where_the_naive_rate_is_not() -> None:
    rng = np.random.default_rng(3)
    rates = np.array([0.8, 0.7, 0.6, 0.5, 0.4, 0.3])
    h = _histogram(rng, rates, 100_000)
    est = _estimator()
    est.observe("c", "d", h, now=0.0)
    mean = est.posterior("c", "d", 0.0).mean[:6]
    tries, _ = position_counts(h)
    se = np.sqrt(rates * (1 - rates) / tries)
    assert np.all(np.abs(mean - rates) < 4 * se)
    # Counting untried positions as rejections (accepts / steps) is biased low, more so later.
    naive = position_counts(h)[1] / h.sum()
    assert np.all(naive[1:] < rates[1:] - 0.05)


def test_forgetting_halves_evidence_every_half_life() -> None:
    est = _estimator(half_life_seconds=10.0)
    est.observe("c", "d", [100, 300], now=0.0)  # 400 tries, 300 accepts at position 1
    for t, factor in [(0.0, 1.0), (10.0, 0.5), (30.0, 0.125)]:
        post = est.posterior("c", "d", now=t)
        assert post.alpha[0] == pytest.approx(1.0 + 300 * factor)
        assert post.beta[0] == pytest.approx(1.0 + 100 * factor)


def test_forgetting_follows_drift() -> None:
    # Detector off: forgetting alone.
    est = _estimator(half_life_seconds=5.0, change_z_threshold=1e9)
    rng = np.random.default_rng(1)
    for t in range(50):
        est.observe("c", "d", _histogram(rng, np.array([0.9]), 200), now=float(t))
    for t in range(50, 100):
        est.observe("c", "d", _histogram(rng, np.array([0.3]), 200), now=float(t))
    assert est.posterior("c", "d", 100.0).mean[0] == pytest.approx(0.3, abs=0.03)


def test_credible_interval_contains_mean_and_shrinks_with_data() -> None:
    est = _estimator()
    est.observe("c", "d", [30, 70], now=0.0)
    lo1, hi1 = est.posterior("c", "d", 0.0).credible_interval(0.9)
    est.observe("c", "d", [3000, 7000], now=0.0)
    post = est.posterior("c", "d", 0.0)
    lo2, hi2 = post.credible_interval(0.9)
    assert lo2[0] < post.mean[0] < hi2[0]
    assert hi2[0] - lo2[0] < (hi1[0] - lo1[0]) / 5
    assert lo2[0] < 0.7 < hi2[0]


def test_change_detector_fires_on_a_shift_and_not_on_noise() -> None:
    rng = np.random.default_rng(5)
    est = _estimator(half_life_seconds=300.0, change_fast_half_life_seconds=5.0)
    fired_before = [
        est.observe("c", "d", _histogram(rng, np.array([0.72, 0.72]), 400), now=float(t))
        for t in range(200)
    ]
    assert not any(fired_before)
    fired_at = None
    for t in range(200, 260):
        if est.observe("c", "d", _histogram(rng, np.array([0.58, 0.58]), 400), now=float(t)):
            fired_at = t
            break
    assert fired_at is not None and fired_at - 200 < 15
    assert est.changes_detected("c", "d") == 1
    assert est.recovering("c", "d", float(fired_at))
    # After the reset the posterior sits near the new regime, not between the two.
    later = fired_at + 25
    for t in range(fired_at + 1, later):
        est.observe("c", "d", _histogram(rng, np.array([0.58, 0.58]), 400), now=float(t))
    assert est.posterior("c", "d", float(later)).mean[0] == pytest.approx(0.58, abs=0.02)


def test_forget_class_drops_only_that_class() -> None:
    est = _estimator()
    est.observe("a", "d", [1, 2], now=0.0)
    est.observe("b", "d", [1, 2], now=0.0)
    est.forget_class("a")
    assert not est.has_data("a", "d") and est.has_data("b", "d")


def _first_flag(p: Callable[[float], float], seconds: int, **cfg: float) -> float | None:
    """Feed one report a second (60 verification steps at K=1 of acceptance ``p(t)``); the time
    of the first flagged change, if any."""
    rng = np.random.default_rng(5)
    est = AcceptanceEstimator(EstimatorConfig(max_k=4, **cfg))
    for t in range(seconds):
        accepted = int(rng.binomial(60, p(float(t))))
        if est.observe("c", "d", [60 - accepted, accepted], float(t)):
            return float(t)
    return None


def test_a_slow_drift_is_flagged_before_a_step_detector_would_see_it() -> None:
    """0.72 -> 0.58 over 600 s in steps of 0.01, as a slowly degrading draft: the persistent
    lower threshold flags it well before the |z| > 5 test alone; a stationary stream of the same
    length is never flagged (the control for false alarms)."""
    def slide(t: float) -> float:
        return 0.72 - 0.01 * min(max((t - 300.0) // 40.0 + 1.0, 0.0), 14.0)

    drift = _first_flag(slide, 1200)
    step_only = _first_flag(slide, 1200, change_drift_z_threshold=5.0, change_drift_seconds=1e9)
    assert drift is not None and drift > 300.0
    assert step_only is None or drift < step_only - 60.0
    assert _first_flag(lambda t: 0.72, 3000) is None
