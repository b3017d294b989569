"""Read-side snapshots of the core as protobuf messages.

The engine stream, the policy API and the HTTP JSON all render the core through these functions,
so the three never disagree about what the policy is.
"""

from __future__ import annotations

from typing import Any

from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message

from controller.core.controller import ControllerCore
from controller.core.goodput import expected_tokens_curve
from controller.core.types import ALL_CLASSES
from controller.wire import decision_to_proto, override_to_proto
from specpilot.v1 import engine_pb2, policy_pb2

# Width of the credible interval reported per position.
CREDIBLE_LEVEL = 0.9


def policy_update(
    core: ControllerCore, fail_static_timeout_seconds: float
) -> engine_pb2.PolicyUpdate:
    """Everything an engine applies: every (class, bucket) decision plus the defaults."""
    decisions = [
        decision_to_proto(d)
        for name in sorted(core.classes)
        for _, d in sorted(core.classes[name].decisions.items())
    ]
    return engine_pb2.PolicyUpdate(
        version=core.version,
        decisions=decisions,
        default_decisions=[decision_to_proto(d) for d in core.default_decisions()],
        fail_static_timeout_seconds=fail_static_timeout_seconds,
    )


def _draft_estimates(core: ControllerCore, name: str, now: float) -> list[policy_pb2.DraftEstimate]:
    # Drafts of connected engines, plus any the class has evidence for from earlier engines.
    max_k = {d.name: d.max_k for d in core.drafts()}
    with_evidence = core.estimator.keys()
    for cls, draft in with_evidence:
        if cls == name:
            max_k.setdefault(draft, core.config.estimator.max_k)
    out = []
    for draft, k in max_k.items():
        post = core.estimator.posterior(name, draft, now)
        lower, upper = post.credible_interval(CREDIBLE_LEVEL)
        mean, tries = post.mean[:k], post.effective_tries[:k]
        positions = [
            policy_pb2.PositionEstimate(position=i + 1, mean=float(mean[i]),
                                        lower=float(lower[i]), upper=float(upper[i]),
                                        effective_tries=float(tries[i]))
            for i in range(k)
        ]
        out.append(policy_pb2.DraftEstimate(
            draft=draft,
            positions=positions,
            expected_tokens=expected_tokens_curve(mean).tolist(),
            changes_detected=core.estimator.changes_detected(name, draft),
        ))
    return out


def class_policy(core: ControllerCore, name: str, now: float) -> policy_pb2.ClassPolicy:
    state = core.classes[name]
    overrides = [core.overrides[c] for c in (name, ALL_CLASSES) if c in core.overrides]
    return policy_pb2.ClassPolicy(
        traffic_class=name,
        decisions=[decision_to_proto(d) for _, d in sorted(state.decisions.items())],
        estimates=_draft_estimates(core, name, now),
        overrides=[override_to_proto(o) for o in overrides],
        offline=name in core.config.offline_classes,
    )


def policy_response(
    core: ControllerCore, now: float, traffic_class: str = ""
) -> policy_pb2.GetPolicyResponse:
    """The policy and its estimates, for one class or (empty name) all. KeyError if unknown."""
    if traffic_class and traffic_class not in core.classes:
        raise KeyError(f"unknown class {traffic_class!r}")
    names = [traffic_class] if traffic_class else sorted(core.classes)
    return policy_pb2.GetPolicyResponse(
        version=core.version,
        batch_bucket_upper_bounds=core.config.batch_bucket_upper_bounds,
        classes=[class_policy(core, n, now) for n in names],
        engines=sorted(core.engines),
    )


def to_json_dict(msg: Message) -> dict[str, Any]:
    """The protobuf JSON mapping with the .proto's field names and zero values included (K = 0 is
    a decision, not a missing field)."""
    return MessageToDict(msg, preserving_proto_field_name=True,
                         always_print_fields_with_no_presence=True)
