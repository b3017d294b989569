"""The engine stream's converters, protobuf <-> contract records: one function per message and
direction, nothing else. The plugin and the controller's engine service both use these; what the
controller builds from its own state (the HelloAck, the policy of a read model) it encodes in
``specpilot.controller.wire``, and the plugin decodes here (``controller_message_from_proto``).

Conversion is structural only; validation stays with the records' checks
(``specpilot.contract.validation``), so the server, the simulator and the tests reject the same
things with the same reasons. The one exception is what protobuf cannot express in a dataclass
(an unset enum or oneof): that raises ``ReportRejected`` naming the field, like any other bad
input. An engine takes a decision whose reason it does not know and a policy whose composition
it cannot use without refusing the rest (``EngineDecision``, ``PolicyUpdate``).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, TypeVar, cast

import grpc
from google.protobuf.message import Message

from specpilot.contract.pricing import Composition, DraftPricing, StepPricing
from specpilot.contract.records import (
    AcceptanceRecord,
    ArmFigures,
    CalibrationRows,
    ConfidenceRecord,
    Decision,
    DecisionFigures,
    DraftKind,
    DraftSpec,
    EngineDecision,
    EngineHello,
    EngineReport,
    HelloAck,
    PolicyUpdate,
    Reason,
    ReportRejected,
    ReportResult,
    RequestSummaryRecord,
    StepProfile,
    StepTimingRecord,
    TokenCut,
)
from specpilot.v1 import common_pb2, engine_pb2

# ReportResult.code of a report an overloaded controller shed: nothing of it applied; the engine
# sends it again after retry_after_seconds (the field holds gRPC status code numbers).
REPORT_SHED_CODE: int = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

_D = TypeVar("_D", bound="DataclassInstance")
_M = TypeVar("_M", bound=Message)

# Enum tables derived from the names (Reason.WARMUP <-> DECISION_REASON_WARMUP): a member missing
# on either side fails at import, not at the first decision that uses it.
# (EnumTypeWrapper.Value is typed as returning int; the values are the enum's.)
_REASON_TO_PROTO = {
    r: cast(common_pb2.DecisionReason, common_pb2.DecisionReason.Value(f"DECISION_REASON_{r.name}"))
    for r in Reason
}
_REASON_FROM_PROTO: dict[int, Reason] = {v: r for r, v in _REASON_TO_PROTO.items()}
_KIND_TO_PROTO = {
    k: cast(common_pb2.DraftKind, common_pb2.DraftKind.Value(f"DRAFT_KIND_{k.name}"))
    for k in DraftKind
}
_KIND_FROM_PROTO: dict[int, DraftKind] = {v: k for k, v in _KIND_TO_PROTO.items()}


def reason_to_proto(reason: Reason) -> common_pb2.DecisionReason:
    return _REASON_TO_PROTO[reason]


_E = TypeVar("_E")


def _enum_from_proto(table: dict[int, _E], value: int, where: str, what: str) -> _E:
    """The core's enum member for a wire value; ReportRejected naming the field when unset or
    unknown."""
    try:
        return table[value]
    except KeyError:
        raise ReportRejected(f"{where}: {what} {value} is unset or unknown") from None


def reason_from_proto(value: int, where: str = "reason") -> Reason:
    return _enum_from_proto(_REASON_FROM_PROTO, value, where, "decision reason")


def draft_kind_to_proto(kind: DraftKind) -> common_pb2.DraftKind:
    return _KIND_TO_PROTO[kind]


def draft_kind_from_proto(value: int, where: str = "kind") -> DraftKind:
    return _enum_from_proto(_KIND_FROM_PROTO, value, where, "draft kind")


# --- records whose fields mirror their message one to one ----------------------------------------
_MIRRORED: dict[tuple[type, type], tuple[tuple[str, bool], ...]] = {}


def _mirrored_fields(cls: type[DataclassInstance], msg: Message) -> tuple[tuple[str, bool], ...]:
    """Per field in declaration order (the constructor's positional order): its name and
    whether the message repeats it. Cached: every report converts dozens of records."""
    key = (cls, type(msg))
    got = _MIRRORED.get(key)
    if got is None:
        fields = msg.DESCRIPTOR.fields_by_name
        got = _MIRRORED[key] = tuple((f.name, bool(fields[f.name].is_repeated))
                                     for f in dataclasses.fields(cls))
    return got


def _mirror_from_proto(cls: type[_D], msg: Message) -> _D:
    # Repeated scalar fields become tuples (the core's records are frozen and hashable).
    return cls(*[tuple(getattr(msg, name)) if repeated else getattr(msg, name)
                 for name, repeated in _mirrored_fields(cls, msg)])


def _mirror_to_proto(cls: type[_M], record: DataclassInstance) -> _M:
    return cls(**{f.name: getattr(record, f.name) for f in dataclasses.fields(record)})


def acceptance_from_proto(msg: engine_pb2.AcceptanceCounts) -> AcceptanceRecord:
    return _mirror_from_proto(AcceptanceRecord, msg)


def acceptance_to_proto(rec: AcceptanceRecord) -> engine_pb2.AcceptanceCounts:
    return _mirror_to_proto(engine_pb2.AcceptanceCounts, rec)


def confidence_from_proto(msg: engine_pb2.ConfidenceCounts) -> ConfidenceRecord:
    return _mirror_from_proto(ConfidenceRecord, msg)


def confidence_to_proto(rec: ConfidenceRecord) -> engine_pb2.ConfidenceCounts:
    return _mirror_to_proto(engine_pb2.ConfidenceCounts, rec)


def summary_from_proto(msg: engine_pb2.RequestSummary) -> RequestSummaryRecord:
    return _mirror_from_proto(RequestSummaryRecord, msg)


def summary_to_proto(rec: RequestSummaryRecord) -> engine_pb2.RequestSummary:
    return _mirror_to_proto(engine_pb2.RequestSummary, rec)


def step_timing_from_proto(msg: engine_pb2.StepTiming) -> StepTimingRecord:
    return _mirror_from_proto(StepTimingRecord, msg)


def step_timing_to_proto(rec: StepTimingRecord) -> engine_pb2.StepTiming:
    return _mirror_to_proto(engine_pb2.StepTiming, rec)


# --- engine stream ---------------------------------------------------------------------------
def draft_from_proto(msg: engine_pb2.DraftInfo, where: str = "draft") -> DraftSpec:
    return DraftSpec(msg.name, draft_kind_from_proto(msg.kind, f"{where}.kind"), msg.max_k,
                     msg.vocab_hash)


def draft_to_proto(spec: DraftSpec) -> engine_pb2.DraftInfo:
    return engine_pb2.DraftInfo(name=spec.name, kind=draft_kind_to_proto(spec.kind),
                                vocab_hash=spec.vocab_hash, max_k=spec.max_k)


def hello_from_proto(msg: engine_pb2.EngineHello) -> EngineHello:
    caps = msg.capabilities
    return EngineHello(
        engine_id=msg.engine_id,
        model=msg.model,
        target_vocab_hash=msg.target_vocab_hash,
        drafts=tuple(draft_from_proto(d, f"hello.drafts[{i}]") for i, d in enumerate(msg.drafts)),
        max_k=msg.max_k,
        per_request_k=caps.per_request_k,
        batch_wide_k=caps.batch_wide_k,
        ngram_substitution=caps.ngram_substitution,
        ngram_counterfactual=caps.ngram_counterfactual,
        step_probes=caps.step_probes,
        step_composition=caps.step_composition,
        engine_version=msg.engine_version,
        plugin_version=msg.plugin_version,
        max_batch_size=msg.max_batch_size,
        step_profile=tuple(
            StepProfile(p.batch_size, p.verified_tokens, p.draft, p.draft_passes, p.seconds,
                        p.context_tokens, p.prefill_tokens)
            for p in msg.step_profile),
        hardware=msg.hardware,
    )


def hello_to_proto(hello: EngineHello) -> engine_pb2.EngineHello:
    return engine_pb2.EngineHello(
        engine_id=hello.engine_id,
        model=hello.model,
        target_vocab_hash=hello.target_vocab_hash,
        drafts=[draft_to_proto(d) for d in hello.drafts],
        max_k=hello.max_k,
        capabilities=engine_pb2.EngineCapabilities(
            per_request_k=hello.per_request_k,
            batch_wide_k=hello.batch_wide_k,
            ngram_substitution=hello.ngram_substitution,
            ngram_counterfactual=hello.ngram_counterfactual,
            step_probes=hello.step_probes,
            step_composition=hello.step_composition,
        ),
        engine_version=hello.engine_version,
        plugin_version=hello.plugin_version,
        max_batch_size=hello.max_batch_size,
        step_profile=[
            engine_pb2.StepProfile(batch_size=p.batch_size, verified_tokens=p.verified_tokens,
                                   draft=p.draft, draft_passes=p.draft_passes, seconds=p.seconds,
                                   context_tokens=p.context_tokens,
                                   prefill_tokens=p.prefill_tokens)
            for p in hello.step_profile],
        hardware=hello.hardware,
    )


def report_from_proto(msg: engine_pb2.EngineReport) -> EngineReport:
    return EngineReport(
        sequence=msg.sequence,
        interval_seconds=msg.interval_seconds,
        policy_version=msg.policy_version,
        acceptance=tuple(acceptance_from_proto(a) for a in msg.acceptance),
        finished=tuple(summary_from_proto(s) for s in msg.finished),
        step_timings=tuple(step_timing_from_proto(t) for t in msg.step_timings),
        records_dropped=msg.records_dropped,
        running_requests=msg.running_requests,
        confidence=tuple(confidence_from_proto(c) for c in msg.confidence),
    )


def report_to_proto(report: EngineReport) -> engine_pb2.EngineReport:
    return engine_pb2.EngineReport(
        sequence=report.sequence,
        interval_seconds=report.interval_seconds,
        policy_version=report.policy_version,
        acceptance=[acceptance_to_proto(a) for a in report.acceptance],
        finished=[summary_to_proto(s) for s in report.finished],
        step_timings=[step_timing_to_proto(t) for t in report.step_timings],
        records_dropped=report.records_dropped,
        running_requests=report.running_requests,
        confidence=[confidence_to_proto(c) for c in report.confidence],
    )


def hello_ack_from_proto(msg: engine_pb2.HelloAck) -> HelloAck:
    return HelloAck(
        controller_version=msg.controller_version,
        accepted_drafts=tuple(msg.accepted_drafts),
        rejected_drafts=tuple((d.name, d.reason) for d in msg.rejected_drafts),
        report_interval_seconds=msg.report_interval_seconds,
        batch_bucket_upper_bounds=tuple(msg.batch_bucket_upper_bounds),
        max_classes=msg.max_classes,
        policy_epoch=msg.policy_epoch,
    )


def report_result_from_proto(msg: engine_pb2.ReportResult) -> ReportResult:
    return _mirror_from_proto(ReportResult, msg)


# --- decisions ---------------------------------------------------------------------------------
def decision_to_proto(d: Decision) -> common_pb2.Decision:
    return common_pb2.Decision(
        traffic_class=d.traffic_class,
        batch_bucket=d.bucket,
        draft=d.draft,
        k=d.k,
        reason=reason_to_proto(d.reason),
        expected_speedup=d.expected_speedup,
        probe_rate=d.probe_rate,
        probe_k=d.probe_k,
        probe_draft=d.probe_draft,
        probe_steps=d.probe_steps,
        too_little_evidence=d.too_little_evidence,
    )


def decision_from_proto(msg: common_pb2.Decision) -> Decision:
    return Decision(
        traffic_class=msg.traffic_class,
        bucket=msg.batch_bucket,
        draft=msg.draft,
        k=msg.k,
        reason=reason_from_proto(msg.reason, "decision.reason"),
        expected_speedup=msg.expected_speedup,
        probe_rate=msg.probe_rate,
        probe_k=msg.probe_k,
        probe_draft=msg.probe_draft,
        probe_steps=msg.probe_steps,
        too_little_evidence=msg.too_little_evidence,
    )


def engine_decision_from_proto(msg: common_pb2.Decision) -> EngineDecision:
    """A decision as an engine takes it: a reason it does not know is None."""
    return EngineDecision(
        traffic_class=msg.traffic_class,
        bucket=msg.batch_bucket,
        draft=msg.draft,
        k=msg.k,
        reason=_REASON_FROM_PROTO.get(msg.reason),
        probe_rate=msg.probe_rate,
        probe_k=msg.probe_k,
        probe_draft=msg.probe_draft,
        probe_steps=msg.probe_steps,
    )


def arm_figures_to_proto(f: ArmFigures) -> common_pb2.ArmFigures:
    mean, half_width = f.acceptance if f.acceptance is not None else (None, None)
    return common_pb2.ArmFigures(
        draft=f.draft, k=f.k, expected_tokens=f.expected_tokens,
        goodput_tokens_per_second=f.goodput, speedup=f.speedup,
        acceptance_mean=mean, acceptance_half_width=half_width,
        too_little_evidence=f.too_little_evidence)


def arm_figures_from_proto(msg: common_pb2.ArmFigures) -> ArmFigures:
    acceptance = ((msg.acceptance_mean, msg.acceptance_half_width)
                  if msg.HasField("acceptance_mean") else None)
    return ArmFigures(msg.draft, msg.k, msg.expected_tokens, msg.goodput_tokens_per_second,
                      msg.speedup, acceptance, msg.too_little_evidence)


def figures_to_proto(f: DecisionFigures) -> common_pb2.DecisionFigures:
    def arm(a: ArmFigures | None) -> common_pb2.ArmFigures | None:
        return None if a is None else arm_figures_to_proto(a)
    return common_pb2.DecisionFigures(batch_size=f.batch_size, chosen=arm(f.chosen),
                                      previous=arm(f.previous), best=arm(f.best),
                                      pinned_by=f.pinned_by)


def figures_from_proto(msg: common_pb2.DecisionFigures) -> DecisionFigures:
    def arm(name: str) -> ArmFigures | None:
        return arm_figures_from_proto(getattr(msg, name)) if msg.HasField(name) else None
    return DecisionFigures(msg.batch_size, arm("chosen"), arm("previous"), arm("best"),
                           msg.pinned_by)


def composition_to_proto(c: Composition) -> engine_pb2.Composition:
    p = c.pricing
    return engine_pb2.Composition(
        pricing=engine_pb2.StepPricing(
            base_seconds=p.base_seconds, seconds_per_sequence=p.seconds_per_sequence,
            seconds_per_token=p.seconds_per_token, knot_tokens=p.knot_tokens,
            seconds_per_token_above=p.seconds_per_token_above,
            seconds_per_context_token=p.seconds_per_context_token,
            seconds_per_speculating_sequence=p.seconds_per_speculating_sequence,
            seconds_per_prefill_token=p.seconds_per_prefill_token,
            drafts=[engine_pb2.DraftPricing(draft=name, fixed_seconds=d.fixed_seconds,
                                            seconds_per_pass=d.seconds_per_pass,
                                            seconds_per_token=d.seconds_per_token)
                    for name, d in p.drafts.items()]),
        expected_tokens=[engine_pb2.ExpectedTokens(traffic_class=cls, draft=draft, by_k=curve)
                         for (cls, draft), curve in c.expected_tokens.items()],
        margin=c.margin,
    )


def composition_from_proto(msg: engine_pb2.Composition) -> Composition:
    """ValueError (naming what is wrong) for numbers that are not finite or curves and knots
    that do not line up."""
    p = msg.pricing
    pricing = StepPricing(
        p.base_seconds, p.seconds_per_sequence, p.seconds_per_token, tuple(p.knot_tokens),
        tuple(p.seconds_per_token_above),
        {d.draft: DraftPricing(d.fixed_seconds, d.seconds_per_pass, d.seconds_per_token)
         for d in p.drafts}, p.seconds_per_context_token, p.seconds_per_speculating_sequence,
        p.seconds_per_prefill_token)
    return Composition(pricing, {(e.traffic_class, e.draft): tuple(e.by_k)
                                 for e in msg.expected_tokens}, msg.margin)


# --- policies ----------------------------------------------------------------------------------
def policy_update_from_proto(msg: engine_pb2.PolicyUpdate) -> PolicyUpdate:
    """Never refuses the decisions: a composition that is not usable is left out, saying why."""
    composition, error = None, ""
    if msg.HasField("composition"):
        try:
            composition = composition_from_proto(msg.composition)
        except ValueError as exc:
            error = str(exc)
    cut = token_cut_from_proto(msg.cut) if msg.HasField("cut") else None
    return PolicyUpdate(
        version=msg.version,
        decisions=tuple(engine_decision_from_proto(d) for d in msg.decisions),
        default_decisions=tuple(engine_decision_from_proto(d) for d in msg.default_decisions),
        fail_static_timeout_seconds=msg.fail_static_timeout_seconds,
        composition=composition,
        composition_error=error,
        cut=cut,
    )


def token_cut_to_proto(cut: TokenCut) -> engine_pb2.TokenCut:
    return engine_pb2.TokenCut(
        min_survival=list(cut.min_survival),
        calibrations=[_mirror_to_proto(engine_pb2.CalibrationRows, c) for c in cut.calibrations],
        pass_tokens=list(cut.pass_tokens))


def token_cut_from_proto(msg: engine_pb2.TokenCut) -> TokenCut:
    return TokenCut(tuple(msg.min_survival),
                    tuple(_mirror_from_proto(CalibrationRows, c) for c in msg.calibrations),
                    tuple(msg.pass_tokens))


def controller_message_from_proto(msg: engine_pb2.ConnectResponse
                                  ) -> HelloAck | PolicyUpdate | ReportResult | None:
    """What the controller sent on an engine's stream, as its record (None: an empty message)."""
    kind = msg.WhichOneof("message")
    if kind == "hello_ack":
        return hello_ack_from_proto(msg.hello_ack)
    if kind == "policy":
        return policy_update_from_proto(msg.policy)
    if kind == "report_result":
        return report_result_from_proto(msg.report_result)
    return None
