"""The HTTP side's JSON is strict: a number that is not finite becomes null, never NaN."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from specpilot.controller.server.views import json_dumps, policy_json, policy_response, to_json_dict
from tests.test_wire import _read_model


def _strict(text: str) -> Any:
    def refuse(name: str) -> None:
        raise ValueError(f"not JSON: {name}")
    return json.loads(text, parse_constant=refuse)


def test_numbers_that_are_not_finite_are_written_as_null() -> None:
    data = {"a": float("nan"), "b": [float("inf"), 1.5, {"c": -float("inf")}], "d": "NaN"}
    assert _strict(json_dumps(data)) == {"a": None, "b": [None, 1.5, {"c": None}], "d": "NaN"}
    with pytest.raises(ValueError, match="not JSON"):  # the control: json.dumps alone
        _strict(json.dumps(data))


def test_the_policy_json_is_the_protobuf_mapping_of_get_policy() -> None:
    """The dashboard's and /api/policy's JSON, written without the generic converter for the
    estimates, is exactly the mapping of GetPolicy's message: all classes, one class, and a
    figure that is not finite (left to the mapping, which writes "NaN")."""
    snap = _read_model()
    assert policy_json(snap) == to_json_dict(policy_response(snap))
    assert json_dumps(policy_json(snap)) == json_dumps(to_json_dict(policy_response(snap)))
    assert policy_json(snap, "code") == to_json_dict(policy_response(snap, "code"))
    with pytest.raises(KeyError):
        policy_json(snap, "unknown")
    c = snap.classes[0]
    odd = dataclasses.replace(c.estimates[0], alpha=(float("nan"),) * len(c.estimates[0].alpha))
    broken = dataclasses.replace(snap, classes=(dataclasses.replace(
        c, estimates=(odd, *c.estimates[1:])), *snap.classes[1:]))
    mapped = policy_json(broken)
    assert mapped == to_json_dict(policy_response(broken))
    assert mapped["classes"][0]["estimates"][0]["positions"][0]["mean"] == "NaN"
    # The control: the figures differ from the first snapshot's, so equality is not vacuous.
    assert mapped != policy_json(snap)
