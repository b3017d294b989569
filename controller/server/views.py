"""Read-side views of the core's snapshot as protobuf messages (and their JSON).

The engine stream, the policy API and the HTTP JSON all render one ``CoreSnapshot`` through these
functions and the converters in ``controller.wire``, so the three never disagree about what the
policy is.
"""

from __future__ import annotations

import json
import math
from typing import Any

from aiohttp import web
from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message

from controller.core.snapshot import CoreSnapshot
from controller.wire import policy_response_to_proto
from specpilot.v1 import policy_pb2

# Width of the credible interval reported per position.
CREDIBLE_LEVEL = 0.9


def policy_response(snap: CoreSnapshot, traffic_class: str = "") -> policy_pb2.GetPolicyResponse:
    """The policy and its estimates, for one class or (empty name) all. KeyError if unknown."""
    classes = (snap.class_view(traffic_class),) if traffic_class else snap.classes
    return policy_response_to_proto(snap, classes, CREDIBLE_LEVEL)


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
