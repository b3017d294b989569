"""The scenario format: the suite loads, the schema file is current, errors name the field."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from benchmarks.sim.scenario import (
    ScenarioError,
    load_scenario,
    parse_scenario,
    scenario_json_schema,
)
from tests.sim.conftest import scenario_data

SUITE = Path(__file__).resolve().parents[2] / "benchmarks" / "scenarios"


def test_every_suite_scenario_loads_and_covers_each_kind() -> None:
    scenarios = [load_scenario(p) for p in sorted(SUITE.glob("*.yaml"))]
    assert len(scenarios) >= 7
    assert {s.kind for s in scenarios} == {"stationary", "shifting", "no_gain"}
    for s in scenarios:
        assert s.name and s.description and s.duration_seconds > 0


def test_schema_file_is_generated_from_the_model() -> None:
    shipped = (SUITE / "scenario.schema.json").read_text(encoding="utf-8")
    assert shipped == scenario_json_schema(), (
        "benchmarks/scenarios/scenario.schema.json is stale: run "
        "`specpilot simulate --write-schema benchmarks/scenarios/scenario.schema.json`")
    schema = json.loads(shipped)
    assert "cost" in schema["required"] and "class" in json.dumps(schema)


@pytest.mark.parametrize(("change", "field"), [
    ({"cost": None}, "cost"),
    ({"classes": [dict(scenario_data()["classes"][0], acceptance={"small": 1.5, "ngram": 0.1})]},
     "classes.0.acceptance.small"),
    ({"classes": [dict(scenario_data()["classes"][0], acceptance={"small": 0.5})]}, "classes"),
    ({"load": [{"duration_seconds": 10, "concurrency": 2, "arrival_rate_per_second": 1}]},
     "load.0"),
    ({"load": [{"duration_seconds": 10, "concurrency": 2, "shares": {"nope": 1}}]},
     "load.0.shares"),
    ({"drift": [{"at_seconds": 1, "class": "easy", "draft": "big", "acceptance": 0.3}]},
     "drift.0.draft"),
    ({"drift": [{"at_seconds": 1, "class": "nope", "draft": "small", "acceptance": 0.3}]},
     "drift.0.class"),
    ({"engine": {"max_k": 0}}, "engine.max_k"),
    ({"engine": {"profile_scale": [0, 1]}}, "engine.profile_scale.0"),
    ({"surprise": 1}, "surprise"),
    ({"drafts": [{"name": "ngram", "kind": "ngram", "per_pass_ms": 1.0}]}, "drafts.0"),
])
def test_invalid_scenarios_name_the_field(change: dict[str, object], field: str) -> None:
    data = scenario_data(**change)
    data = {k: v for k, v in data.items() if v is not None}
    with pytest.raises(ScenarioError) as err:
        parse_scenario(data, "bad.yaml")
    assert str(err.value).startswith("bad.yaml: ")
    assert f" {field}" in str(err.value) or f": {field}" in str(err.value)


def test_file_errors_are_clear(tmp_path: Path) -> None:
    with pytest.raises(ScenarioError, match="cannot read"):
        load_scenario(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("classes: [\n", encoding="utf-8")
    with pytest.raises(ScenarioError, match="not valid YAML"):
        load_scenario(bad)
    bad.write_text("- 1\n", encoding="utf-8")
    with pytest.raises(ScenarioError, match="a scenario is a mapping"):
        load_scenario(bad)


def test_cli_rejects_a_bad_scenario_with_the_field(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    data = scenario_data()
    data["classes"][1]["share"] = -1
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    specpilot = str(Path(sys.executable).with_name("specpilot"))
    proc = subprocess.run([specpilot, "simulate", str(path), "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "classes.1.share" in proc.stderr
    assert not (tmp_path / "out").exists()
