"""The aggregator against hand-computed histograms and sums; reset on drain; bad input is
counted and left out; the report (the core's record, made a message by specpilot.controller.wire)
passes the controller's own validation."""

from __future__ import annotations

import math

import pytest

from specpilot.contract.engine_stream import report_from_proto, report_to_proto
from specpilot.contract.records import (
    AcceptanceRecord,
    DraftKind,
    DraftSpec,
    RequestSummaryRecord,
    StepTimingRecord,
)
from specpilot.contract.validation import check_report
from specpilot.engine_plugin.policy.stats import BatchStepSums, ReportPayload, StatsAggregator


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_histograms_by_class_draft_k_and_counterfactual() -> None:
    agg = StatsAggregator(max_k=4, drafts={"d", "ngram"})
    for accepted in (0, 2, 2, 4, 4, 4):
        agg.record_verification("chat", "d", 4, accepted)
    for accepted in (1, 1, 0):
        agg.record_verification("chat", "d", 2, accepted)
    agg.record_verification("code", "d", 4, 3)
    agg.record_verification("chat", "ngram", 3, 3, counterfactual=True)
    agg.record_verification("chat", "ngram", 3, 1, counterfactual=True)
    p = agg.drain(running_requests=3)
    assert p.acceptance == (
        AcceptanceRecord("chat", "d", 2, (1, 2, 0)),
        AcceptanceRecord("chat", "d", 4, (1, 0, 2, 0, 3)),
        AcceptanceRecord("chat", "ngram", 3, (0, 1, 0, 1), counterfactual=True),
        AcceptanceRecord("code", "d", 4, (0, 0, 0, 1, 0)),
    )
    assert p.histogram("chat", "ngram", 3, counterfactual=True) == (0, 1, 0, 1)
    assert p.histogram("chat", "ngram", 3) is None
    assert p.running_requests == 3 and p.ignored_records == 0


def test_steps_are_counted_by_the_drafts_they_verified_where_the_caller_says() -> None:
    """A deterministic drafter asked for K proposes what it finds: each step is counted by the
    drafts it verified beside its accepted ones, and a key whose caller never said how many
    (a model draft's, a counterfactual score) reports no such counts."""
    agg = StatsAggregator(max_k=4, drafts={"suffix", "d"})
    for drafted, accepted in ((0, 0), (2, 1), (2, 2), (4, 3), (1, 0)):
        agg.record_verification("chat", "suffix", 4, accepted, drafted=drafted)
    agg.record_verification("chat", "suffix", 4, 1)  # not counted: taken as all 4 verified
    agg.record_verification("chat", "d", 2, 1)
    agg.record_verification("chat", "suffix", 4, 3, drafted=2)  # more accepted than verified
    agg.record_verification("chat", "suffix", 4, 0, drafted=5)  # more verified than asked
    p = agg.drain(0)
    assert p.acceptance == (
        AcceptanceRecord("chat", "d", 2, (0, 1, 0)),
        AcceptanceRecord("chat", "suffix", 4, (2, 2, 1, 1, 0), steps_by_drafted=(1, 1, 2, 0, 2)),
    )
    assert p.ignored_records == 2
    drafts = {"d": DraftSpec("d", DraftKind.MODEL, 4),
              "suffix": DraftSpec("suffix", DraftKind.SUFFIX, 4)}
    check_report(p.report(1, 1, 0, (2, 8, 32)), drafts, engine_max_k=4, n_buckets=4,
                 last_sequence=0)


def test_step_sums_per_batch_size_and_per_bucket() -> None:
    agg = StatsAggregator()
    # batch 1, draft d, K=4: verified = 1 + 4 drafts
    agg.record_step(1, 5, 4, "d", 4, 0.010)
    agg.record_step(1, 5, 4, "d", 4, 0.012)
    # batch 3 and 4 fall in bucket 1 (2..4)
    agg.record_step(3, 9, 6, "d", 2, 0.020)
    agg.record_step(4, 12, 8, "d", 2, 0.030)
    # k = 0: no draft, whatever is named; batch 40 is in the open bucket 3
    agg.record_step(40, 40, 0, "d", 0, 0.050)
    agg.record_step(40, 40, 0, "", 0, 0.070)
    p = agg.drain(running_requests=0)
    assert p.step_sums == (
        BatchStepSums(1, "d", 4, 2, 10, 8, pytest.approx(0.022)),  # type: ignore[arg-type]
        BatchStepSums(3, "d", 2, 1, 9, 6, 0.020),
        BatchStepSums(4, "d", 2, 1, 12, 8, 0.030),
        BatchStepSums(40, "", 0, 2, 80, 0, pytest.approx(0.12)),  # type: ignore[arg-type]
    )
    assert p.step_timings((1, 4, 16)) == (
        StepTimingRecord(0, "d", 4, 2, 2, 10, 8, pytest.approx(0.022)),  # type: ignore[arg-type]
        StepTimingRecord(1, "d", 2, 2, 7, 21, 14, pytest.approx(0.050)),  # type: ignore[arg-type]
        StepTimingRecord(3, "", 0, 2, 80, 80, 0, pytest.approx(0.12)),  # type: ignore[arg-type]
    )
    # Other bounds (the controller's): the same steps, bucketed when the report is built.
    assert [(s.batch_bucket, s.steps) for s in p.step_timings((2, 64))] == [
        (0, 2), (1, 2), (1, 2)]


