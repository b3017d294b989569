"""The calibrated preset reproduces the published figures it is calibrated to (pure math on the
scenario's own cost model and acceptance)."""

from __future__ import annotations

from pathlib import Path

from benchmarks.sim.engine import SimEngine
from benchmarks.sim.scenario import load_scenario
from benchmarks.sim.truth import breakeven_acceptance, homogeneous_speedup

PRESET = Path(__file__).resolve().parents[2] / "benchmarks" / "scenarios" / "h100-70b-8b.yaml"


def test_h100_70b_8b_preset_matches_published_speedups() -> None:
    engine = SimEngine(load_scenario(PRESET))
    curves = engine.truth.expected_curves(0.0)
    classes = engine.info.classes
    code = homogeneous_speedup(engine.cost, curves[classes.index("code"), 0], 0, 4, 1)
    prose = homogeneous_speedup(engine.cost, curves[classes.index("boilerplate"), 0], 0, 4, 1)
    assert 1.3 <= code <= 1.5  # K=4 on code: ~1.4x
    assert 2.2 <= prose <= 2.4  # K=4 on boilerplate prose: ~2.3x
    # Speculation stops paying below ~0.55 acceptance at high load, and pays far lower at batch 1.
    assert 0.5 <= breakeven_acceptance(engine.cost, 0, 64, 8) <= 0.6
    assert breakeven_acceptance(engine.cost, 0, 1, 8) < 0.3
