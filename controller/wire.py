"""Protobuf <-> core dataclass conversion for the policy API and the controller's half of the
engine stream (what it builds from its own state: hello acks, policy updates); one function per
message and direction, nothing else. The engine stream's record converters, which the plugin
shares, are ``specpilot.contract.engine_stream``.

Conversion is structural only; validation stays in the core (``specpilot.contract.validation``), so
the server, the simulator and the tests reject the same things with the same reasons. The one
exception is what protobuf cannot express in a dataclass (an unset enum or oneof): that raises
``ReportRejected`` naming the field, like any other bad input.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple, cast

import numpy as np

from specpilot.contract.engine_stream import (
    composition_to_proto,
    decision_from_proto,
    decision_to_proto,
    figures_from_proto,
    figures_to_proto,
    token_cut_to_proto,
)
from specpilot.contract.records import (
    Decision,
    DecisionEvent,
    Override,
    OverrideScope,
)
from specpilot.controller.core.beta import credible_bounds
from specpilot.controller.core.engines import HelloOutcome
from specpilot.controller.core.policy import ArmValue
from specpilot.controller.core.recommend import Recommendation
from specpilot.controller.core.snapshot import (
    AcceptanceEstimate,
    ClassView,
    CoreSnapshot,
    Explanation,
)
from specpilot.v1 import common_pb2, engine_pb2, policy_pb2

if TYPE_CHECKING:
    pass

_SCOPE_TO_PROTO = {
    s: cast(policy_pb2.OverrideScope, policy_pb2.OverrideScope.Value(f"OVERRIDE_SCOPE_{s.name}"))
    for s in OverrideScope
}
_SCOPE_FROM_PROTO: dict[int, OverrideScope] = {v: s for s, v in _SCOPE_TO_PROTO.items()}


def scope_from_proto(value: int) -> OverrideScope | None:
    """None for OVERRIDE_SCOPE_UNSPECIFIED (the controller's default applies); ValueError naming
    the field for a value this controller does not know."""
    if value == policy_pb2.OVERRIDE_SCOPE_UNSPECIFIED:
        return None
    try:
        return _SCOPE_FROM_PROTO[value]
    except KeyError:
        raise ValueError(f"scope: override scope {value} is unknown") from None


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
        too_little_evidence=arm.too_little_evidence,
    )


def explanation_to_proto(ex: Explanation, text: str) -> policy_pb2.ExplainDecisionResponse:
    """``text``: the explanation in words, rendered at the edge (the core gives numbers)."""
    msg = policy_pb2.ExplainDecisionResponse(
        arms=[arm_to_proto(a) for a in ex.arms], text=text, batch_size=ex.batch_size)
    if ex.decision is not None:
        msg.decision.CopyFrom(decision_to_proto(ex.decision))
    return msg


# --- the read model (specpilot.controller.core.snapshot) ------------------------------------------
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
    if snap.cut is not None:
        msg.cut.CopyFrom(token_cut_to_proto(snap.cut))
    return msg


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
        verified_drafts=e.verified_drafts,
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
        measured_batch_buckets=snap.measured_buckets,
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
