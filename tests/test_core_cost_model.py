"""Step-cost model: priors before data, online fit, forgetting only along what new steps measure,
and a change test on residuals."""

from __future__ import annotations

import numpy as np
import pytest

from specpilot.contract.pricing import DRAFT_COLUMNS, TARGET_COLUMNS
from specpilot.controller.core.cost_model import (
    CostChangeTest,
    CostEvidence,
    CostPrior,
    StepCostModel,
    StepShape,
    _Sums,
)

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
    for _ in range(300):
        batch = int(rng.choice([1, 2, 4, 8, 16, 32]))
        k = int(rng.integers(0, 7))
        seconds = _truth(batch, k) * (1 + 0.02 * rng.standard_normal())
        model.observe(StepShape.for_arm(batch, k, "d", True), seconds, 50)
    for batch in (1, 8, 32):
        for k in range(7):
            assert model.predict_arm(batch, k, "d", True) == pytest.approx(_truth(batch, k),
                                                                           rel=0.05)


def test_a_shape_the_engine_stops_running_keeps_what_was_measured() -> None:
    """No clock: an hour of batch-1 steps leaves a peak's batch-32 steps priced as measured."""
    model = _model(half_life=1000.0)
    peak = StepShape.for_arm(32, 4, "d", True)
    prior_value = model.predict(peak)  # the raw fit, without the policy's monotone envelope
    for _ in range(20):
        model.observe(peak, prior_value * 3, 100)
    assert model.predict(peak) == pytest.approx(prior_value * 3, rel=0.05)
    quiet = StepShape.for_arm(1, 0, "", False)
    for _ in range(200):  # twenty half-lives of steps, all of another shape
        model.observe(quiet, 0.012, 100)
    assert model.predict(quiet) == pytest.approx(0.012, rel=0.02)
    assert model.predict(peak) == pytest.approx(prior_value * 3, rel=0.1)


def test_a_shape_the_engine_keeps_running_follows_its_drift() -> None:
    model = _model(half_life=1000.0)
    quiet = StepShape.for_arm(1, 0, "", False)
    for _ in range(50):
        model.observe(quiet, 0.012, 100)
    for _ in range(100):  # ten half-lives at a new cost
        model.observe(quiet, 0.018, 100)
    assert model.predict(quiet) == pytest.approx(0.018, rel=0.01)
    # The control: with a half-life far longer than the run, the old cost still weighs.
    slow = _model(half_life=1e9)
    for seconds, n in ((0.012, 50), (0.018, 100)):
        for _ in range(n):
            slow.observe(quiet, seconds, 100)
    assert slow.predict(quiet) == pytest.approx(0.016, rel=0.01)


def test_forgetting_at_a_shape_keeps_the_fit_and_what_other_shapes_measured() -> None:
    rng = np.random.default_rng(4)
    sums = _Sums(3)
    shapes = [np.array([1.0, 1.0, 0.0]), np.array([1.0, 32.0, 0.0]), np.array([1.0, 8.0, 64.0])]
    for _ in range(30):
        for x in shapes:
            sums.add_point(x, float(x @ [1.0, 2.0, 3.0]) + rng.normal(0, 0.1), 5.0)
    fit = np.linalg.solve(sums.a, sums.b)
    before = sums.a.copy()
    quiet, peak = shapes[0], shapes[1]

    def information(a: np.ndarray, x: np.ndarray) -> float:  # on x^T theta
        return 1.0 / float(x @ np.linalg.solve(a, x))

    residual = sums.yy - sums.b @ fit
    sums.forget_along(quiet, 0.75)
    # (to the ridge that keeps an evidence of few shapes invertible)
    assert information(sums.a, quiet) == pytest.approx(0.25 * information(before, quiet),
                                                       rel=1e-3)
    assert information(sums.a, peak) > 0.9 * information(before, peak)
    assert np.linalg.solve(sums.a, sums.b) == pytest.approx(fit, rel=1e-4)
    assert sums.yy - sums.b @ fit == pytest.approx(residual, rel=1e-3)  # the misfit: the noise
    assert np.allclose(sums.a, sums.a.T) and np.linalg.eigvalsh(sums.a).min() > 0
    # A shape with a feature no step measured (a first step with context, say) forgets nothing:
    # the evidence knows nothing of its time, and its diagonal must stay >= 0.
    narrow = _Sums(3)
    narrow.add_point(np.array([1.0, 2.0, 0.0]), 1.0, 5.0)
    kept = narrow.a.copy()
    narrow.forget_along(np.array([1.0, 2.0, 7.0]), 0.5)
    assert np.array_equal(narrow.a, kept)


