"""Protobuf <-> core conversion: every field survives a round trip, enums map one to one, and what
protobuf cannot express in the core (unset enums, an override without action) is refused."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from specpilot.contract import engine_stream
from specpilot.contract.records import (
    AcceptanceRecord,
    ArmFigures,
    ConfidenceRecord,
    Decision,
    DecisionEvent,
    DecisionFigures,
    DraftKind,
    DraftSpec,
    EngineDecision,
    EngineHello,
    EngineReport,
    HelloAck,
    Override,
    PolicyUpdate,
    Reason,
    ReportRejected,
    ReportResult,
    RequestSummaryRecord,
    StepProfile,
    StepTimingRecord,
)
from specpilot.controller import wire
from specpilot.controller.core.controller import ControllerCore
from specpilot.controller.core.engines import HelloOutcome
from specpilot.controller.core.snapshot import CoreSnapshot
from specpilot.controller.settings import core_config, load_settings
from specpilot.v1 import common_pb2, engine_pb2, policy_pb2
from tests.test_core_controller import HELLO as HELLO_CORE

HELLO = EngineHello(
    engine_id="e-7", model="m", target_vocab_hash="abc",
    drafts=(DraftSpec("d1", DraftKind.MODEL, 5, "abc"), DraftSpec("ng", DraftKind.NGRAM, 3)),
    max_k=5, per_request_k=False, batch_wide_k=True, ngram_substitution=True,
    ngram_counterfactual=True, step_probes=True, step_composition=True, engine_version="0.9",
    plugin_version="0.1",
    max_batch_size=256,
    step_profile=(StepProfile(16, 16, "", 0, 0.004), StepProfile(16, 48, "d1", 2, 0.009, 384)),
    hardware="NVIDIA H100 80GB HBM3 tp1 pp1 bfloat16",
)
REPORT = EngineReport(
    sequence=9, interval_seconds=1.5, policy_version=4,
    acceptance=(AcceptanceRecord("chat", "d1", 2, (3, 4, 5), counterfactual=True,
                                 steps_by_drafted=(1, 2, 9)),),
    finished=(RequestSummaryRecord("chat", "d1", 11, 22, 33, 30, 0.75),),
    step_timings=(StepTimingRecord(2, "d1", 2, 10, 40, 120, 80, 0.5, 40 * 600, 3 * 512),),
    records_dropped=6, running_requests=7,
    confidence=(ConfidenceRecord("chat", "d1", 2, (1, 2, 3, 4, 5, 6, 7, 8),
                                 (1, 1, 2, 3, 4, 5, 6, 7), transformed=True),),
)


def _no_defaults(record: object) -> None:
    """Guard: every field differs from its default, so a dropped field fails the round trip."""
    assert dataclasses.is_dataclass(record)
    for f in dataclasses.fields(record):
        if f.default is not dataclasses.MISSING:
            assert getattr(record, f.name) != f.default, f.name


def test_hello_round_trip() -> None:
    _no_defaults(HELLO)
    assert engine_stream.hello_from_proto(engine_stream.hello_to_proto(HELLO)) == HELLO


def test_report_round_trip() -> None:
    for record in (REPORT, *REPORT.acceptance, *REPORT.finished, *REPORT.step_timings,
                   *REPORT.confidence):
        _no_defaults(record)
    msg = engine_stream.report_to_proto(REPORT)
    assert msg.acceptance[0].steps_by_accepted == [3, 4, 5]
    assert msg.step_timings[0].sum_step_seconds == 0.5
    back = engine_stream.report_from_proto(
        engine_pb2.EngineReport.FromString(msg.SerializeToString()))
    assert back == REPORT
    assert isinstance(back.acceptance[0].steps_by_accepted, tuple)


@pytest.mark.parametrize("reason", list(Reason))
def test_decision_round_trip_for_every_reason(reason: Reason) -> None:
    d = Decision("chat", 3, "d1", 4, reason, 1.7, 0.02, 2, "d1", True)
    msg = engine_stream.decision_to_proto(d)
    assert common_pb2.DecisionReason.Name(msg.reason) == f"DECISION_REASON_{reason.name}"
    assert engine_stream.decision_from_proto(msg) == d


def test_draft_kinds_map_by_name() -> None:
    for kind in DraftKind:
        value = engine_stream.draft_kind_to_proto(kind)
        assert common_pb2.DraftKind.Name(value) == f"DRAFT_KIND_{kind.name}"
        assert engine_stream.draft_kind_from_proto(value) is kind


def test_unset_enums_are_refused_naming_the_field() -> None:
    msg = engine_stream.hello_to_proto(HELLO)
    msg.drafts[1].kind = common_pb2.DRAFT_KIND_UNSPECIFIED
    with pytest.raises(ReportRejected, match=r"hello\.drafts\[1\]\.kind"):
        engine_stream.hello_from_proto(msg)
    with pytest.raises(ReportRejected, match=r"decision\.reason"):
        engine_stream.decision_from_proto(common_pb2.Decision(traffic_class="x"))


def test_event_carries_the_previous_choice() -> None:
    new = Decision("chat", 0, "d1", 3, Reason.GOODPUT)
    off_before = Decision("chat", 0, "d1", 0, Reason.GOODPUT)
    msg = wire.event_to_proto(DecisionEvent(5, 123.5, new, off_before))
    assert (msg.policy_version, msg.unix_seconds, msg.decision.k) == (5, 123.5, 3)
    # "off" has no draft, whatever the stale field says.
    assert (msg.previous_draft, msg.previous_k) == ("", 0)
    assert msg.HasField("previous_k")
    first = wire.event_to_proto(DecisionEvent(1, 1.0, new, None))
    assert (first.previous_draft, first.previous_k) == ("", 0)
    assert not first.HasField("previous_k") and wire.event_from_proto(first).previous is None
    assert wire.event_from_proto(msg).previous == dataclasses.replace(off_before, draft="")


def test_event_carries_the_figures_it_was_decided_on() -> None:
    figures = DecisionFigures(
        32, ArmFigures("d1", 3, 2.2, 1840.0, 1.84, (0.71, 0.03)),
        ArmFigures("", 0, 1.0, 1000.0, 1.0), ArmFigures("d1", 4, 2.5, -20.0, 0.0, (0.71, 0.03)),
        "pin K=3")
    event = DecisionEvent(5, 123.5, Decision("chat", 5, "d1", 3, Reason.OVERRIDE, 1.84),
                          Decision("chat", 5, "", 0, Reason.OVERRIDE), figures)
    assert wire.event_from_proto(wire.event_to_proto(event)) == event
    bare = wire.event_to_proto(dataclasses.replace(event, figures=None))
    assert not bare.HasField("figures") and wire.event_from_proto(bare).figures is None
    off = wire.event_to_proto(event).figures.previous
    assert not off.HasField("acceptance_mean")  # speculation off has no acceptance


@pytest.mark.parametrize("override", [
    Override("chat", pin_k=0, note="n", set_at=5.0),
    Override("chat", pin_k=3),
    Override("*", force_draft="d1"),
    Override("chat", force_off=True),
])
def test_override_round_trip(override: Override) -> None:
    assert wire.override_from_proto(wire.override_to_proto(override)) == override


def test_override_without_action_is_refused() -> None:
    with pytest.raises(ValueError, match=r"override\.action"):
        wire.override_from_proto(policy_pb2.Override(traffic_class="chat"))
    with pytest.raises(ValueError, match=r"override\.force_off"):
        wire.override_from_proto(policy_pb2.Override(traffic_class="chat", force_off=False))


def _read_model() -> CoreSnapshot:
    """A core with several classes: varied evidence, K up to each draft's, an n-gram draft with
    no evidence (the bare prior), a class reported at a lower K than the draft's."""
    core = ControllerCore(core_config(load_settings()), np.random.default_rng(0))
    core.connect_engine(HELLO_CORE, now=0.0)
    records = tuple(AcceptanceRecord(cls, "d", k, tuple(5 + (i * 7 + a * 3) % 40 for a in
                                                          range(k + 1)))
                    for i, cls in enumerate(("chat", "code", "rag", "batch")) for k in
                    range(1, 7 - i))
    core.ingest("e1", EngineReport(1, 1.0, 0, records), now=1.0)
    core.decide(1.0)
    return core.snapshot(30.0)


