"""Step-cost model: priors before data, online fit, forgetting back to the prior."""

from __future__ import annotations

import numpy as np
import pytest

from controller.core.cost_model import CostPrior, StepCostModel, StepShape

KNOTS = (16, 32, 64, 128, 256)


def _model(prior: CostPrior | None = None, half_life: float = 1e9) -> StepCostModel:
    model = StepCostModel(KNOTS, prior or CostPrior(ridge_tokens=64), half_life,
                          [1, 2, 4, 8, 16, 32, 64], 6)
    model.ensure_drafts(["d"])
    return model


def _truth(batch: int, k: int) -> float:
    tokens = batch * (1 + k)
    # A speculative step also pays a fixed cost (input preparation, the rejection sampler).
    fixed = 0.0025 if k else 0.0
    return 0.010 + 1e-5 * tokens + 6e-4 * max(0, tokens - 32) + fixed + k * (0.002 + 2e-5 * batch)


def test_prior_alone_gives_the_prior_roofline() -> None:
    prior = CostPrior(base_seconds=0.02, seconds_per_token=2e-5, ridge_tokens=64,
                      seconds_per_token_above_ridge=2e-4, draft_seconds_fixed=5e-4,
                      draft_seconds_per_pass=1e-3, draft_seconds_per_token=1e-5)
    model = _model(prior)
    assert model.observed_steps == 0
    assert model.predict_arm(1, 0, "", False) == pytest.approx(0.02 + 2e-5, rel=1e-3)
    want = 0.02 + 2e-5 * 128 + 2e-4 * 64 + 5e-4 + 3 * (1e-3 + 1e-5 * 32)
    assert model.predict_arm(32, 3, "d", True) == pytest.approx(want, rel=1e-3)
    # N-gram drafts add no draft cost.
    assert model.predict_arm(32, 3, "ngram", False) == pytest.approx(
        0.02 + 2e-5 * 128 + 2e-4 * 64, rel=1e-3)


def test_online_fit_recovers_the_true_step_times() -> None:
    rng = np.random.default_rng(0)
    model = _model()
    for t in range(300):
        batch = int(rng.choice([1, 2, 4, 8, 16, 32]))
        k = int(rng.integers(0, 7))
        seconds = _truth(batch, k) * (1 + 0.02 * rng.standard_normal())
        model.observe(StepShape.for_arm(batch, k, "d", True), seconds, 50, now=float(t))
    for batch in (1, 8, 32):
        for k in range(7):
            assert model.predict_arm(batch, k, "d", True) == pytest.approx(_truth(batch, k),
                                                                           rel=0.05)


def test_unexcited_directions_fall_back_to_the_prior() -> None:
    model = _model(half_life=10.0)
    shape = StepShape.for_arm(32, 4, "d", True)
    prior_value = model.predict(shape)  # the raw fit, without the policy's monotone envelope
    for _ in range(20):
        model.observe(shape, prior_value * 3, 100, now=0.0)
    assert model.predict(shape) == pytest.approx(prior_value * 3, rel=0.05)
    # Twenty half-lives later that evidence is worth ~0.002 steps: the prior is back in charge.
    model.observe(StepShape.for_arm(1, 0, "", False), model.predict_arm(1, 0, "", False), 1,
                  now=200.0)
    assert model.predict(shape) == pytest.approx(prior_value, rel=0.1)
    assert model.observed_steps < 1.01


def test_new_drafts_keep_the_evidence_so_far() -> None:
    model = _model()
    for _ in range(10):
        model.observe(StepShape.for_arm(8, 0, "", False), 0.05, 100, now=0.0)
    before = model.predict_arm(8, 0, "", False)
    model.ensure_drafts(["d", "other"])
    assert model.n_features == 3 + len(KNOTS) + 2 * 3  # fixed, per pass, per token per draft
    assert model.predict_arm(8, 0, "", False) == pytest.approx(before, rel=1e-6)


def test_prior_ridge_must_be_a_knot() -> None:
    with pytest.raises(ValueError, match="knots"):
        StepCostModel(KNOTS, CostPrior(ridge_tokens=100), 10.0, [1], 2)


def test_step_curves_never_fall_with_more_drafts() -> None:
    model = _model()
    # A fit where longer steps were measured faster (noise, or another engine's drafter).
    for k, seconds in ((0, 0.030), (2, 0.012), (4, 0.010)):
        model.observe(StepShape.for_arm(8, k, "d", True), seconds, 500, now=0.0)
    for sunk in (None, ("d", 4)):
        curve = model.predict_curve(8, "d", True, 6, sunk)
        assert np.all(np.diff(curve) >= 0)


def _fed(rng: np.random.Generator, ks: tuple[int, ...], noise: float = 5e-4) -> StepCostModel:
    model = _model()
    for i in range(200):
        for k in ks:
            # A report's mean over 10 steps, each with ``noise`` of its own.
            y = _truth(8, k) + rng.normal(0.0, noise / np.sqrt(10.0))
            model.observe(StepShape.for_arm(8, k, "d", True), y, 10.0, now=float(i))
    return model


def _drawn(model: StepCostModel, n: int, seed: int) -> np.ndarray:
    """Step seconds at batch 8, K = 0..6, by ``n`` draws (the linear fit: no running maximum)."""
    rng = np.random.default_rng(seed)
    shapes = [StepShape.for_arm(8, k, "d", True) for k in range(7)]
    return np.array([[p.predict(s) for s in shapes]
                     for p in (model.draw(rng) for _ in range(n))])


def test_the_mean_of_many_cost_draws_is_the_mean_prediction() -> None:
    model = _fed(np.random.default_rng(1), (1, 2))
    draws = _drawn(model, 4000, 2)
    mean = np.array([model.predict(StepShape.for_arm(8, k, "d", True)) for k in range(7)])
    assert np.all(np.abs(draws.mean(axis=0) - mean) < 4 * draws.std(axis=0) / np.sqrt(4000))


def test_cost_draws_spread_more_where_no_step_was_observed() -> None:
    model = _fed(np.random.default_rng(1), (1, 2))
    spread = _drawn(model, 500, 3).std(axis=0)
    # K=1 and 2 were observed; K=0 and K>=4 are priced by extrapolation.
    assert min(spread[0], spread[4], spread[6]) > 3 * max(spread[1], spread[2])
    assert spread[6] > spread[4]
    # The noise level comes from the residuals: about the noise of one step.
    assert np.sqrt(model.noise_variance()) == pytest.approx(5e-4, rel=0.3)


def test_a_zero_sample_scale_prices_by_the_means() -> None:
    model = StepCostModel(KNOTS, CostPrior(ridge_tokens=64, sample_scale=0.0), 1e9, [1, 8], 4)
    assert model.draw(np.random.default_rng(0)) is model.mean