def test_a_change_of_the_hardware_is_detected_on_residuals_and_relearnt() -> None:
    """Every step twice as dear (another tenant): the change test fires within a few reports and
    the model prices the new costs; the control, steps within the fit's error for as long, never
    fires."""
    def fitted(test: CostChangeTest) -> StepCostModel:
        model = StepCostModel(KNOTS, CostPrior(ridge_tokens=64), 20000.0,
                              [1, 2, 4, 8, 16, 32, 64], 6, change_test=test)
        model.ensure_drafts(["d"])
        rng = np.random.default_rng(5)
        for _ in range(300):
            batch, k = int(rng.choice([1, 4, 16, 32])), int(rng.integers(0, 5))
            model.observe(StepShape.for_arm(batch, k, "d", True), _truth(batch, k), 50)
        return model

    def run(factor: float, jitter: float) -> tuple[StepCostModel, int]:
        model = fitted(CostChangeTest(0.15, 400.0))
        rng = np.random.default_rng(6)
        fired = 0
        for _ in range(60):
            batch, k = int(rng.choice([1, 4, 16, 32])), int(rng.integers(0, 5))
            noise = 1 + jitter * rng.uniform(-1, 1)
            fired += model.observe(StepShape.for_arm(batch, k, "d", True),
                                   factor * _truth(batch, k) * noise, 50)
        return model, fired

    changed, fired = run(2.0, 0.02)
    assert fired >= 1
    for batch in (1, 16, 32):
        assert changed.predict_arm(batch, 2, "d", True) == pytest.approx(2 * _truth(batch, 2),
                                                                        rel=0.1)
    assert run(1.0, 0.12)[1] == 0
    assert CostChangeTest(0.15, 400.0).observe(np.log(2.0), 800) is True  # the test can fire


def test_new_drafts_keep_the_evidence_so_far() -> None:
    model = _model()
    for _ in range(10):
        model.observe(StepShape.for_arm(8, 0, "", False), 0.05, 100)
    before = model.predict_arm(8, 0, "", False)
    model.ensure_drafts(["d", "other"])
    assert model.n_features == TARGET_COLUMNS + len(KNOTS) + 2 * DRAFT_COLUMNS
    assert model.predict_arm(8, 0, "", False) == pytest.approx(before, rel=1e-6)


def test_prior_ridge_must_be_a_knot() -> None:
    with pytest.raises(ValueError, match="knots"):
        StepCostModel(KNOTS, CostPrior(ridge_tokens=100), 10.0, [1], 2)


def test_step_curves_never_fall_with_more_drafts() -> None:
    model = _model()
    # A fit where longer steps were measured faster (noise, or another engine's drafter).
    for k, seconds in ((0, 0.030), (2, 0.012), (4, 0.010)):
        model.observe(StepShape.for_arm(8, k, "d", True), seconds, 500)
    for sunk in (None, ("d", 4)):
        curve = model.predict_curve(8, "d", True, 6, sunk)
        assert np.all(np.diff(curve) >= 0)


# The plugin's start-up profile: batch 1/16/32 x K 0/1/2/4 (engine_plugin/profile.py).
PROFILE = [(StepShape.for_arm(b, k, "d", True), _truth(b, k))
           for b in (1, 16, 32) for k in (0, 1, 2, 4)]
