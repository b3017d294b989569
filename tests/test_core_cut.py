"""The token cut the controller sends: each bucket's min_survival from the step prices and the
decisions, calibrations only where confidences were counted, and the record on the wire."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from specpilot.contract import engine_stream
from specpilot.contract.confidence import N_CONFIDENCE_BUCKETS
from specpilot.contract.records import (
    ALL_CLASSES,
    CalibrationRows,
    ConfidenceRecord,
    Decision,
    EngineReport,
    Override,
    PolicyUpdate,
    Reason,
    TokenCut,
)
from specpilot.controller import wire
from specpilot.controller.core.controller import ControllerCore
from specpilot.controller.core.cost_model import CostPrior, StepCostModel, StepShape
from specpilot.controller.core.cut import (
    CutPrices,
    PassSeconds,
    StepRate,
    VerifySeconds,
    min_survival,
    pass_tokens,
)
from specpilot.controller.settings import core_config, load_settings
from tests.test_core_calibration import HELLO


def _speedup_rate(seconds: VerifySeconds) -> StepRate:
    """The rate these tests reason in: the step's rate without speculation times the decisions'
    mean expected speedup (never below 1)."""
    def rate(batch: int, weighted: list[tuple[Decision, float]]) -> float:
        total = sum(w for _, w in weighted)
        speedup = sum(max(d.expected_speedup, 0.0) * w for d, w in weighted) / total
        return batch * max(speedup, 1.0) / seconds(batch, batch)

    return rate


def _min_survival(batch_size: float, decisions: list[tuple[Decision, float]],
                  seconds: VerifySeconds, *args: Any, **kwargs: Any) -> float:
    return min_survival(batch_size, decisions, seconds, _speedup_rate(seconds), *args, **kwargs)


def _pass_tokens(batch_size: float, decisions: list[tuple[Decision, float]],
                 seconds: VerifySeconds, pass_seconds: PassSeconds) -> float:
    return pass_tokens(batch_size, decisions, pass_seconds, _speedup_rate(seconds))


def _decision(k: int, speedup: float) -> Decision:
    return Decision("c", 0, "d", k, Reason.GOODPUT, speedup)


def test_min_survival_is_the_verification_price_of_a_slot_times_the_steps_rate() -> None:
    def seconds(batch: int, tokens: float) -> float:
        return 0.010 + 0.0002 * batch + 0.001 * tokens

    got = _min_survival(8.0, [(_decision(3, 2.0), 0.75), (_decision(1, 1.5), 0.25)], seconds)
    # A slot costs 1 ms of verification (the drafter's passes are sunk when the engine cuts);
    # the step's rate is 8 x speedup 1.875 / t(8, off).
    rate = 8 * (0.75 * 2.0 + 0.25 * 1.5) / seconds(8, 8)
    assert got == pytest.approx(0.001 * rate)
    # A bucket where nothing speculates has nothing to cut.
    assert _min_survival(8.0, [(_decision(0, 1.0), 1.0)], seconds) == 0.0


def _hinge(per_token: float, ridge: float, above: float) -> Callable[[int, float], float]:
    """A target's step seconds: 20 ms, ``per_token`` a verified token, ``above`` more for each
    token past ``ridge`` (where the step turns compute-bound)."""
    return lambda batch, tokens: 0.020 + per_token * tokens + above * max(0.0, tokens - ridge)


def test_nothing_is_cut_where_verifying_is_free_and_more_where_it_is_dear() -> None:
    decided = [(_decision(3, 2.0), 1.0)]
    memory_bound = _min_survival(8.0, decided, _hinge(0.0, 256, 1e-4))
    assert memory_bound == 0.0  # 32 tokens, far below the ridge: a slot costs nothing
    assert _min_survival(8.0, decided, lambda b, t: 0.02) == 0.0
    compute_bound = _min_survival(128.0, decided, _hinge(1e-5, 256, 1e-4))
    assert 0.0 < compute_bound < 1.0
    assert _min_survival(128.0, decided, _hinge(1e-5, 256, 2e-4)) > compute_bound


def test_a_slot_is_priced_over_the_decided_drafts_never_beyond() -> None:
    # 64 sequences at K 3 verify 256 tokens: all below the ridge, whatever lies above it.
    decided = [(_decision(3, 2.0), 1.0)]
    cheap = _min_survival(64.0, decided, _hinge(1e-5, 256, 0.0))
    assert _min_survival(64.0, decided, _hinge(1e-5, 256, 1.0)) == pytest.approx(cheap)
    # Past the ridge, the mean price over the range the cut moves the step in: the slots
    # below the ridge count at their price, not at the dearest one's.
    at_k4 = _min_survival(64.0, [(_decision(4, 2.0), 1.0)], _hinge(1e-5, 256, 1e-4))
    rate = 64 * 2.0 / _hinge(1e-5, 256, 1e-4)(64, 64)
    assert at_k4 == pytest.approx((1e-5 + 1e-4 * 64 / 256) * rate)


def test_the_cut_never_asks_more_than_the_decisions_own_survival() -> None:
    # So dear a slot that no token would pay for its verification; the decisions still chose K
    # (a draw, hysteresis, an override): a request as likely as its class keeps its K.
    decided = [(_decision(3, 2.0), 0.5), (replace(_decision(2, 1.5), traffic_class="b"), 0.5)]
    steep = _hinge(1e-2, 0, 0.0)
    assert _min_survival(8.0, decided, steep) > 1.0
    survival = {"c": 0.6, "b": 0.45}
    assert _min_survival(8.0, decided, steep,
                        lambda d: survival[d.traffic_class]) == pytest.approx(0.45)
    # Where the price is below it, the price.
    gentle = _hinge(1e-6, 0, 0.0)
    assert _min_survival(8.0, decided, gentle, lambda d: 0.45) == pytest.approx(
        _min_survival(8.0, decided, gentle))


def test_nothing_is_cut_where_the_drafts_verification_is_inside_the_decisions_margin() -> None:
    # One sequence verifying 3 drafts at 10 us each: 30 us of a 20 ms step, 0.15%. The price
    # alone would cut the least likely tokens; under a 2% margin nothing is.
    decided = [(_decision(3, 2.0), 1.0)]
    price = _hinge(1e-5, 10_000, 0.0)
    assert _min_survival(1.0, decided, price) > 0.0
    assert _min_survival(1.0, decided, price, min_gain=0.02) == 0.0
    # A batch whose drafts' verification is a fifth of the step is cut at its price.
    dear = _hinge(1e-4, 10_000, 0.0)
    assert _min_survival(64.0, decided, dear, min_gain=0.02) == pytest.approx(
        _min_survival(64.0, decided, dear)) != 0.0


def test_a_drafter_pass_is_priced_at_the_steps_rate_even_where_verifying_is_free() -> None:
    decided = [(_decision(3, 2.0), 0.75), (replace(_decision(0, 1.0), draft=""), 0.25)]
    free = _hinge(0.0, 256, 1e-4)  # a batch of one: verification costs nothing
    assert _min_survival(1.0, decided, free) == 0.0
    rate = 1 * (0.75 * 2.0 + 0.25 * 1.0) / free(1, 1)
    assert _pass_tokens(1.0, decided, free, lambda b, d: 0.002) == pytest.approx(0.002 * rate)
    # The drafting decisions' drafts, weighted; none drafting: nothing to stop.
    mixed = [(_decision(3, 2.0), 0.5), (replace(_decision(2, 2.0), draft="e"), 0.5)]
    per_pass = {"d": 0.002, "e": 0.004}
    assert _pass_tokens(1.0, mixed, free, lambda b, d: per_pass[d]) == pytest.approx(
        0.003 * 2.0 / free(1, 1))
    assert _pass_tokens(1.0, [(_decision(0, 1.0), 1.0)], free, lambda b, d: 0.002) == 0.0


def test_the_steps_rate_is_that_of_the_step_its_decisions_compose() -> None:
    # A model-draft class at K 2 beside an n-gram class at K 8 in a batch of 16. Each decision's
    # speedup prices its arm as if the whole batch ran it (the n-gram class's 4x, with no
    # drafter); their mean overstates the mixed step's rate, which pays the drafter's passes
    # for all and verifies both classes' drafts.
    cost = StepCostModel((16, 64, 256), CostPrior(ridge_tokens=64), 600.0, [1, 16, 64], 4)
    cost.ensure_drafts(["d"])
    means = {("m", "d"): np.array([0.6, 0.6]), ("n", "ngram"): np.full(8, 0.9)}
    prices = CutPrices(cost, means, {"d"})
    model = Decision("m", 0, "d", 2, Reason.GOODPUT, 1.6)
    ngram = Decision("n", 0, "ngram", 8, Reason.GOODPUT, 4.0)
    weighted = [(model, 0.5), (ngram, 0.5)]
    tokens = 0.5 * (1 + 0.6 + 0.36) + 0.5 * (1 + float(np.cumprod(np.full(8, 0.9)).sum()))
    step = cost.predict(StepShape(16, 16 * (1 + 0.5 * 2 + 0.5 * 8), "d", 2, 32))
    assert prices.rate(16, weighted) == pytest.approx(16 * tokens / step)
    speedup_mean = 16 * (0.5 * 1.6 + 0.5 * 4.0) / prices.seconds(16, 16)
    assert prices.rate(16, weighted) < 0.95 * speedup_mean
    # A pass of the draft: one more sequential pass for the 16 sequences.
    assert prices.pass_seconds(16, "d") == pytest.approx(
        cost.predict(StepShape(16, 16, "d", 2, 32)) - cost.predict(StepShape(16, 16, "d", 1, 16)))
    assert prices.survival(model) == pytest.approx(0.36)
    assert prices.survival(replace(model, k=3)) is None  # beyond what is known


def _core(**settings: Any) -> ControllerCore:
    core = ControllerCore(core_config(load_settings(**settings)), np.random.default_rng(0))
    core.connect_engine(HELLO, now=0.0)
    return core


def _confidences(core: ControllerCore) -> None:
    tried = (100,) * N_CONFIDENCE_BUCKETS
    core.ingest("e1", EngineReport(1, 1.0, 0, confidence=(
        ConfidenceRecord("chat", "d", 1, tried, (10,) * N_CONFIDENCE_BUCKETS, transformed=True),)),
        now=1.0)


def test_the_snapshot_carries_calibrations_only_where_confidences_were_counted() -> None:
    core = _core(token_cut=True)
    core.decide(1.0)
    cut = core.snapshot(1.0).cut
    assert cut is not None and cut.calibrations == ()
    assert len(cut.min_survival) == core.config.n_buckets
    assert all(s >= 0 for s in cut.min_survival)
    _confidences(core)
    (rows,) = core.snapshot(2.0).cut.calibrations  # type: ignore[union-attr]
    assert (rows.traffic_class, rows.draft, rows.transformed) == ("chat", "d", True)
    assert len(rows.accept) == rows.positions * N_CONFIDENCE_BUCKETS
    assert rows.accept[0] == pytest.approx(core.calibration("chat", "d", 2.0, True).accept[0, 0])
    assert _core().snapshot(1.0).cut is not None  # on by default
    assert _core(token_cut=False).snapshot(1.0).cut is None
    assert len(core.snapshot(2.0).cut.pass_tokens) == core.config.n_buckets  # type: ignore[union-attr]
    assert rows.mean_accept == pytest.approx(  # the calibration's, token-weighted by position
        core.calibration("chat", "d", 2.0, True).mean_accept().tolist())


def test_a_pinned_class_is_neither_cut_nor_stopped_early() -> None:
    core = _core(token_cut=True)
    _confidences(core)
    assert len(core.snapshot(2.0).cut.calibrations) == 1  # type: ignore[union-attr]  # control
    for pinned in ("chat", ALL_CLASSES):
        core.set_override(Override(pinned, pin_k=2))
        assert core.snapshot(2.0).cut.calibrations == ()  # type: ignore[union-attr]
        core.clear_override(pinned)
    core.set_override(Override("chat", force_draft="d"))  # the controller still picks K
    assert len(core.snapshot(2.0).cut.calibrations) == 1  # type: ignore[union-attr]


def test_the_cut_crosses_the_wire() -> None:
    core = _core(token_cut=True)
    _confidences(core)
    snap = core.snapshot(2.0)
    back = engine_stream.policy_update_from_proto(wire.policy_update_to_proto(snap, 30.0))
    assert back.cut == snap.cut
    assert engine_stream.policy_update_from_proto(
        wire.policy_update_to_proto(replace(snap, cut=None), 30.0)).cut is None
    record = PolicyUpdate(3, cut=TokenCut((0.1, 0.2), (CalibrationRows(
        "a", "d", False, 1, (0.5,) * N_CONFIDENCE_BUCKETS),)))
    assert isinstance(record.cut, TokenCut)
