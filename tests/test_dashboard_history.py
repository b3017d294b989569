"""The dashboard's estimate history: bounded, drafts with evidence only, forgotten classes gone."""

from __future__ import annotations

import numpy as np
import pytest

from specpilot.contract.records import AcceptanceRecord, EngineReport
from specpilot.controller.core.controller import ControllerCore
from specpilot.controller.dashboard.history import EstimateHistory
from specpilot.controller.settings import core_config, load_settings
from tests.test_core_controller import HELLO


def test_history_keeps_the_newest_samples_of_drafts_with_evidence() -> None:
    core = ControllerCore(core_config(load_settings()), np.random.default_rng(0))
    core.connect_engine(HELLO, now=0.0)
    history = EstimateHistory(samples_per_class=3, credible_level=0.9)
    for t in range(5):
        core.ingest("e1", EngineReport(t + 1, 1.0, 0, (AcceptanceRecord(
            "code", "d", 2, (10, 10, 80)),)), now=float(t))
        history.record(core.snapshot(float(t)))
    samples = history.of("code")
    assert [s.at for s in samples] == [2.0, 3.0, 4.0]  # the newest 3
    assert {s.draft for s in samples} == {"d"}  # n-gram has no evidence: no band of a prior
    mean, lower, upper = samples[-1].positions[0]
    est = core.estimate("code", "d", 4.0)
    assert mean == pytest.approx(float(est.mean[0]), abs=1e-4) and lower < mean < upper
    assert len(samples[-1].positions) == 4  # the first four of the draft's six positions
    # One pass for every estimate gives each its own interval.
    lo, hi = est.credible_interval(0.9)
    assert [p[1:] for p in samples[-1].positions] == [
        (round(float(lo[i]), 4), round(float(hi[i]), 4)) for i in range(4)]
    assert history.of("unknown") == []