# Shapes the profile does not time: between its batch sizes, and longer K.
UNPROFILED = [(8, 0), (8, 3), (16, 6), (24, 5), (4, 2)]


def _relative_errors(model: StepCostModel) -> np.ndarray:
    return np.array([abs(model.predict(StepShape.for_arm(b, k, "d", True)) / _truth(b, k) - 1)
                     for b, k in UNPROFILED])


def test_a_start_up_profile_centres_the_prior_where_nothing_was_observed() -> None:
    generic = _model()
    centred = _model()
    centred.set_profile(PROFILE)
    assert centred.observed_steps == 0  # the centre is prior, not evidence
    assert np.all(_relative_errors(centred) < 0.1), _relative_errors(centred)
    assert np.all(_relative_errors(centred) < 0.3 * _relative_errors(generic))
    # Control: at weight 0 the profile leaves the generic prior exactly as it was.
    off = _model(CostPrior(ridge_tokens=64, profile_center_steps=0.0))
    off.set_profile(PROFILE)
    assert np.array_equal(_relative_errors(off), _relative_errors(generic))


def test_live_timings_take_over_from_a_centred_prior_as_from_the_generic_one() -> None:
    shape = StepShape.for_arm(16, 2, "d", True)
    for profile in ((), PROFILE):
        model = _model()
        model.set_profile(profile)
        for _ in range(20):
            model.observe(shape, 3 * _truth(16, 2), 10)
        assert model.predict(shape) == pytest.approx(3 * _truth(16, 2), rel=0.05)


def test_the_centre_follows_the_draft_columns() -> None:
    model = _model()
    model.set_profile(PROFILE)
    model.ensure_drafts(["other"])  # the prior is rebuilt with a new draft's columns
    generic = _model()
    generic.ensure_drafts(["other"])
    assert np.all(_relative_errors(model) < 0.1)
    assert np.all(_relative_errors(model) < 0.3 * _relative_errors(generic))
    # Its draft gone, the profile's speculative points are left out: no passes priced as the
    # target's. The target-only points still centre the steps without drafts.
    model.forget_drafts(["d"])
    plain = abs(model.predict_arm(8, 0, "", False) / _truth(8, 0) - 1)
    assert plain < 0.1
    generic.forget_drafts(["d"])
    assert plain < 0.3 * abs(generic.predict_arm(8, 0, "", False) / _truth(8, 0) - 1)


def _fed(rng: np.random.Generator, ks: tuple[int, ...], noise: float = 5e-4) -> StepCostModel:
    model = _model()
    for _ in range(200):
        for k in ks:
            # A report's mean over 10 steps, each with ``noise`` of its own.
            y = _truth(8, k) + rng.normal(0.0, noise / np.sqrt(10.0))
            model.observe(StepShape.for_arm(8, k, "d", True), y, 10.0)
    return model


def _drawn(model: StepCostModel, n: int, seed: int) -> np.ndarray:
    """Step seconds at batch 8, K = 0..6, by ``n`` draws (the linear fit: no running maximum)."""
    rng = np.random.default_rng(seed)
    shapes = [StepShape.for_arm(8, k, "d", True) for k in range(7)]
    return np.array([[p.predict(s) for s in shapes]
                     for p in (model.draw(rng) for _ in range(n))])


def test_the_mean_of_many_cost_draws_is_the_mean_prediction() -> None:
    model = _fed(np.random.default_rng(1), (1, 2))
    # Within the shapes timed (K <= 2 at batch 8) a price is linear in the weights; beyond them
    # it is extended from their edge at a slope of at least 0 (not linear).
    draws = _drawn(model, 4000, 2)[:, :3]
    mean = np.array([model.predict(StepShape.for_arm(8, k, "d", True)) for k in range(3)])
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


# --- shared evidence (specpilot.controller.core.fleet.fleet_costs) --------------------------------

