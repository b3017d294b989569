"""Outputs of `specpilot simulate`: JSON, markdown tables with the targets, PNG plots."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.sim.report import suite_markdown, write_scenario, write_suite
from benchmarks.sim.run import simulate
from benchmarks.sim.scenario import parse_scenario
from tests.sim.conftest import scenario_data

PNG = b"\x89PNG\r\n\x1a\n"


def test_scenario_and_suite_outputs(tmp_path: Path) -> None:
    a = parse_scenario(scenario_data(name="a", kind="stationary"))
    b = parse_scenario(scenario_data(name="b", kind="no_gain",
                                     load=[{"duration_seconds": 20, "concurrency": 4}]))
    results = simulate([a, b], ["off", "static:2", "specpilot", "oracle"], seed=None, log=False)
    assert [r.name for r in results] == ["a", "b"]
    assert list(results[0].runs) == ["off", "static:2", "specpilot", "oracle"]

    written = write_scenario(results[0], tmp_path / "a", plots=True)
    data = json.loads((tmp_path / "a" / "result.json").read_text())
    assert data["runs"]["oracle"]["ratio_to_oracle"] == 1.0
    assert {c["check"].split(" ")[0] for c in data["checks"]} == {"specpilot"}
    table = (tmp_path / "a" / "table.md").read_text()
    assert "| `specpilot` |" in table and "of oracle >= 0.97" in table
    for png in (p for p in written if p.suffix == ".png"):
        assert png.read_bytes()[:8] == PNG

    write_suite(results, tmp_path, plots=True)
    suite = json.loads((tmp_path / "suite.json").read_text())
    assert suite["geomean_ratio_to_oracle"]["oracle"] == 1.0
    text = suite_markdown(results)
    assert "geomean" in text and "of off >= 0.99" in text  # the no_gain target applies to b
    assert "of the oracle on the geometric mean >= 0.99" in text
    assert "(kind stationary): first non-oracle policy" in text
    assert "(kind no_gain): first non-oracle policy" in text
    assert set(suite["geomean_ratio_to_oracle_by_kind"]) == {"stationary", "no_gain"}
    assert (tmp_path / "suite.png").read_bytes()[:8] == PNG


def test_seeds_are_pooled(tmp_path: Path) -> None:
    s = parse_scenario(scenario_data(load=[{"duration_seconds": 10, "concurrency": 2}]))
    one = [simulate([s], ["static:2"], seed=s.seed + j, log=False)[0].runs["static:2"]
           for j in range(2)]
    pooled = simulate([s], ["static:2"], seed=None, log=False, seeds=2)[0]
    run = pooled.runs["static:2"]
    assert pooled.seeds == 2
    assert run.tokens == one[0].tokens + one[1].tokens
    assert run.duration_seconds == 20
    assert run.throughput == (one[0].tokens + one[1].tokens) / 20
