"""The fleet's sum of evidence: others only, decayed to a common time, departed sidecars out."""

from __future__ import annotations

import numpy as np
import pytest

from controller.core.controller import ControllerCore
from controller.core.fleet import EvidenceEntry, EvidenceExport, entries_of, fleet_evidence
from controller.core.types import AcceptanceRecord, EngineReport
from controller.settings import core_config, load_settings
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

def _core(seed: int = 0) -> ControllerCore:
    core = ControllerCore(core_config(load_settings()), np.random.default_rng(seed))
    core.connect_engine(HELLO, now=0.0)
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