def _fitted(seed: int = 0, reports: int = 200) -> StepCostModel:
    rng = np.random.default_rng(seed)
    model = _model()
    for _ in range(reports):
        batch = int(rng.choice([1, 2, 4, 8, 16, 32]))
        k = int(rng.integers(0, 7))
        model.observe(StepShape.for_arm(batch, k, "d", True), _truth(batch, k), 50)
    return model


def _worst_error(model: StepCostModel) -> float:
    return max(abs(model.predict_arm(b, k, "d", True) / _truth(b, k) - 1)
               for b in (1, 8, 32) for k in range(7))


def _prices(model: StepCostModel) -> list[float]:
    return [model.predict_arm(b, k, "d", True) for b in (1, 8, 32) for k in range(7)]


def test_a_model_with_another_ones_evidence_prices_like_it_and_exports_only_its_own() -> None:
    veteran, newcomer = _fitted(), _model()
    assert _worst_error(newcomer) > 0.3  # the generic prior is far off this hardware
    shared = veteran.export()
    newcomer.set_fleet(shared.aligned(newcomer.drafts, newcomer.knot_tokens))
    assert _worst_error(newcomer) < 0.05
    # What it publishes is its own (nothing yet): the fleet's is never re-published.
    assert newcomer.observed_steps == 0 and newcomer.export().steps == 0
    # A second exchange replaces the fleet view: the prices stay as they were. The
    # double-count control: the evidence taken twice prices otherwise.
    priced = _prices(newcomer)
    newcomer.set_fleet(shared)
    assert _prices(newcomer) == priced
    newcomer.set_fleet(shared.plus(shared))
    assert _prices(newcomer) != priced


def test_evidence_with_the_drafts_in_another_order_is_aligned_column_by_column() -> None:
    rng = np.random.default_rng(1)
    ab = StepCostModel(KNOTS, CostPrior(ridge_tokens=64), 1e9, [1, 4, 16], 4)
    ab.ensure_drafts(["a", "b"])
    for _ in range(100):
        batch, k = int(rng.choice([1, 4, 16])), int(rng.integers(1, 5))
        d = str(rng.choice(["a", "b"]))
        cost = _truth(batch, k) * (2.0 if d == "b" else 1.0)
        ab.observe(StepShape.for_arm(batch, k, d, True), cost, 20)
    ba = StepCostModel(KNOTS, CostPrior(ridge_tokens=64), 1e9, [1, 4, 16], 4)
    ba.ensure_drafts(["b", "a"])
    ba.set_fleet(ab.export().aligned(ba.drafts, ba.knot_tokens))
    for d in ("a", "b"):
        assert ba.predict_arm(8, 3, d, True) == pytest.approx(ab.predict_arm(8, 3, d, True),
                                                             rel=1e-6)
    # Other drafts or other knots are another engine type's: not aligned.
    assert ab.export().aligned(("a",), KNOTS) is None
    assert ab.export().aligned(("a", "b"), (16, 32)) is None


def test_a_restarted_model_takes_its_flushed_evidence_back_whole() -> None:
    before = _fitted()
    flushed = before.export()
    after = _model()
    assert after.restore(flushed)  # however long the restart took: costs are the hardware's
    assert after.observed_steps == pytest.approx(flushed.steps)
    assert after.export().steps == pytest.approx(flushed.steps)  # held as its own
    assert _worst_error(after) < 0.05


@pytest.mark.parametrize("damage", ["nan", "asymmetric", "shape", "negative"])
def test_cost_evidence_that_is_not_sound_is_refused(damage: str) -> None:
    ev = _fitted(reports=20).export()
    info, times, steps = ev.information.copy(), ev.weighted_times.copy(), ev.steps
    if damage == "nan":
        times[0] = float("nan")
    elif damage == "asymmetric":
        info[0, 1] += 1.0
    elif damage == "shape":
        info, times = info[:-1, :-1], times[:-1]
    else:
        steps = -1.0
    with pytest.raises(ValueError, match="cost evidence"):
        CostEvidence(ev.drafts, ev.knots, info, times, ev.squared_times, ev.reports, steps)


