"""What this controller gives the fleet of one model and takes from it
(``specpilot.controller.core.fleet``): its own acceptance and step-cost evidence, exported and
restored after a restart, and the other sidecars' evidence added to its posteriors.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from specpilot.contract.records import OTHER_CLASS
from specpilot.contract.validation import check_class_name
from specpilot.controller.core.class_table import ClassTable
from specpilot.controller.core.config import CoreConfig
from specpilot.controller.core.engines import EngineRegistry
from specpilot.controller.core.evidence import Evidence
from specpilot.controller.core.fleet import (
    CostExport,
    EvidenceEntry,
    EvidenceKey,
    FloatArray,
    add_evidence,
    entries_of,
    fleet_costs,
)


class FleetExchange:
    def __init__(self, config: CoreConfig, engines: EngineRegistry, classes: ClassTable,
                 evidence: Evidence) -> None:
        self._config = config
        self._engines = engines
        self._classes = classes
        self._evidence = evidence

    def export_evidence(self, now: float) -> tuple[EvidenceEntry, ...]:
        """This controller's own acceptance evidence, decayed to ``now`` (never the fleet's)."""
        return entries_of(self._evidence.estimator.export(now))

    def restore_evidence(self, entries: Iterable[EvidenceEntry], at: float, now: float) -> None:
        """Take back this controller's own evidence as of ``at`` (its last flush before a
        restart). Classes are tracked as a report's would be; invalid class names are skipped."""
        valid = []
        for e in entries:
            try:
                check_class_name(e.traffic_class, "evidence.traffic_class")
            except ValueError:
                continue
            valid.append(e)
        mapping, new = self._classes.fold(e.traffic_class for e in valid)
        for name in [*new, *(v for v in mapping.values() if v == OTHER_CLASS)]:
            self._classes.track(name)
        evidence: dict[EvidenceKey, tuple[FloatArray, FloatArray]] = {}
        for e in valid:  # names folded into "other" add up
            add_evidence(evidence, (mapping[e.traffic_class], e.draft), e.accepts, e.rejects)
        self._evidence.estimator.restore(evidence, at, now)
        for cls, _ in evidence:
            self._classes[cls].evidence_at = now

    def set_fleet_evidence(self, evidence: Mapping[EvidenceKey, tuple[FloatArray, FloatArray]],
                           now: float) -> None:
        """The other sidecars' evidence, as of ``now``: it adds to this controller's
        posteriors, replacing the previous fleet view. Not for the drafts ``forget_departed``
        forgot (until an engine announces them again): the store must not bring them back.
        A forgotten name the store no longer holds is let go of."""
        forgotten = self._evidence.forgotten_drafts
        forgotten &= {draft for _, draft in evidence}
        self._evidence.estimator.set_fleet(
            {key: ev for key, ev in evidence.items() if key[1] not in forgotten}, now)

    def export_costs(self, sidecar: str, now: float) -> CostExport | None:
        """This controller's own step-cost evidence, stamped ``now`` (never the fleet's); None
        while the hardware is not known (nothing to share it with)."""
        hardware = self._engines.hardware()
        if not hardware:
            return None
        return CostExport(sidecar, now, hardware, self._evidence.cost.export())

    def restore_costs(self, export: CostExport) -> bool:
        """Take back this controller's own step-cost evidence (its last flush before a
        restart); False when it was made for other hardware or other drafts."""
        if export.hardware != self._engines.hardware():
            return False
        return self._evidence.cost.restore(export.evidence)

    def set_fleet_costs(self, exports: Iterable[CostExport], me: str, now: float,
                        max_age_seconds: float) -> int:
        """The other sidecars' step-cost evidence of this engine type replaces the previous
        fleet view; returns how many sidecars it came from."""
        cost = self._evidence.cost
        hardware = self._engines.hardware()
        if not hardware:
            cost.set_fleet(None)
            return 0
        evidence, count = fleet_costs(exports, me, hardware, cost.drafts, cost.knot_tokens, now,
                                      max_age_seconds)
        cost.set_fleet(evidence)
        return count
