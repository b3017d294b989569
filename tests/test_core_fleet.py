"""The fleet's sum of evidence: others only, decayed to a common time, departed sidecars out;
step costs only between engines of one type."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from specpilot.contract.records import AcceptanceRecord, EngineReport, StepTimingRecord
from specpilot.controller.core.controller import ControllerCore
from specpilot.controller.core.fleet import (
    EvidenceEntry,
    EvidenceExport,
    entries_of,
    fleet_costs,
    fleet_evidence,
)
from specpilot.controller.settings import core_config, load_settings
from tests.test_core_controller import HELLO


def _export(sidecar: str, at: float, accepts: float, rejects: float,
            cls: str = "code") -> EvidenceExport:
    return EvidenceExport(sidecar, at, (EvidenceEntry(cls, "d", (accepts, accepts / 2),
                                                      (rejects, rejects / 2)),))


def test_the_fleet_is_the_others_decayed_to_now() -> None:
    exports = [_export("me", 100.0, 50, 50), _export("a", 100.0, 80, 20),
               _export("b", 70.0, 40, 40)]
    got = fleet_evidence(exports, "me", now=100.0, half_life_seconds=30.0, max_age_seconds=300)
    a, r = got[("code", "d")]
    # "me" is left out; "b" is one half-life old, so it weighs half.
    assert a == pytest.approx([80 + 20, 40 + 10])
    assert r == pytest.approx([20 + 20, 10 + 10])


def test_a_sidecar_never_counts_its_own_export() -> None:
    """The control for double counting: the same exports seen by "a" hold "me" and not "a"."""
    exports = [_export("me", 100.0, 50, 50), _export("a", 100.0, 80, 20)]
    mine = fleet_evidence(exports, "me", 100.0, 30.0, 300)[("code", "d")][0]
    theirs = fleet_evidence(exports, "a", 100.0, 30.0, 300)[("code", "d")][0]
    assert mine[0] == 80 and theirs[0] == 50


def test_departed_sidecars_age_out_and_clock_skew_does_not_inflate() -> None:
    exports = [_export("old", 0.0, 1000, 0), _export("ahead", 110.0, 10, 10)]
    got = fleet_evidence(exports, "me", now=100.0, half_life_seconds=30.0, max_age_seconds=60)
    a, _ = got[("code", "d")]
    assert a[0] == 10  # "old" is past max_age; "ahead" (stamped in the future) counts as is


def test_entries_with_different_positions_add_up_position_by_position() -> None:
    short = EvidenceExport("a", 0.0, (EvidenceEntry("c", "d", (1.0,), (2.0,)),))
    long = EvidenceExport("b", 0.0, (EvidenceEntry("c", "d", (1.0, 3.0), (1.0, 1.0)),))
    a, r = fleet_evidence([short, long], "me", 0.0, 30.0, 300)[("c", "d")]
    assert a.tolist() == [2.0, 3.0] and r.tolist() == [3.0, 1.0]
    assert entries_of({("c", "d"): (a, r)}) == (EvidenceEntry("c", "d", (2.0, 3.0), (3.0, 1.0)),)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0])
def test_counts_that_are_not_finite_and_non_negative_are_refused(bad: float) -> None:
    with pytest.raises(ValueError, match="finite and >= 0"):
        EvidenceEntry("c", "d", (1.0, bad), (0.0, 0.0))
    with pytest.raises(ValueError, match="differ in length"):
        EvidenceEntry("c", "d", (1.0,), (0.0, 0.0))


# --- the core's side: export, fleet view, restore -------------------------------------------

def _core(seed: int = 0, hardware: str = "") -> ControllerCore:
    core = ControllerCore(core_config(load_settings()), np.random.default_rng(seed))
    core.connect_engine(replace(HELLO, hardware=hardware), now=0.0)
    return core


def _report(seq: int, hist: tuple[int, ...], cls: str = "code") -> EngineReport:
    return EngineReport(sequence=seq, interval_seconds=1.0, policy_version=0,
                        acceptance=(AcceptanceRecord(cls, "d", len(hist) - 1, hist),))


def _accepts(core: ControllerCore, now: float, cls: str = "code") -> np.ndarray:
    est = core.estimate(cls, "d", now)
    return np.array(est.alpha) - est.prior_alpha


def test_a_core_adds_the_fleets_evidence_to_its_own_and_exports_only_its_own() -> None:
    a, b = _core(), _core()
    a.ingest("e1", _report(1, (10, 20, 70)), now=1.0)  # position 1: 90 accepts of 100
    b.ingest("e1", _report(1, (50, 30, 20)), now=1.0)  # 50 of 100
    exports = [EvidenceExport("a", 1.0, a.export_evidence(1.0)),
               EvidenceExport("b", 1.0, b.export_evidence(1.0))]
    for me, core in (("a", a), ("b", b)):
        core.set_fleet_evidence(fleet_evidence(exports, me, 1.0, core.evidence_half_life,
                                               600.0), 1.0)
    # Both see the sum of the two sidecars' own, once; each exports only its own.
    assert _accepts(a, 1.0)[0] == pytest.approx(140) and _accepts(b, 1.0)[0] == pytest.approx(140)
    assert a.export_evidence(1.0)[0].accepts[0] == pytest.approx(90)
    # A second exchange replaces the fleet view instead of adding to it (the double-count
    # control: adding would give 190).
    a.set_fleet_evidence(fleet_evidence(exports, "a", 1.0, a.evidence_half_life, 600.0), 1.0)
    assert _accepts(a, 1.0)[0] == pytest.approx(140)


def test_a_class_known_only_to_the_fleet_starts_from_its_evidence() -> None:
    veteran, newcomer = _core(), _core()
    for seq in range(1, 11):
        veteran.ingest("e1", _report(seq, (5, 5, 90)), now=float(seq))
    export = EvidenceExport("veteran", 10.0, veteran.export_evidence(10.0))
    newcomer.set_fleet_evidence(fleet_evidence([export], "new", 10.0,
                                               newcomer.evidence_half_life, 600.0), 10.0)
    est = newcomer.estimate("code", "d", 10.0)
    assert est.has_evidence and est.mean[0] > 0.9
    # Its own export stays empty: the fleet's evidence is never re-published as its own.
    assert newcomer.export_evidence(10.0) == ()


def test_a_restarted_core_takes_its_flushed_evidence_back_as_its_own() -> None:
    before = _core()
    for seq in range(1, 6):
        before.ingest("e1", _report(seq, (10, 20, 70), cls=f"c{seq % 2}"), now=float(seq))
    flushed = before.export_evidence(5.0)
    after = _core()
    after.restore_evidence(flushed, at=5.0, now=5.0 + after.evidence_half_life)
    # One half-life later: half of what was flushed, held as its own (exported again).
    want = np.array(before.export_evidence(5.0)[0].accepts) / 2
    assert np.allclose(after.export_evidence(5.0 + after.evidence_half_life)[0].accepts, want)
    assert {c.name for c in after.snapshot(6.0).classes} >= {"c0", "c1"}


# --- step costs: shared within one engine type ------------------------------------------------

GPU = "NVIDIA H100 80GB HBM3 tp1 pp1 bfloat16"


def _timed(core: ControllerCore, reports: int = 30) -> None:
    """Steps three times slower than the generic prior's, at every K and two loads."""
    shapes = [(bucket, batch, k) for bucket, batch in ((0, 1), (4, 16)) for k in (0, 2, 4)]
    true = {s: 3 * core.predicted_step_seconds(s[1], "d", s[2]) for s in shapes}
    for seq in range(1, reports + 1):
        timings = tuple(
            StepTimingRecord(bucket, "d" if k else "", k, 100, 100 * batch,
                             100 * batch * (1 + k), 100 * batch * k,
                             100 * true[bucket, batch, k])
            for bucket, batch, k in shapes)
        core.ingest("e1", EngineReport(sequence=seq, interval_seconds=1.0, policy_version=0,
                                       step_timings=timings), now=float(seq))