# --- context length -----------------------------------------------------------------------------
_CONTEXT_SLOPE = 4e-8  # seconds per context token a verified token attends to


def _context_truth(batch: int, k: int, context: float) -> float:
    return _truth(batch, k) + _CONTEXT_SLOPE * context * batch * (1 + k)


def _fit_context_steps(model: StepCostModel, with_context: bool) -> None:
    """Synthetic timed steps over batch sizes, K and contexts of 50-1,600 tokens; the context
    column is fed only ``with_context`` (else the shapes say 0: unknown)."""
    rng = np.random.default_rng(3)
    for b in (1, 4, 8, 16, 32):
        for k in range(5):
            for context in (50.0, 200.0, 800.0, 1600.0):
                shape = StepShape.for_arm(b, k, "d", True,
                                          context_tokens=context if with_context else 0.0)
                t = _context_truth(b, k, context) * (1 + 0.01 * rng.standard_normal())
                model.observe(shape, t, 50)


def test_the_fit_recovers_a_known_context_slope_and_leaving_it_out_fits_worse() -> None:
    from specpilot.contract.pricing import CONTEXT_COLUMN

    model = _model()
    _fit_context_steps(model, with_context=True)
    assert model.theta[CONTEXT_COLUMN] == pytest.approx(_CONTEXT_SLOPE, rel=0.05)
    blind = _model()
    _fit_context_steps(blind, with_context=False)  # the control: the column is left out

    def worst_error(m: StepCostModel, priced_context: bool) -> float:
        return max(abs(m.predict_arm(b, k, "d", True, context_tokens=c if priced_context else 0.0)
                       / _context_truth(b, k, c) - 1)
                   for b in (4, 32) for k in (0, 4) for c in (50.0, 1600.0))

    assert worst_error(model, True) < 0.03
    assert worst_error(blind, False) > 3 * worst_error(model, True)


def test_steps_without_context_do_not_move_the_context_column() -> None:
    from specpilot.contract.pricing import CONTEXT_COLUMN

    prior = CostPrior(ridge_tokens=64, seconds_per_context_token=1e-8)
    model = _model(prior)
    before = float(model.theta[CONTEXT_COLUMN])
    _fit_context_steps(model, with_context=False)  # older plugins: context 0, unknown
    assert float(model.theta[CONTEXT_COLUMN]) == pytest.approx(before, rel=1e-9)
    # ... and the other weights still learn from them (the base takes the mean context's cost).
    assert model.predict_arm(16, 0, "", False, context_tokens=0.0) == pytest.approx(
        _context_truth(16, 0, 50.0) + _CONTEXT_SLOPE * 16 * 500, rel=0.1)
    # The control: the same steps with their context move it to the truth.
    seen = _model(prior)
    _fit_context_steps(seen, with_context=True)
    assert float(seen.theta[CONTEXT_COLUMN]) == pytest.approx(_CONTEXT_SLOPE, rel=0.05)


def test_arms_are_priced_at_the_context_their_batch_size_runs_at() -> None:
    model = StepCostModel(KNOTS, CostPrior(ridge_tokens=64, seconds_per_context_token=1e-7),
                          1e9, [1, 2, 4, 8, 16, 32, 64], 6,
                          context_at=lambda batch: 1000.0 if batch > 8 else 0.0)
    short = model.predict_curve(4, "", False, 0)[0]
    assert short == pytest.approx(model.predict_curve(4, "", False, 0, context_tokens=0.0)[0])
    long = model.predict_curve(16, "", False, 0)[0]
    assert long - model.predict_curve(16, "", False, 0, context_tokens=0.0)[0] == pytest.approx(
        1e-7 * 1000 * 16, rel=1e-6)


