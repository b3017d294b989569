"""Protobuf <-> core dataclass conversion: one function per message and direction, nothing else.

Conversion is structural only; validation stays in the core (``specpilot.contract.validation``), so
the server, the simulator and the tests reject the same things with the same reasons. The one
exception is what protobuf cannot express in a dataclass (an unset enum or oneof): that raises
``ReportRejected`` naming the field, like any other bad input.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple, TypeVar, cast

import numpy as np
from google.protobuf.message import Message

from controller.core.beta import credible_bounds
from controller.core.engines import HelloOutcome
from controller.core.policy import ArmValue
from controller.core.recommend import Recommendation
from controller.core.snapshot import AcceptanceEstimate, ClassView, CoreSnapshot, Explanation
from specpilot.contract.pricing import Composition, DraftPricing, StepPricing
from specpilot.contract.records import (
    AcceptanceRecord,
    ArmFigures,
    Decision,
    DecisionEvent,
    DecisionFigures,
    DraftKind,
    DraftSpec,
    EngineHello,
    EngineReport,
    Override,
    OverrideScope,
    Reason,
    ReportRejected,
    RequestSummaryRecord,
    StepProfile,
    StepTimingRecord,
)
from specpilot.v1 import common_pb2, engine_pb2, policy_pb2

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
_SCOPE_TO_PROTO = {
    s: cast(policy_pb2.OverrideScope, policy_pb2.OverrideScope.Value(f"OVERRIDE_SCOPE_{s.name}"))
    for s in OverrideScope
}
_SCOPE_FROM_PROTO: dict[int, OverrideScope] = {v: s for s, v in _SCOPE_TO_PROTO.items()}


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


def scope_from_proto(value: int) -> OverrideScope | None:
    """None for OVERRIDE_SCOPE_UNSPECIFIED (the controller's default applies); ValueError naming
    the field for a value this controller does not know."""
    if value == policy_pb2.OVERRIDE_SCOPE_UNSPECIFIED:
        return None
    try:
        return _SCOPE_FROM_PROTO[value]
    except KeyError:
        raise ValueError(f"scope: override scope {value} is unknown") from None


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
            StepProfile(p.batch_size, p.verified_tokens, p.draft, p.draft_passes, p.seconds)
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
                                   draft=p.draft, draft_passes=p.draft_passes, seconds=p.seconds)
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
    )


def hello_ack_to_proto(
    outcome: HelloOutcome,
    *,
    controller_version: str,
    report_interval_seconds: float,
    batch_bucket_upper_bounds: tuple[int, ...],
    max_classes: int,
    policy_epoch: int,
) -> engine_pb2.HelloAck:
    return engine_pb2.HelloAck(
        controller_version=controller_version,
        accepted_drafts=outcome.accepted_drafts,
        rejected_drafts=[engine_pb2.RejectedDraft(name=n, reason=r)
                         for n, r in outcome.rejected_drafts],
        report_interval_seconds=report_interval_seconds,
        batch_bucket_upper_bounds=batch_bucket_upper_bounds,
        max_classes=max_classes,
        policy_epoch=policy_epoch,
    )


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
    )


def event_to_proto(e: DecisionEvent) -> common_pb2.DecisionEvent:
    previous = e.previous
    return common_pb2.DecisionEvent(
        policy_version=e.policy_version,
        unix_seconds=e.at,
        decision=decision_to_proto(e.decision),
        previous_draft=previous.draft if previous is not None and previous.k else "",
        previous_k=previous.k if previous is not None else None,
        figures=None if e.figures is None else figures_to_proto(e.figures),
    )


def event_from_proto(msg: common_pb2.DecisionEvent) -> DecisionEvent:
    """Only the previous arm travels: the previous decision comes back with the new one's
    class, bucket and reason and no estimate of its own (what a decision line names of it)."""
    d = decision_from_proto(msg.decision)
    previous = (Decision(d.traffic_class, d.bucket, msg.previous_draft, msg.previous_k,
                         d.reason) if msg.HasField("previous_k") else None)
    return DecisionEvent(msg.policy_version, msg.unix_seconds, d, previous,
                         figures_from_proto(msg.figures) if msg.HasField("figures") else None)


def arm_figures_to_proto(f: ArmFigures) -> common_pb2.ArmFigures:
    mean, half_width = f.acceptance if f.acceptance is not None else (None, None)
    return common_pb2.ArmFigures(
        draft=f.draft, k=f.k, expected_tokens=f.expected_tokens,
        goodput_tokens_per_second=f.goodput, speedup=f.speedup,
        acceptance_mean=mean, acceptance_half_width=half_width)


def arm_figures_from_proto(msg: common_pb2.ArmFigures) -> ArmFigures:
    acceptance = ((msg.acceptance_mean, msg.acceptance_half_width)
                  if msg.HasField("acceptance_mean") else None)
    return ArmFigures(msg.draft, msg.k, msg.expected_tokens, msg.goodput_tokens_per_second,
                      msg.speedup, acceptance)


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


# --- policy API ----------------------------------------------------------------------------
def override_from_proto(msg: policy_pb2.Override) -> Override:
    """Raises ValueError naming the field when no action is set (or the core rejects it)."""
    action = msg.WhichOneof("action")
    if action is None:
        raise ValueError("override.action: set one of pin_k, force_draft, force_off")
    if action == "force_off" and not msg.force_off:
        raise ValueError("override.force_off: must be true when it is the action")
    return Override(
        traffic_class=msg.traffic_class,
        pin_k=msg.pin_k if action == "pin_k" else None,
        force_draft=msg.force_draft if action == "force_draft" else None,
        force_off=action == "force_off",
        note=msg.note,
        set_at=msg.set_unix_seconds,
        scope=scope_from_proto(msg.scope) or OverrideScope.POD,
        set_by=msg.set_by,
    )


def override_to_proto(ov: Override) -> policy_pb2.Override:
    msg = policy_pb2.Override(traffic_class=ov.traffic_class, note=ov.note,
                              set_unix_seconds=ov.set_at, scope=_SCOPE_TO_PROTO[ov.scope],
                              set_by=ov.set_by)
    if ov.pin_k is not None:
        msg.pin_k = ov.pin_k
    elif ov.force_draft is not None:
        msg.force_draft = ov.force_draft
    else:
        msg.force_off = True
    return msg


def arm_to_proto(arm: ArmValue) -> policy_pb2.ArmScore:
    return policy_pb2.ArmScore(
        draft=arm.draft,
        k=arm.k,
        expected_tokens=arm.expected_tokens,
        step_seconds=arm.step_seconds,
        goodput_tokens_per_second=arm.goodput,
        speedup=arm.speedup,
    )


def explanation_to_proto(ex: Explanation, text: str) -> policy_pb2.ExplainDecisionResponse:
    """``text``: the explanation in words, rendered at the edge (the core gives numbers)."""
    msg = policy_pb2.ExplainDecisionResponse(
        arms=[arm_to_proto(a) for a in ex.arms], text=text, batch_size=ex.batch_size)
    if ex.decision is not None:
        msg.decision.CopyFrom(decision_to_proto(ex.decision))
    return msg


# --- the read model (controller.core.snapshot) ------------------------------------------------
def policy_update_to_proto(
    snap: CoreSnapshot, fail_static_timeout_seconds: float
) -> engine_pb2.PolicyUpdate:
    """Everything an engine applies: every (class, bucket) decision plus the defaults, and the
    per-step pricing where engines can use it."""
    msg = engine_pb2.PolicyUpdate(
        version=snap.version,
        decisions=[decision_to_proto(d) for c in snap.classes for d in c.decisions],
        default_decisions=[decision_to_proto(d) for d in snap.default_decisions],
        fail_static_timeout_seconds=fail_static_timeout_seconds,
    )
    if snap.composition is not None:
        msg.composition.CopyFrom(composition_to_proto(snap.composition))
    return msg


def composition_to_proto(c: Composition) -> engine_pb2.Composition:
    p = c.pricing
    return engine_pb2.Composition(
        pricing=engine_pb2.StepPricing(
            base_seconds=p.base_seconds, seconds_per_sequence=p.seconds_per_sequence,
            seconds_per_token=p.seconds_per_token, knot_tokens=p.knot_tokens,
            seconds_per_token_above=p.seconds_per_token_above,
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
         for d in p.drafts})
    return Composition(pricing, {(e.traffic_class, e.draft): tuple(e.by_k)
                                 for e in msg.expected_tokens}, msg.margin)


class EstimateValues(NamedTuple):
    """What a DraftEstimate reports of one estimate, by shown position (plain floats): the
    figures of its ``mean``, ``credible_interval``, ``effective_tries`` and
    ``expected_tokens``."""

    mean: list[float]
    lower: list[float]
    upper: list[float]
    effective_tries: list[float]
    expected_tokens: list[float]  # for K = 0..positions


def estimates_values(estimates: Sequence[AcceptanceEstimate], credible_level: float
                     ) -> list[EstimateValues]:
    """``EstimateValues`` of every estimate, each figure computed for all of them in one
    vectorised pass (one pass per estimate took seconds at 256 classes x 16 drafts)."""
    if not estimates:
        return []
    sizes = np.array([e.positions for e in estimates])
    total = int(sizes.sum())
    alpha = np.fromiter((x for e in estimates for x in e.alpha[:e.positions]), np.float64, total)
    beta = np.fromiter((x for e in estimates for x in e.beta[:e.positions]), np.float64, total)
    prior = np.repeat([e.prior_alpha + e.prior_beta for e in estimates], sizes)
    mean = alpha / (alpha + beta)
    lower, upper = credible_bounds(alpha, beta, credible_level)
    # E(K) by row: expected_tokens_curve of each estimate's means (the same sequential
    # products and sums, so the same figures), rows padded with zeros past their positions.
    starts = np.concatenate(([0], np.cumsum(sizes)))
    rows = np.repeat(np.arange(len(estimates)), sizes)
    padded = np.zeros((len(estimates), max(int(sizes.max()), 1)))
    padded[rows, np.arange(total) - starts[rows]] = mean
    curves = (1.0 + np.cumsum(np.cumprod(padded, axis=1), axis=1)).tolist()
    columns = [mean.tolist(), lower.tolist(), upper.tolist(), (alpha + beta - prior).tolist()]
    out = []
    for i, (a, b) in enumerate(zip(starts[:-1].tolist(), starts[1:].tolist(), strict=True)):
        m, lo, hi, t = (c[a:b] for c in columns)
        out.append(EstimateValues(m, lo, hi, t, [1.0, *curves[i][:b - a]]))
    return out


def estimate_to_proto(e: AcceptanceEstimate, credible_level: float,
                      values: EstimateValues | None = None) -> policy_pb2.DraftEstimate:
    """``values``: its figures, where the caller computed them for many estimates at once
    (``estimates_values``)."""
    v = values if values is not None else estimates_values([e], credible_level)[0]
    return policy_pb2.DraftEstimate(
        draft=e.draft,
        positions=[policy_pb2.PositionEstimate(position=i + 1, mean=m, lower=lo, upper=hi,
                                               effective_tries=t)
                   for i, (m, lo, hi, t) in enumerate(zip(
                       v.mean, v.lower, v.upper, v.effective_tries, strict=True))],
        expected_tokens=v.expected_tokens,
        changes_detected=e.changes_detected,
    )


def class_view_to_proto(c: ClassView, credible_level: float,
                        values: Sequence[EstimateValues] | None = None
                        ) -> policy_pb2.ClassPolicy:
    """``values``: the figures of its estimates, in order (``estimates_values``), where the
    caller computed them for many classes at once."""
    if values is None:
        values = estimates_values(c.estimates, credible_level)
    return policy_pb2.ClassPolicy(
        traffic_class=c.name,
        decisions=[decision_to_proto(d) for d in c.decisions],
        estimates=[estimate_to_proto(e, credible_level, v)
                   for e, v in zip(c.estimates, values, strict=True)],
        overrides=[override_to_proto(o) for o in c.overrides],
        offline=c.offline,
        batch_share=c.share,
        measured_tokens_per_step=c.measured_tokens_per_step,
        measured_speedup=c.measured_speedup,
    )


def policy_response_to_proto(snap: CoreSnapshot, classes: tuple[ClassView, ...],
                             credible_level: float) -> policy_pb2.GetPolicyResponse:
    """The policy of ``classes`` (of ``snap``) and the estimates behind it (their figures from
    one vectorised pass)."""
    values = estimates_values([e for c in classes for e in c.estimates], credible_level)
    starts = np.cumsum([0] + [len(c.estimates) for c in classes]).tolist()
    return policy_pb2.GetPolicyResponse(
        version=snap.version,
        batch_bucket_upper_bounds=snap.batch_bucket_upper_bounds,
        classes=[class_view_to_proto(c, credible_level, values[start:end])
                 for c, start, end in zip(classes, starts, starts[1:], strict=False)],
        engines=[e.engine_id for e in snap.engines],
        engine_status=[policy_pb2.EngineStatus(
            engine_id=e.engine_id, model=e.model, running_requests=e.running_requests,
            report_age_seconds=e.report_age_seconds,
            policy_version_applied=e.policy_version_applied, hardware=e.hardware,
            versions_behind=e.versions_behind)
            for e in snap.engines],
    )


def recommendations_to_proto(recs: Sequence[Recommendation], traffic_class: str,
                             at: float) -> policy_pb2.GetRecommendationsResponse:
    """All classes' recommendations (or one's: empty name for all)."""
    return policy_pb2.GetRecommendationsResponse(computed_unix_seconds=at, classes=[
        policy_pb2.ClassRecommendation(
            traffic_class=r.traffic_class, batch_bucket=r.batch_bucket, batch_size=r.batch_size,
            draft=r.draft, pool=r.pool, options=[
                policy_pb2.RecommendedOption(
                    pool=o.pool, draft=o.draft, k=o.k, goodput_tokens_per_second=o.goodput,
                    tries=o.tries, sidecars=o.sidecars, cost_steps=o.cost_steps)
                for o in r.options])
        for r in recs if not traffic_class or r.traffic_class == traffic_class])