def test_finished_summaries_and_cap() -> None:
    agg = StatsAggregator(max_finished=2)
    agg.record_finished("chat", "d", 10, 20, 12, 9, 0.5)
    agg.record_finished("chat", "", 10, 20, 0, 0, 0.25)
    agg.record_finished("chat", "d", 1, 1, 1, 1, 0.1)  # over the cap: dropped, counted
    p = agg.drain(0)
    assert p.finished == (RequestSummaryRecord("chat", "d", 10, 20, 12, 9, 0.5),
                          RequestSummaryRecord("chat", "", 10, 20, 0, 0, 0.25))
    assert p.dropped_records == 1
    assert p.record_count == 2


def test_drain_resets_and_measures_the_interval() -> None:
    clock = FakeClock()
    agg = StatsAggregator(clock=clock)
    agg.record_verification("chat", "d", 2, 1)
    agg.record_step(2, 4, 2, "d", 1, 0.01)
    agg.record_finished("chat", "d", 1, 2, 1, 1, 0.1)
    agg.record_verification("chat", "d", 2, 9)  # ignored
    clock.now += 1.5
    first = agg.drain(running_requests=2)
    assert first.interval_seconds == pytest.approx(1.5)
    assert (len(first.acceptance), len(first.step_sums), len(first.finished)) == (1, 1, 1)
    assert first.ignored_records == 1
    clock.now += 0.25
    second = agg.drain(running_requests=0)
    assert second.is_empty and second.ignored_records == 0 and second.dropped_records == 0
    assert second.interval_seconds == pytest.approx(0.25)
    # Counting resumes from zero, not from the old counts.
    agg.record_verification("chat", "d", 2, 1)
    assert agg.drain(0).acceptance[0].steps_by_accepted == (0, 1, 0)


@pytest.mark.parametrize("args", [
    ("chat", "d", 0, 0),          # k < 1
    ("chat", "d", 9, 1),          # k above max_k
    ("chat", "d", 2, 3),          # accepted > k
    ("chat", "d", 2, -1),         # negative
    ("chat", "d", 2, 1.0),        # not an integer
    ("chat", "d", 2.5, 1),
    ("chat", "unknown", 2, 1),    # draft not announced
    ("chat", "", 2, 1),
    ("bad class!", "d", 2, 1),    # the controller would reject the whole report
    (None, "d", 2, 1),
])
def test_bad_verifications_are_counted_and_ignored(args: tuple[object, ...]) -> None:
    agg = StatsAggregator(max_k=4, drafts={"d"})
    agg.record_verification(*args)  # type: ignore[arg-type]
    p = agg.drain(0)
    assert p.acceptance == () and p.ignored_records == 1


@pytest.mark.parametrize("args", [
    (0, 1, 0, "d", 1, 0.01),            # empty batch
    (4, 3, 0, "d", 1, 0.01),            # fewer verified tokens than sequences
    (4, 8, -1, "d", 1, 0.01),
    (4, 8, 4, "d", 1, math.nan),
    (4, 8, 4, "d", 1, math.inf),
    (4, 8, 4, "d", 1, -0.1),
    (4, 8, 4, "d", 9, 0.01),            # k above max_k
    (4, 8, 4, "x", 1, 0.01),            # unknown draft
    ("4", 8, 4, "d", 1, 0.01),
])
def test_bad_steps_are_counted_and_ignored(args: tuple[object, ...]) -> None:
    agg = StatsAggregator(max_k=4, drafts={"d"})
    agg.record_step(*args)  # type: ignore[arg-type]
    p = agg.drain(0)
    assert p.step_sums == () and p.ignored_records == 1


@pytest.mark.parametrize("args", [
    ("chat", "d", 1, 2, 3, 4, 0.1),        # accepted > drafted
    ("chat", "d", -1, 2, 3, 1, 0.1),
    ("chat", "d", 1, 2, 3, 1, math.nan),
    ("chat", "x", 1, 2, 3, 1, 0.1),
    ("", "d", 1, 2, 3, 1, 0.1),
    ("chat", "d", 1.5, 2, 3, 1, 0.1),
])
def test_bad_finished_are_counted_and_ignored(args: tuple[object, ...]) -> None:
    agg = StatsAggregator(drafts={"d"})
    agg.record_finished(*args)  # type: ignore[arg-type]
    p = agg.drain(0)
    assert p.finished == () and p.ignored_records == 1