def test_a_shape_beyond_those_timed_is_priced_from_their_edge_never_cheaper() -> None:
    """Timed at batch 8, K = 1 and 2 only: inside that the fit prices; beyond it (a larger batch,
    more verified tokens) the price goes on from the edge at slopes of at least 0, so no larger
    step is priced below a smaller one, whatever the fit's hinges do out there."""
    model = _fed(np.random.default_rng(1), (1, 2))
    for k in range(5):
        by_batch = [model.predict_arm(b, k, "d", True) for b in (8, 16, 32, 64, 128)]
        assert by_batch == sorted(by_batch), (k, by_batch)
    for b in (8, 16, 64):
        curve = model.predict_curve(b, "d", True, 6)
        assert np.all(np.diff(curve) >= 0) and curve[0] > 0, (b, curve)
    mean = model.mean
    assert mean.extent is not None and (mean.extent.batch_size, mean.extent.tokens) == (8, 24)
    inside = StepShape.for_arm(8, 2, "d", True)
    assert mean.predict(inside) == pytest.approx(float(model.features(inside) @ mean.theta))


def _speculative_truth(batch: float, verified: float, prefill: float, overhead: float) -> float:
    """A deterministic drafter's engine: a step that verifies drafts at all pays ``overhead`` a
    sequence (its draft positions prepared, the rejection sampler run); prefill is linear."""
    return (0.02 + 3e-4 * batch + 4e-4 * verified + overhead * batch * (verified > batch)
            + 2.5e-4 * prefill)


def _fit_speculative_steps(overhead: float) -> StepCostModel:
    rng = np.random.default_rng(3)
    model = _model()
    for _ in range(400):
        batch = float(rng.choice([1, 2, 4, 8, 16, 32]))
        drafts = float(rng.choice([0.0, 0.5, 1.0, 2.0, 3.0]))  # mean drafts a sequence verifies
        prefill = float(rng.choice([0, 0, 0, 200, 900]))
        shape = StepShape(batch, batch * (1 + drafts), prefill_tokens=prefill)
        truth = _speculative_truth(batch, shape.verified_tokens, prefill, overhead)
        model.observe(shape, truth * (1 + 0.01 * rng.standard_normal()), 20)
    return model


def test_speculating_sequences_and_prefill_are_priced_by_their_own_columns() -> None:
    """Steps of a drafter whose drafts cost nothing to propose, some carrying a prompt chunk:
    the fit recovers the cost a speculating sequence adds and a prefill token's price, and
    prices decode, speculative and mixed steps at a batch size between those timed. The
    control: an engine without that overhead is fitted none."""
    from specpilot.contract.pricing import PREFILL_COLUMN, SPECULATING_COLUMN

    model = _fit_speculative_steps(overhead=1.5e-3)
    assert model.theta[SPECULATING_COLUMN] == pytest.approx(1.5e-3, rel=0.1)
    assert model.theta[PREFILL_COLUMN] == pytest.approx(2.5e-4, rel=0.05)
    for verified, prefill in ((24.0, 0.0), (24.0 * 3, 0.0), (24.0 * 2, 500.0)):
        assert model.predict(StepShape(24.0, verified, prefill_tokens=prefill)) == pytest.approx(
            _speculative_truth(24.0, verified, prefill, 1.5e-3), rel=0.03)
    assert abs(_fit_speculative_steps(overhead=0.0).theta[SPECULATING_COLUMN]) < 1.5e-4


