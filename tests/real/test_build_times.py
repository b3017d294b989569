"""A first build's log says how long each step took (``benchmarks.real.fetch.timed``)."""

from __future__ import annotations

import pytest

from benchmarks.real.fetch import duration_text, timed


def test_durations_read_as_seconds_then_minutes() -> None:
    assert duration_text(0.4) == "0 s"
    assert duration_text(42.4) == "42 s"
    assert duration_text(185) == "3 min 05 s"


def test_a_step_prints_its_time_when_it_ends_and_only_with_progress(
        capsys: pytest.CaptureFixture[str]) -> None:
    with timed("convert"):
        pass
    assert capsys.readouterr().err == "[specpilot models] convert: 0 s\n"
    with timed("convert", progress=False):
        pass
    assert capsys.readouterr().err == ""
