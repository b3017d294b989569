"""The aggregator's confidence counts: each verified drafted token by the draft's confidence
bucket, censored after the first rejection, bad input counted and left out, and the report they
make passes the controller's validation, crosses the wire and reaches its calibration."""

from __future__ import annotations

import numpy as np

from specpilot.contract.confidence import N_CONFIDENCE_BUCKETS, confidence_bucket
from specpilot.contract.engine_stream import report_from_proto, report_to_proto
from specpilot.contract.records import ConfidenceRecord, DraftKind, DraftSpec, EngineHello
from specpilot.contract.validation import check_report
from specpilot.controller.core.controller import ControllerCore
from specpilot.controller.settings import core_config, load_settings
from specpilot.engine_plugin.policy.stats import StatsAggregator


def _record(position: int, tried: dict[int, int], accepted: dict[int, int],
            transformed: bool = False, cls: str = "chat") -> ConfidenceRecord:
    return ConfidenceRecord(
        cls, "d", position,
        tuple(tried.get(b, 0) for b in range(N_CONFIDENCE_BUCKETS)),
        tuple(accepted.get(b, 0) for b in range(N_CONFIDENCE_BUCKETS)), transformed)


def test_verified_tokens_by_confidence_bucket_censored_after_the_first_rejection() -> None:
    agg = StatsAggregator(max_k=4, drafts={"d"})
    hi, mid, lo = confidence_bucket(0.99), confidence_bucket(0.5), confidence_bucket(0.1)
    agg.record_confidences("chat", "d", [0.99, 0.5, 0.1], accepted=1)  # position 3 censored
    agg.record_confidences("chat", "d", [0.99, 0.99, 0.5, 0.1], accepted=4)
    agg.record_confidences("chat", "d", [0.5], accepted=0, transformed=True)
    payload = agg.drain(running_requests=1)
    assert payload.confidence == (
        _record(1, {hi: 2}, {hi: 2}),
        _record(1, {mid: 1}, {}, transformed=True),
        _record(2, {mid: 1, hi: 1}, {hi: 1}),
        _record(3, {mid: 1}, {mid: 1}),
        _record(4, {lo: 1}, {lo: 1}),
    )
    assert payload.record_count == 5 and not payload.is_empty
    assert agg.drain(running_requests=0).confidence == ()  # reset on drain


def test_bad_confidence_input_is_counted_and_left_out() -> None:
    agg = StatsAggregator(max_k=4, drafts={"d"})
    agg.record_confidences("chat", "d", [0.9, float("nan")], accepted=2)
    agg.record_confidences("chat", "d", [0.9, 1.5], accepted=1)
    agg.record_confidences("chat", "d", [0.9], accepted=2)  # more accepted than drafted
    agg.record_confidences("chat", "d", [0.9] * 5, accepted=5)  # beyond max_k
    agg.record_confidences("chat", "eagle", [0.9], accepted=1)  # unknown draft
    agg.record_confidences("bad class!", "d", [0.9], accepted=1)
    agg.record_confidences("chat", "d", [0.9], accepted=1)  # the one good record
    payload = agg.drain(running_requests=0)
    assert payload.ignored_records == 6
    assert payload.confidence == (_record(1, {confidence_bucket(0.9): 1},
                                          {confidence_bucket(0.9): 1}),)


def test_the_report_passes_validation_crosses_the_wire_and_reaches_the_calibration() -> None:
    hello = EngineHello(engine_id="e1", model="m", target_vocab_hash="v",
                        drafts=(DraftSpec("d", DraftKind.MODEL, 4, "v"),), max_k=4)
    agg = StatsAggregator(max_k=4, drafts={"d"})
    rng = np.random.default_rng(0)
    # A draft whose tokens at 0.95 are accepted 95% of the time, at 0.3 a third of the time.
    for _ in range(3000):
        q = float(rng.choice([0.3, 0.95]))
        agg.record_confidences("chat", "d", [q], accepted=int(rng.random() < q))
    report = agg.drain(running_requests=1).report(1, 0, 0, (1, 2, 4))
    check_report(report, {"d": hello.drafts[0]}, 4, 3, None)
    back = report_from_proto(report_to_proto(report))
    assert back == report
    core = ControllerCore(core_config(load_settings()), np.random.default_rng(0))
    core.connect_engine(hello, now=0.0)
    core.ingest("e1", back, now=1.0)
    table = core.calibration("chat", "d", 1.0)
    assert abs(table.accept[0, confidence_bucket(0.95)] - 0.95) < 0.03
    assert abs(table.accept[0, confidence_bucket(0.3)] - 0.3) < 0.05