def test_estimate_figures_from_one_pass_are_each_estimates_own() -> None:
    snap = _read_model()
    estimates = [e for c in snap.classes for e in c.estimates]
    assert len(estimates) > 8 and any(not e.has_evidence for e in estimates)
    for e, v in zip(estimates, wire.estimates_values(estimates, 0.9), strict=True):
        lower, upper = e.credible_interval(0.9)
        assert v.mean == e.mean.tolist() and v.effective_tries == e.effective_tries.tolist()
        assert v.lower == lower.tolist() and v.upper == upper.tolist()
        assert v.expected_tokens == e.expected_tokens.tolist()
    # The whole response (one pass) and each class on its own (a pass per class) agree.
    whole = wire.policy_response_to_proto(snap, snap.classes, 0.9)
    assert list(whole.classes) == [wire.class_view_to_proto(c, 0.9) for c in snap.classes]
    assert wire.estimates_values([], 0.9) == []


def test_composition_round_trip_and_refusal() -> None:
    from specpilot.contract.pricing import Composition, DraftPricing, StepPricing

    comp = Composition(
        StepPricing(0.02, 1e-4, 2e-5, (64, 256), (1e-4, 3e-4),
                    {"d1": DraftPricing(5e-4, 4e-3, 2e-5)}, 3e-8),
        {("chat", "d1"): (1.0, 1.7, 2.2), ("chat", "ng"): (1.0, 1.1)}, 0.01)
    msg = engine_pb2.Composition.FromString(
        engine_stream.composition_to_proto(comp).SerializeToString())
    assert engine_stream.composition_from_proto(msg) == comp
    msg.expected_tokens[0].by_k[1] = float("nan")
    with pytest.raises(ValueError, match=r"E\(K\) of \('chat', 'd1'\)"):
        engine_stream.composition_from_proto(msg)
    msg = engine_stream.composition_to_proto(comp)
    del msg.pricing.seconds_per_token_above[1]
    with pytest.raises(ValueError, match="one slope per knot"):
        engine_stream.composition_from_proto(msg)