def test_keys_are_bounded() -> None:
    agg = StatsAggregator(max_keys=3)
    for i in range(10):
        agg.record_verification(f"c{i}", "d", 1, 1)
    p = agg.drain(0)
    assert len(p.acceptance) == 3 and p.ignored_records == 7


def test_report_carries_everything_and_passes_controller_validation() -> None:
    agg = StatsAggregator(max_k=4, drafts={"d", "ngram"}, max_finished=1)
    agg.record_verification("chat", "d", 4, 2)
    agg.record_verification("chat", "ngram", 2, 1, counterfactual=True)
    agg.record_step(3, 9, 6, "d", 2, 0.02)
    agg.record_finished("chat", "d", 5, 6, 4, 2, 0.3)
    agg.record_finished("chat", "d", 5, 6, 4, 2, 0.3)  # dropped (cap 1)
    p = agg.drain(running_requests=7)
    msg = report_to_proto(p.report(sequence=3, policy_version=12, records_dropped=4,
                                   bucket_bounds=(2, 8, 32)))
    assert msg.sequence == 3 and msg.policy_version == 12
    assert msg.records_dropped == 5  # the sender's 4 and the payload's own dropped summary
    assert msg.running_requests == 7 and msg.interval_seconds == p.interval_seconds
    assert [(a.traffic_class, a.draft, a.k, list(a.steps_by_accepted), a.counterfactual)
            for a in msg.acceptance] == [("chat", "d", 4, [0, 0, 1, 0, 0], False),
                                         ("chat", "ngram", 2, [0, 1, 0], True)]
    (st,) = msg.step_timings
    assert (st.batch_bucket, st.draft, st.k, st.steps, st.sum_batch_size, st.sum_verified_tokens,
            st.sum_draft_tokens) == (1, "d", 2, 1, 3, 9, 6)
    assert st.sum_step_seconds == pytest.approx(0.02)
    (fin,) = msg.finished
    assert (fin.traffic_class, fin.accepted_tokens, fin.latency_seconds) == ("chat", 2, 0.3)
    drafts = {"d": DraftSpec("d", DraftKind.MODEL, 4),
              "ngram": DraftSpec("ngram", DraftKind.NGRAM, 4)}
    check_report(report_from_proto(msg), drafts, engine_max_k=4, n_buckets=4, last_sequence=2)


def test_heartbeat_is_an_empty_report() -> None:
    report = ReportPayload.heartbeat(running_requests=2**40).report(
        sequence=5, policy_version=3, records_dropped=2, bucket_bounds=(1, 4))
    assert (report.sequence, report.policy_version, report.records_dropped) == (5, 3, 2)
    assert not (report.acceptance or report.finished or report.step_timings)
    assert report.interval_seconds == 0.0
    assert report.running_requests == 2**32 - 1  # clamped to the wire's uint32
    assert report_to_proto(report).running_requests == 2**32 - 1


def test_step_sums_carry_the_context_read_and_unknown_stays_unknown() -> None:
    """Each step's context (its sequences' KV lengths before it, summed) is summed per batch
    size and bucket, and reaches the report. A bucket where some step's context was unknown
    reports 0 (unknown on the wire), never a sum that would read as shorter contexts than ran;
    a step of new requests only, context 0, is known and leaves its bucket's sum known."""
    agg = StatsAggregator(max_k=4, drafts={"d"})
    agg.record_step(3, 9, 6, "d", 2, 0.02, 3 * 500)
    agg.record_step(4, 12, 8, "d", 2, 0.03, 4 * 700)
    agg.record_step(40, 40, 0, "", 0, 0.05, 40 * 100)
    agg.record_step(40, 40, 0, "", 0, 0.05)  # unknown
    agg.record_step(4, 8, 4, "d", 2, 0.01, 0)  # new requests only: known, no context
    p = agg.drain(running_requests=0)
    assert [s.sum_context_tokens for s in p.step_sums] == [1500, 2800, None]
    timings = p.step_timings((1, 4, 16))
    assert [(t.batch_bucket, t.sum_context_tokens) for t in timings] == [(1, 4300), (3, 0)]
    report = p.report(1, 0, 0, (1, 4, 16))
    drafts = {"d": DraftSpec("d", DraftKind.MODEL, 4)}
    back = report_from_proto(report_to_proto(report))
    assert back.step_timings[0].sum_context_tokens == 4300
    check_report(back, drafts, engine_max_k=4, n_buckets=4, last_sequence=0)


@pytest.mark.parametrize("context", [-1, 1.5, math.nan])
def test_a_step_with_a_bad_context_is_counted_and_ignored(context: object) -> None:
    agg = StatsAggregator(max_k=4, drafts={"d"})
    agg.record_step(4, 8, 4, "d", 1, 0.01, context)  # type: ignore[arg-type]
    p = agg.drain(0)
    assert p.step_sums == () and p.ignored_records == 1
