"""The HTTP side's JSON is strict: a number that is not finite becomes null, never NaN."""

from __future__ import annotations

import json
from typing import Any

import pytest

from controller.server.views import json_dumps


def _strict(text: str) -> Any:
    def refuse(name: str) -> None:
        raise ValueError(f"not JSON: {name}")
    return json.loads(text, parse_constant=refuse)


def test_numbers_that_are_not_finite_are_written_as_null() -> None:
    data = {"a": float("nan"), "b": [float("inf"), 1.5, {"c": -float("inf")}], "d": "NaN"}
    assert _strict(json_dumps(data)) == {"a": None, "b": [None, 1.5, {"c": None}], "d": "NaN"}
    with pytest.raises(ValueError, match="not JSON"):  # the control: json.dumps alone
        _strict(json.dumps(data))