def test_what_the_controller_sends_reaches_an_engine_as_records() -> None:
    """The HelloAck and a report's result as the controller's server builds them, and an empty
    message, as the engine's link receives them."""
    ack = wire.hello_ack_to_proto(
        HelloOutcome(("d1",), (("d2", "vocabulary differs"),)), controller_version="1.2",
        report_interval_seconds=0.5, batch_bucket_upper_bounds=(1, 4), max_classes=8,
        policy_epoch=3)
    got = engine_stream.controller_message_from_proto(engine_pb2.ConnectResponse(hello_ack=ack))
    assert got == HelloAck("1.2", ("d1",), (("d2", "vocabulary differs"),), 0.5, (1, 4), 8, 3)
    result = ReportResult(4, False, 8, "shed", ("x", "y"), 1.5)
    _no_defaults(result)
    msg = engine_pb2.ConnectResponse(report_result=engine_pb2.ReportResult(
        sequence=4, accepted=False, code=8, reason="shed", folded_classes=["x", "y"],
        retry_after_seconds=1.5))
    assert engine_stream.controller_message_from_proto(msg) == result
    assert engine_stream.controller_message_from_proto(engine_pb2.ConnectResponse()) is None


def test_a_policy_reaches_an_engine_whole_whatever_it_does_not_know() -> None:
    """Every decision arrives with its fields; one whose reason the engine does not know (unset,
    or a newer controller's) arrives with none, and an unusable composition is left out, saying
    why, while the decisions stand."""
    from specpilot.contract.pricing import Composition, StepPricing

    decisions = [Decision("chat", b, "d1", 2, reason, 1.4, 0.1, 1, "d2", True)
                 for b, reason in enumerate(Reason)]
    default = Decision("", 0, "", 0, Reason.WARMUP)
    comp = Composition(StepPricing(0.02, 1e-4, 2e-5, (), ()), {("chat", "d1"): (1.0, 1.5)}, 0.01)
    msg = engine_pb2.PolicyUpdate(
        version=7, decisions=[engine_stream.decision_to_proto(d) for d in decisions],
        default_decisions=[engine_stream.decision_to_proto(default)],
        fail_static_timeout_seconds=30.0, composition=engine_stream.composition_to_proto(comp))
    for reason in (common_pb2.DECISION_REASON_UNSPECIFIED, 99):
        msg.decisions.add(traffic_class="new", batch_bucket=1, draft="d1", k=3, reason=reason)
    got = engine_stream.policy_update_from_proto(
        engine_pb2.PolicyUpdate.FromString(msg.SerializeToString()))

    def engine(d: Decision) -> EngineDecision:
        return EngineDecision(d.traffic_class, d.bucket, d.draft, d.k, d.reason, d.probe_rate,
                              d.probe_k, d.probe_draft, d.probe_steps)

    unknown = EngineDecision("new", 1, "d1", 3, None)
    assert got == PolicyUpdate(7, (*map(engine, decisions), unknown, unknown),
                               (engine(default),), 30.0, comp)
    msg.composition.margin = float("nan")
    refused = engine_stream.policy_update_from_proto(msg)
    assert refused.composition is None and "margin" in refused.composition_error
    assert refused.decisions == got.decisions
    assert engine_stream.policy_update_from_proto(engine_pb2.PolicyUpdate(version=1)) == \
        PolicyUpdate(1)
