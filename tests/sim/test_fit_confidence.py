"""Fitting the simulator's per-token confidence to a real drafter's bucket figures."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from benchmarks.sim.fit_confidence import BucketFigures, distance, fit, main, simulated
from benchmarks.sim.scenario import ConfidenceSpec


def test_the_fit_finds_the_spec_that_drew_the_figures() -> None:
    truth = ConfidenceSpec(concentration=2.0, bias=-0.5, noise=1.0)
    measured = simulated(truth, 0.3, draws=20_000, seed=1)  # another seed than the fit's
    got, d = fit(measured, draws=5_000)
    assert d < 0.002
    assert got.concentration in (1.5, 2.0, 3.0)
    assert abs(got.bias - truth.bias) <= 0.5 and abs(got.noise - truth.noise) <= 0.5
    # The control: a spec far from the truth lies far from its figures.
    far = ConfidenceSpec(concentration=16.0, bias=2.0, noise=0.0)
    assert distance(simulated(far, 0.3, draws=5_000), measured) > 20 * d


def test_measured_figures_are_shares_and_their_mean_is_token_weighted() -> None:
    m = BucketFigures.measured([3, 1, 0, 0, 0, 0, 0, 0], [0.1, 0.5, None, None, 0, 0, 0, 0])
    assert m.share[:2] == pytest.approx([0.75, 0.25])
    assert np.isnan(m.accept[2]) and np.isnan(m.accept[4])  # no tokens: nothing observed
    assert m.mean_accept == pytest.approx(0.2)
    with pytest.raises(ValueError, match="nothing to fit"):
        BucketFigures.measured([0] * 8, [None] * 8)
    with pytest.raises(ValueError, match="8 counts"):
        BucketFigures.measured([1, 2], [0.1, 0.2])


def test_the_command_reads_a_reliability_run_and_says_what_to_do_with_another_file(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "other.json"
    bad.write_text("{}")
    with pytest.raises(SystemExit):
        main([str(bad)])
    assert "benchmarks/reliability.py" in capsys.readouterr().err
