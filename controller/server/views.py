"""Read-side views of the core's snapshot as protobuf messages (and their JSON).

The engine stream, the policy API and the HTTP JSON all render one ``CoreSnapshot`` through these
functions and the converters in ``specpilot.controller.wire``, so the three never disagree about
what the policy is.
"""

from __future__ import annotations

import dataclasses
import json
import math
from itertools import islice
from typing import Any

from aiohttp import web
from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message

from specpilot.controller.core.acceptance import CREDIBLE_LEVEL
from specpilot.controller.core.snapshot import AcceptanceEstimate, CoreSnapshot
from specpilot.controller.wire import EstimateValues, estimates_values, policy_response_to_proto
from specpilot.v1 import policy_pb2


def policy_response(snap: CoreSnapshot, traffic_class: str = "") -> policy_pb2.GetPolicyResponse:
    """The policy and its estimates, for one class or (empty name) all. KeyError if unknown."""
    classes = (snap.class_view(traffic_class),) if traffic_class else snap.classes
    return policy_response_to_proto(snap, classes, CREDIBLE_LEVEL)


def policy_json(snap: CoreSnapshot, traffic_class: str = "") -> dict[str, Any]:
    """``to_json_dict(policy_response(snap, traffic_class))``, the same dict, built without
    the generic converter for the estimates (4,000 of them at 256 classes x 16 drafts took it
    a quarter of a second): they are written from the same figures (``estimates_values``) as
    the protobuf JSON mapping writes them (tests/test_views.py compares the two). KeyError if
    the class is unknown."""
    classes = (snap.class_view(traffic_class),) if traffic_class else snap.classes
    estimates = [e for c in classes for e in c.estimates]
    values = estimates_values(estimates, CREDIBLE_LEVEL)
    # (A sum of finite figures that overflows only takes the exact path below.)
    if not math.isfinite(sum(sum(column) for v in values for column in v)):
        # The mapping writes "NaN" and "Infinity" as strings: leave those to it (the core
        # never makes one).
        return to_json_dict(policy_response(snap, traffic_class))
    # Each class with at most one estimate for the mapping to place (so its keys come in the
    # mapping's order); the list is then written whole.
    bare = tuple(dataclasses.replace(c, estimates=c.estimates[:1]) for c in classes)
    out = to_json_dict(policy_response_to_proto(snap, bare, CREDIBLE_LEVEL))
    rows = iter(zip(estimates, values, strict=True))
    for c, rendered in zip(classes, out["classes"], strict=True):
        rendered["estimates"] = [_estimate_json(e, v) for e, v in islice(rows, len(c.estimates))]
    return out


def _estimate_json(e: AcceptanceEstimate, v: EstimateValues) -> dict[str, Any]:
    """A DraftEstimate as the protobuf JSON mapping writes it (field names as in the .proto,
    every field, uint64 as a string)."""
    return {
        "draft": e.draft,
        "positions": [{"position": i + 1, "mean": m, "lower": lo, "upper": hi,
                       "effective_tries": t}
                      for i, (m, lo, hi, t) in enumerate(zip(
                          v.mean, v.lower, v.upper, v.effective_tries, strict=True))],
        "expected_tokens": v.expected_tokens,
        "changes_detected": str(e.changes_detected),
        "verified_drafts": list(e.verified_drafts),
    }


def to_json_dict(msg: Message) -> dict[str, Any]:
    """The protobuf JSON mapping with the .proto's field names and zero values included (K = 0 is
    a decision, not a missing field)."""
    return MessageToDict(msg, preserving_proto_field_name=True,
                         always_print_fields_with_no_presence=True)


def _finite(value: Any) -> Any:
    """``value`` with every float that is not finite replaced by None (JSON has no NaN)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def json_dumps(data: Any) -> str:
    """Strict JSON: a number that is not finite (the core never makes one; this is the last
    guard) is written as null instead of the invalid ``NaN``."""
    try:
        return json.dumps(data, allow_nan=False)
    except ValueError:
        return json.dumps(_finite(data), allow_nan=False)


def json_response(data: Any, status: int = 200,
                  headers: dict[str, str] | None = None) -> web.Response:
    """Every JSON answer of the HTTP side goes through ``json_dumps``."""
    return web.json_response(data, status=status, headers=headers, dumps=json_dumps)
