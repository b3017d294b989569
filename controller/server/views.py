"""Read-side views of the core's snapshot as protobuf messages (and their JSON).

The engine stream, the policy API and the HTTP JSON all render one ``CoreSnapshot`` through these
functions and the converters in ``controller.wire``, so the three never disagree about what the
policy is.
"""

from __future__ import annotations

from typing import Any

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