def test_a_fit_that_prices_longer_drafts_cheaper_is_moved_to_the_nearest_physical_one() -> None:
    """Speculative steps of 28 sequences measured faster than plain ones (noise, or the plain
    ones carried work the columns do not see): the unconstrained fit reads a negative price for
    verifying drafts, and its curve would price every K as free. The mean weights are the
    nearest physical ones in the posterior's metric: no verified token, no speculating sequence
    makes a step cheaper, and no other physical weights (the free fit's negative weights set to
    zero) are nearer."""
    model = StepCostModel(KNOTS, CostPrior(ridge_tokens=64), 1e9, [1, 8, 32], 4)
    for tokens, seconds in ((28, 0.110), (56, 0.099), (84, 0.097), (140, 0.096)):
        model.observe(StepShape(28, tokens), seconds, 2000)
    model.observe(StepShape(1, 1), 0.030, 2000)
    model.observe(StepShape(1, 5), 0.032, 2000)
    evidence = model._evidence()
    rows = model.columns.physical_rows(model._measured_knots(evidence))
    free = model._free_mean(evidence)
    assert (rows @ free).min() < -1e-6  # the control: unconstrained, it is not physical
    theta = model.theta
    assert (rows @ theta).min() >= -1e-12
    curve = model.predict_curve(28, "", False, 4)
    assert np.all(np.diff(curve) >= 0)
    # Nearest in the metric of the precision P: closer than the naive mend.
    precision = model._precision()
    clipped = free.copy()
    for row in rows:  # in order: raising a segment's last hinge raises the ones above it too
        if (value := row @ clipped) < 0:
            clipped[np.flatnonzero(row)[-1]] -= value
    assert (rows @ clipped).min() >= -1e-9

    def distance(w: np.ndarray) -> float:
        return float((w - free) @ precision @ (w - free))

    assert distance(theta) <= distance(clipped) + 1e-12
    # Steps of a physical truth keep their prices: an n-gram engine's, every target weight
    # identified (the model draft's columns, which nothing excites, are what moves).
    sane = _model()
    shapes = [StepShape.for_arm(b, k, "", False) for b in (1, 8, 16, 32) for k in (0, 1, 2, 4)]
    for shape in shapes:
        t = shape.verified_tokens
        seconds = (0.010 + 1e-5 * t + 6e-4 * max(0.0, t - 32)
                   + 1e-4 * shape.batch_size * (t > shape.batch_size))
        sane.observe(shape, seconds, 100)
    free = sane._free_mean(sane._evidence())
    for shape in shapes:
        x = sane.features(shape)
        assert x @ sane.theta == pytest.approx(x @ free, rel=0.01)


# What a served engine's step costs beyond its start-up profile's dummy forward passes (its
# server, sampler and scheduler): a per-step overhead.
_SERVED_OVERHEAD = 0.030


def _served_after_batch_one(profile_slope: float = 1.0) -> StepCostModel:
    """A start-up profile without the served engine's per-step overhead (its slopes scaled by
    ``profile_slope``), taken as the controller takes it; then live steps at batch 1 alone."""
    model = _model()
    profile = [(StepShape.for_arm(b, k, "d", True),
                _truth(1, 0) + profile_slope * (_truth(b, k) - _truth(1, 0)))
               for b in (1, 16, 32) for k in (0, 1, 2, 4)]
    model.set_profile(profile)
    model.observe_profile(profile, 1.0)
    for _ in range(300):
        for k in (0, 4):
            model.observe(StepShape.for_arm(1, k, "d", True), _truth(1, k) + _SERVED_OVERHEAD, 50)
    return model


def test_a_profile_below_the_served_level_lends_its_shape_not_its_level() -> None:
    """Live steps of batch 1 lift the level by the served engine's overhead at every batch size
    the profile timed: its shape is kept, so no batch size nothing has run yet is priced below
    what it costs (the profile's level, held as evidence, priced a plain step at batch 16 at a
    tenth of its cost and speculation as free there). The control: a profile whose shape is
    wrong (half its slopes) prices the large batches wrong, so the check can fail."""
    model = _served_after_batch_one()
    for b in (16, 32):
        for k in (0, 2, 4):
            want = _truth(b, k) + _SERVED_OVERHEAD
            assert model.predict_arm(b, k, "d", True) == pytest.approx(want, rel=0.05), (b, k)
    wrong = _served_after_batch_one(profile_slope=0.5)
    assert abs(wrong.predict_arm(32, 4, "d", True) / (_truth(32, 4) + _SERVED_OVERHEAD) - 1) > 0.15
