"""E(K) and goodput: closed forms, Monte Carlo agreement, argmax against brute force."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specpilot.controller.core.goodput import (
    expected_tokens,
    expected_tokens_curve,
    goodput,
    speedup,
)

rates_strategy = st.lists(st.floats(0.0, 1.0), min_size=1, max_size=12)


def _closed_form(a: float, k: int) -> float:
    """The closed form for uniform acceptance a: (1 - a^(K+1)) / (1 - a)."""
    return (1.0 - a ** (k + 1)) / (1.0 - a)


@pytest.mark.parametrize(("a", "k", "want"), [(0.7, 4, 2.77), (0.5, 4, 1.94)])
def test_design_figures_for_uniform_acceptance(a: float, k: int, want: float) -> None:
    assert round(expected_tokens(np.full(k, a), k), 2) == want
    assert round(_closed_form(a, k), 2) == want


@given(st.floats(0.0, 0.999), st.integers(0, 16))
def test_curve_matches_closed_form_for_uniform_rates(a: float, k: int) -> None:
    curve = expected_tokens_curve(np.full(k, a))
    assert curve[k] == pytest.approx(_closed_form(a, k), rel=1e-9, abs=1e-12)


@given(rates_strategy)
def test_curve_is_monotone_and_bounded(rates: list[float]) -> None:
    curve = expected_tokens_curve(rates)
    assert curve[0] == 1.0
    assert np.all(np.diff(curve) >= -1e-12)
    assert np.all(curve <= np.arange(len(rates) + 1) + 1 + 1e-9)


def test_monte_carlo_agrees_for_non_uniform_rates() -> None:
    """Simulate verification steps position by position; the mean emitted tokens is E(K)."""
    rng = np.random.default_rng(7)
    rates = np.array([0.9, 0.7, 0.55, 0.4, 0.2])
    steps = 200_000
    accepted = rng.random((steps, rates.size)) < rates
    # Tokens emitted = accepted prefix length + the bonus/correction token.
    prefix = np.where(accepted.all(axis=1), rates.size, np.argmin(accepted, axis=1))
    for k in range(rates.size + 1):
        emitted = np.minimum(prefix, k) + 1
        se = emitted.std() / np.sqrt(steps)
        assert abs(emitted.mean() - expected_tokens(rates, k)) < 4 * se + 1e-9


@settings(max_examples=200)
@given(
    rates_strategy,
    st.integers(1, 64),
    st.floats(1e-3, 0.1),
    st.floats(0.0, 0.01),
    st.floats(0.0, 0.01),
)
def test_goodput_argmax_matches_brute_force(
    rates: list[float], batch: int, base: float, per_token: float, per_draft: float
) -> None:
    def step_seconds(k: int) -> float:
        return base + per_token * batch * (1 + k) + per_draft * k

    curve = expected_tokens_curve(rates)
    scores = [goodput(float(curve[k]), batch, step_seconds(k)) for k in range(len(rates) + 1)]
    # Brute force straight from the definition: emitted tokens per step, survival products.
    brute = []
    for k in range(len(rates) + 1):
        e, survive = 1.0, 1.0
        for b in rates[:k]:
            survive *= b
            e += survive
        brute.append(e * batch / step_seconds(k))
    assert int(np.argmax(scores)) == int(np.argmax(brute)) or np.isclose(
        max(scores), brute[int(np.argmax(scores))]
    )


def test_speedup_is_one_for_no_speculation_and_scales_with_expected_tokens() -> None:
    assert speedup(1.0, 0.02, 0.02) == 1.0
    assert speedup(2.0, 0.02, 0.02) == 2.0
    assert speedup(2.0, 0.04, 0.02) == 1.0


def test_expected_tokens_rejects_k_beyond_rates() -> None:
    with pytest.raises(ValueError, match="outside"):
        expected_tokens([0.5, 0.5], 3)
