"""The token cut the controller sends: each bucket's min_survival from the step prices and the
decisions, calibrations only where confidences were counted, and the record on the wire."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from specpilot.contract import engine_stream
from specpilot.contract.confidence import N_CONFIDENCE_BUCKETS
from specpilot.contract.records import (
    CalibrationRows,
    ConfidenceRecord,
    Decision,
    EngineReport,
    PolicyUpdate,
    Reason,
    TokenCut,
)
from specpilot.controller import wire
from specpilot.controller.core.controller import ControllerCore
from specpilot.controller.core.cut import min_survival
from specpilot.controller.settings import core_config, load_settings
from tests.test_core_calibration import HELLO


def _decision(k: int, speedup: float) -> Decision:
    return Decision("c", 0, "d", k, Reason.GOODPUT, speedup)


def test_min_survival_is_the_extra_seconds_of_a_token_times_the_steps_rate() -> None:
    def seconds(batch: int, draft: str, k: int) -> float:
        return 0.010 + 0.0002 * batch + 0.001 * batch * (1 + k) + (0.002 * k if draft else 0)

    got = min_survival(8.0, [(_decision(3, 2.0), 0.75), (_decision(1, 1.5), 0.25)], seconds)
    # Mean K 2.5: K 2 -> 3 for 8 sequences costs 8 ms of verification + 2 ms of the draft's
    # pass, 1.25 ms a sequence; the step's rate is 8 x speedup 1.875 / t(8, off).
    rate = 8 * (0.75 * 2.0 + 0.25 * 1.5) / seconds(8, "", 0)
    assert got == pytest.approx((0.010 / 8) * rate)
    # Free verification (a flat price) cuts nothing; a dearer token needs a likelier one; a
    # bucket where nothing speculates has nothing to cut.
    flat = min_survival(8.0, [(_decision(3, 2.0), 1.0)], lambda b, d, k: 0.02)
    assert flat == 0.0
    dear = min_survival(8.0, [(_decision(3, 2.0), 1.0)], lambda b, d, k: 0.01 + 0.004 * k)
    cheap = min_survival(8.0, [(_decision(3, 2.0), 1.0)], lambda b, d, k: 0.01 + 0.001 * k)
    assert dear > cheap > 0
    assert min_survival(8.0, [(_decision(0, 1.0), 1.0)], seconds) == 0.0


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
    assert _core().snapshot(1.0).cut is None  # off by default


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