def test_a_core_prices_steps_from_the_fleet_of_its_engine_type_only() -> None:
    veteran = _core(hardware=GPU)
    prior = veteran.predicted_step_seconds(16, "d", 4)
    _timed(veteran)
    learnt = veteran.predicted_step_seconds(16, "d", 4)
    assert learnt > 2 * prior  # it learnt this hardware
    shared = veteran.export_costs("veteran", 30.0)
    assert shared is not None
    exports = [shared]
    for hardware, peers in ((GPU, 1), ("NVIDIA L4 tp1 pp1 bfloat16", 0)):
        newcomer = _core(hardware=hardware)
        assert newcomer.set_fleet_costs(exports, "new", 30.0, 600.0) == peers
        got = newcomer.predicted_step_seconds(16, "d", 4)
        assert got == pytest.approx(learnt if peers else prior, rel=0.02)
        # Its own export stays empty: the fleet's evidence is never re-published as its own.
        assert newcomer.export_costs("new", 30.0).evidence.steps == 0  # type: ignore[union-attr]
    # An engine from an older plugin names no hardware: nothing to share, nothing taken.
    unknown = _core()
    assert unknown.export_costs("old", 30.0) is None
    assert unknown.set_fleet_costs(exports, "old", 30.0, 600.0) == 0


def test_fleet_costs_skip_this_sidecar_departed_ones_and_other_drafts() -> None:
    veteran = _core(hardware=GPU)
    _timed(veteran, reports=5)
    ev = veteran.export_costs("a", 5.0)
    assert ev is not None
    mine = replace(ev, sidecar="me")
    old = replace(ev, sidecar="old", at=5.0 - 700.0)
    drafts, knots = ev.evidence.drafts, ev.evidence.knots
    total, count = fleet_costs([ev, mine, old], "me", GPU, drafts, knots, 5.0, 600.0)
    assert count == 1 and total is not None and total.steps == pytest.approx(ev.evidence.steps)
    assert fleet_costs([ev], "me", GPU, ("other",), knots, 5.0, 600.0) == (None, 0)
    # Not discounted by age: a sidecar's step costs are its hardware's while it is not departed.
    later, _ = fleet_costs([ev], "me", GPU, drafts, knots, 605.0, 1e9)
    assert later is not None and later.steps == pytest.approx(ev.evidence.steps)


def test_a_restarted_core_takes_its_flushed_costs_back_but_not_another_hardwares() -> None:
    before = _core(hardware=GPU)
    _timed(before)
    flushed = before.export_costs("a", 30.0)
    assert flushed is not None
    after = _core(hardware=GPU)
    assert after.restore_costs(flushed)
    assert after.predicted_step_seconds(16, "d", 4) == pytest.approx(
        before.predicted_step_seconds(16, "d", 4), rel=0.02)
    moved = _core(hardware="NVIDIA L4 tp1 pp1 bfloat16")  # same id, rescheduled elsewhere
    assert not moved.restore_costs(flushed)
