"""The confidence calibration: P(accept | position, confidence bucket) per (class, draft), learnt
from the engines' counts through the core's report path, with transformed sampling apart."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from specpilot.contract.confidence import (
    CONFIDENCE_EDGES,
    N_CONFIDENCE_BUCKETS,
    bucket_midpoints,
    confidence_buckets,
)
from specpilot.contract.records import (
    AcceptanceRecord,
    ConfidenceRecord,
    DraftKind,
    DraftSpec,
    EngineHello,
    EngineReport,
    ReportRejected,
)
from specpilot.contract.validation import check_report
from specpilot.controller.core.controller import ControllerCore
from specpilot.controller.settings import core_config, load_settings

HELLO = EngineHello(engine_id="e1", model="m", target_vocab_hash="v1",
                    drafts=(DraftSpec("d", DraftKind.MODEL, 4, "v1"),), max_k=4)
MIDPOINTS = bucket_midpoints()


def _core(**settings: Any) -> ControllerCore:
    core = ControllerCore(core_config(load_settings(**settings)), np.random.default_rng(0))
    core.connect_engine(HELLO, now=0.0)
    return core


def _counts(rng: np.random.Generator, truth: np.ndarray, tokens: int,
            transformed: bool = False, cls: str = "chat") -> tuple[ConfidenceRecord, ...]:
    """Position-1 records of ``tokens`` drafts spread evenly over the buckets, each accepted with
    the bucket's ``truth``."""
    tried = np.full(N_CONFIDENCE_BUCKETS, tokens // N_CONFIDENCE_BUCKETS)
    accepted = rng.binomial(tried, truth)
    return (ConfidenceRecord(cls, "d", 1, tuple(int(x) for x in tried),
                             tuple(int(x) for x in accepted), transformed),)


def _feed(core: ControllerCore, records_at: list[tuple[ConfidenceRecord, ...]],
          start: int = 1, t0: float = 1.0) -> int:
    for i, records in enumerate(records_at):
        core.ingest("e1", EngineReport(sequence=start + i, interval_seconds=1.0, policy_version=0,
                                       confidence=records), now=t0 + i)
    return start + len(records_at)


def test_buckets_hold_their_lower_edge_and_refuse_what_is_no_probability() -> None:
    edges = np.asarray(CONFIDENCE_EDGES)
    assert confidence_buckets(edges[:-1]).tolist() == list(range(N_CONFIDENCE_BUCKETS))
    assert confidence_buckets([1.0, 0.999, 0.0]).tolist() == [N_CONFIDENCE_BUCKETS - 1] * 2 + [0]
    for bad in ([1.5], [-0.1], [float("nan")]):
        with pytest.raises(ValueError, match="probability"):
            confidence_buckets(bad)


def test_the_calibration_recovers_how_confidence_predicts_acceptance() -> None:
    """A draft that is over-confident at the top and under-confident at the bottom: the table
    follows the counts, not the draft's own confidence (the control: the midpoints, what a
    calibrated draft would show, are far off)."""
    core = _core()
    truth = np.clip(0.15 + 0.7 * MIDPOINTS, 0.0, 1.0)
    rng = np.random.default_rng(1)
    _feed(core, [_counts(rng, truth, 4000) for _ in range(10)])
    table = core.calibration("chat", "d", 11.0)
    assert np.abs(table.accept[0] - truth).max() < 0.03
    assert np.abs(MIDPOINTS - truth).max() > 0.1  # the control
    # Positions the records never reached keep the class's own acceptance (the prior alone).
    class_accept = core.estimate("chat", "d", 11.0).mean
    assert np.allclose(table.accept[1:], np.asarray(class_accept)[1:, None])
    assert table.tries[1:].sum() == 0


def test_an_empty_cell_falls_back_to_the_class_acceptance() -> None:
    """Counts in one bucket only: the other buckets say what the class-level posterior says,
    so per-token decisions start from today's class-level ones."""
    core = _core()
    core.ingest("e1", EngineReport(sequence=1, interval_seconds=1.0, policy_version=0,
                                   acceptance=(AcceptanceRecord("chat", "d", 2,
                                                                (100, 300, 600)),)), now=1.0)
    tried = [0] * N_CONFIDENCE_BUCKETS
    accepted = [0] * N_CONFIDENCE_BUCKETS
    tried[-1], accepted[-1] = 500, 490
    _feed(core, [(ConfidenceRecord("chat", "d", 1, tuple(tried), tuple(accepted)),)], start=2)
    table = core.calibration("chat", "d", 2.0)
    class_accept = np.asarray(core.estimate("chat", "d", 2.0).mean)
    assert table.accept[0, -1] > 0.97
    assert np.allclose(table.accept[0, :-1], class_accept[0])


def test_transformed_sampling_is_calibrated_apart() -> None:
    """Requests whose sampling the target transforms accept far less than their confidence
    says; counted as transformed they leave the class's plain calibration alone. The control:
    the same counts sent as plain drag it down."""
    truth = np.clip(0.1 + 0.8 * MIDPOINTS, 0.0, 1.0)
    poison = np.full(N_CONFIDENCE_BUCKETS, 0.05)

    def plain_top(mark_transformed: bool) -> float:
        core = _core()
        rng = np.random.default_rng(2)
        nxt = _feed(core, [_counts(rng, truth, 2000) for _ in range(5)])
        _feed(core, [_counts(rng, poison, 2000, transformed=mark_transformed)
                     for _ in range(5)], start=nxt, t0=6.0)
        if mark_transformed:
            apart = core.calibration("chat", "d", 11.0, transformed=True)
            assert apart.accept[0].max() < 0.15
        return float(core.calibration("chat", "d", 11.0).accept[0, -1])

    assert abs(plain_top(True) - truth[-1]) < 0.03
    assert plain_top(False) < truth[-1] - 0.3  # the control


def test_a_calibration_change_is_detected_and_relearnt_quickly() -> None:
    """The draft's confidence stops meaning what it did (a new draft checkpoint, a new prompt
    template): the change detector flags it and the table follows within seconds, not a
    half-life."""
    core = _core()
    rng = np.random.default_rng(3)
    before = np.clip(0.1 + 0.85 * MIDPOINTS, 0.0, 1.0)
    after = np.clip(0.5 * MIDPOINTS, 0.0, 1.0)
    nxt = _feed(core, [_counts(rng, before, 4000) for _ in range(60)])
    _feed(core, [_counts(rng, after, 4000) for _ in range(10)], start=nxt, t0=61.0)
    table = core.calibration("chat", "d", 71.0)
    assert table.changes_detected >= 1
    assert np.abs(table.accept[0] - after).max() < 0.1


def test_malformed_confidence_counts_are_rejected_with_a_reason_and_change_nothing() -> None:
    core = _core()
    good = ConfidenceRecord("chat", "d", 1, (10,) * N_CONFIDENCE_BUCKETS,
                            (5,) * N_CONFIDENCE_BUCKETS)
    bad = {
        "more accepted than tried": (replace(good, accepted_by_bucket=(11,) * N_CONFIDENCE_BUCKETS),
                                     "accepted_by_bucket"),
        "a bucket short": (replace(good, tried_by_bucket=(10,) * (N_CONFIDENCE_BUCKETS - 1)),
                           "confidence bucket"),
        "position beyond K": (replace(good, position=5), "position"),
        "position 0": (replace(good, position=0), "position"),
        "unknown draft": (replace(good, draft="eagle"), "unknown draft"),
        "negative count": (replace(good, tried_by_bucket=(-1,) + (10,) * 7), "tried_by_bucket"),
        "bad class name": (replace(good, traffic_class="bad class!"), "traffic_class"),
    }
    for name, (record, reason) in bad.items():
        report = EngineReport(sequence=1, interval_seconds=1.0, policy_version=0,
                              confidence=(good, record))
        with pytest.raises(ReportRejected, match=reason):
            core.ingest("e1", report, now=1.0)
        assert not core.calibration("chat", "d", 1.0).tries.any(), name
    check_report(EngineReport(sequence=1, interval_seconds=1.0, policy_version=0,
                              confidence=(good,)), {"d": HELLO.drafts[0]}, 4, 9, None)


def test_forgetting_a_class_forgets_its_calibration() -> None:
    core = _core()
    rng = np.random.default_rng(4)
    _feed(core, [_counts(rng, np.full(N_CONFIDENCE_BUCKETS, 0.5), 800)])
    assert core.calibration("chat", "d", 2.0).tries.sum() > 0
    core.forget_class("chat")
    assert core.calibration("chat", "d", 2.0).tries.sum() == 0
