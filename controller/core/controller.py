"""ControllerCore: the state of one controller and the lap report -> estimates -> policy.

Pure: time is passed in, randomness comes from the injected Generator, nothing here does I/O. The
gRPC server, the simulator and the tests all drive this same object.

A facade over parts with one job each, which it builds and wires together:

    engines        the connected engines and the drafts accepted from them (``engines``)
    class table    tracked classes in their slots, eviction and idle forgetting (``class_table``)
    overrides      operators' overrides, the pod's and the fleet's (``overrides``)
    evidence       posteriors, class mix, measured speedups, step costs, loads (``evidence``)
    decider        contexts, the joint search and the decide loop (``context``, ``joint``,
                   ``decider``), the policy itself pure functions (``policy``)
    published      the policy version, its composition and the decision log (``published``)
    fleet          evidence given to and taken from other sidecars (``fleet_exchange``)
    options        what the engines achieve, for recommendations (``engine_options``)
    read model     snapshot, estimates, explanations and one-question reads (``read_model``)

Writes (``connect_engine``, ``ingest``, ``set_override``, ``clear_override``) change state only;
``decide`` turns the state into decisions. Readers use the read model (``snapshot``,
``decision``, ``explain``, ``version``, ...), never the parts' state.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np

from specpilot.contract.pricing import Composition, StepPricing
from specpilot.contract.records import (
    Decision,
    DecisionEvent,
    DraftSpec,
    EngineHello,
    EngineReport,
    IngestResult,
    Override,
    OverrideScope,
    ReportRejected,
)
from specpilot.contract.validation import check_hello, check_report
from specpilot.controller.core.acceptance import DEPARTED
from specpilot.controller.core.calibration import CalibrationTable
from specpilot.controller.core.class_table import ClassTable
from specpilot.controller.core.config import CoreConfig
from specpilot.controller.core.context import Contexts
from specpilot.controller.core.cost_model import StepShape
from specpilot.controller.core.decider import Decider
from specpilot.controller.core.engine_options import engine_options
from specpilot.controller.core.engines import EngineRegistry, HelloOutcome, admit_drafts
from specpilot.controller.core.evidence import Evidence
from specpilot.controller.core.fleet import CostExport, EvidenceEntry, EvidenceKey, FloatArray
from specpilot.controller.core.fleet_exchange import FleetExchange
from specpilot.controller.core.joint import JointSearch
from specpilot.controller.core.mix import Arm
from specpilot.controller.core.overrides import Overrides
from specpilot.controller.core.parts import CoreParts
from specpilot.controller.core.published import PublishedPolicy
from specpilot.controller.core.read_model import ReadModel
from specpilot.controller.core.recommend import EngineOptions
from specpilot.controller.core.snapshot import AcceptanceEstimate, CoreSnapshot, Explanation


class ControllerCore:
    def __init__(self, config: CoreConfig, rng: np.random.Generator, epoch: int = 0) -> None:
        """``epoch``: the first part of every policy version (``published.EPOCH_SHIFT``); the
        server passes its start time (``published.epoch_at``), the simulator and tests 0."""
        self.config = config
        self._published = PublishedPolicy(epoch, config.decision_log_size)
        self._engines = EngineRegistry()
        self._classes = ClassTable(config)
        self._overrides = Overrides(config, self._classes)
        self._evidence = Evidence(config, self._engines)
        self._joint = JointSearch(config, self._engines, self._classes, self._overrides,
                                  self._evidence)
        contexts = Contexts(config, rng, self._engines, self._classes, self._overrides,
                            self._evidence, self._joint)
        parts = CoreParts(config, self._engines, self._classes, self._overrides, self._evidence,
                          self._joint, contexts, self._published)
        self._decider = Decider(parts)
        self._fleet = FleetExchange(config, self._engines, self._classes, self._evidence)
        self._read = ReadModel(parts)
        # Since when no connected engine announces a draft or holds an engine id, by name.
        self._absent_since: dict[tuple[str, str], float] = {}

    @property
    def epoch(self) -> int:
        return self._published.epoch

    # --- engines ----------------------------------------------------------------------------
    def connect_engine(self, hello: EngineHello, now: float) -> HelloOutcome:
        """Register (or re-register) an engine; refuse drafts whose tokenizer differs, model
        drafts beyond ``max_model_drafts`` and drafts substituted into a refused one's
        proposals (``engines.admit_drafts``)."""
        check_hello(hello)
        admission = admit_drafts(hello, self._evidence.cost.drafts,
                                 self._engines.drafts_in_use(besides=hello.engine_id),
                                 self.config.max_model_drafts)
        self._evidence.forget_drafts(admission.forget)
        self._joint.forget_drafts(admission.forget)
        self._evidence.add_drafts(hello, admission.accepted, now)
        self._evidence.forgotten_drafts -= set(admission.accepted)
        self._engines.register(hello, admission.accepted, now)
        return HelloOutcome(tuple(admission.accepted), admission.rejected)

    def heard_from(self, engine_id: str, now: float) -> None:
        """The engine sent something (a report the server shed): not silent."""
        self._engines.heard_from(engine_id, now)

    def disconnect_engine(self, engine_id: str) -> None:
        self._engines.remove(engine_id)
        self._classes.release(engine_id)

    def drafts(self) -> tuple[DraftSpec, ...]:
        """Drafts every connected engine accepted (union; first-seen order)."""
        return self._engines.drafts()

    def served_model(self) -> str:
        """The model of the first connected engine, kept once every engine has left ("" before
        any named one): the fleet a sidecar joins when no model is configured, so what its
        engines taught it is still shared after they left (cheaper than a snapshot)."""
        return self._engines.model()

    def hardware(self) -> str:
        """What the first connected engine runs on, kept once every engine has left ("" before
        any named it): the engine type whose step costs this controller shares."""
        return self._engines.hardware()

    # --- classes and reports ----------------------------------------------------------------
    def canonical_class(self, name: str) -> str:
        """The tracked class for ``name`` now (unknown names beyond the limit map to "other")."""
        return self._classes.canonical(name)

    def forget_class(self, name: str) -> None:
        """Free the class's slot: its decisions, estimates, share of the mix and measured
        speedup are forgotten (the decision log keeps its history)."""
        if self._classes.remove(name):
            self._published.class_forgotten()
        self._evidence.forget_class(name)
        self._joint.forget_class(name)

    def forget_idle_classes(self, now: float) -> tuple[str, ...]:
        """Free the slots of classes no engine reported for ``class_idle_seconds`` (except
        declared ones and those under an override of their own); returns their names."""
        idle = self._classes.idle(now, self._overrides)
        for name in idle:
            self.forget_class(name)
        return idle

    def forget_departed(self, now: float) -> tuple[str, ...]:
        """Forget the drafts no connected engine announced for ``name_grace_seconds`` (their
        estimates, calibration and cost columns), and the longest-absent beyond
        ``max_absent_drafts``; join the evidence of engine ids gone ``name_grace_seconds`` to
        the departed engines' share. Returns the drafts forgotten."""
        announced = {d.name for d in self._engines.drafts()}
        connected = {engine_id for engine_id, _ in self._engines}
        absent = ({("draft", d) for d in self._evidence.held_drafts() if d not in announced}
                  | {("engine", e) for e in self._evidence.estimator.all_sources()
                     if e != DEPARTED and e not in connected})
        self._absent_since = {name: self._absent_since.get(name, now) for name in absent}
        due = [name for name, since in self._absent_since.items()
               if now - since >= self.config.name_grace_seconds]
        waiting = sorted((since, name) for (kind, name), since in self._absent_since.items()
                         if kind == "draft" and now - since < self.config.name_grace_seconds)
        excess = len(waiting) - self.config.max_absent_drafts
        due += [("draft", name) for _, name in waiting[:max(excess, 0)]]
        drafts = tuple(sorted(n for kind, n in due if kind == "draft"))
        self._evidence.forget_drafts(drafts)
        self._evidence.forgotten_drafts.update(drafts)
        self._joint.forget_drafts(drafts)
        self._evidence.estimator.forget_sources(
            {name for kind, name in due if kind == "engine"}, now)
        for name in due:
            del self._absent_since[name]
        return drafts

    def ingest(self, engine_id: str, report: EngineReport, now: float) -> IngestResult:
        """Validate, then apply a report. On ReportRejected nothing has changed."""
        engine = self._engines.get(engine_id)
        if engine is None:
            raise ReportRejected(f"engine {engine_id!r}: report before hello")
        check_report(report, engine.drafts, engine.hello.max_k, self.config.n_buckets,
                     engine.last_sequence, engine.hello.max_batch_size,
                     engine.fastest_step_seconds)
        # Class mapping is decided before any state changes, in report order.
        names = [r.traffic_class for r in report.acceptance] + [
            r.traffic_class for r in report.finished] + [
            r.traffic_class for r in report.confidence]
        mapping, admitted, evicted = self._classes.admit(engine_id, names, len(self._engines),
                                                         self._overrides)
        # --- apply (nothing below can fail) ---
        for name in evicted:
            self.forget_class(name)
        self._classes.take(engine_id, mapping, admitted, now)
        result = self._evidence.ingest(engine, report, mapping, self._classes, now)
        self._engines.reported(engine, report, now)
        return result

    # --- decisions --------------------------------------------------------------------------
    def decide(self, now: float, joint: bool = True) -> list[DecisionEvent]:
        """Re-decide what new evidence, an override or time may have changed; return the events
        for choices that changed (``decider``). ``joint=False`` leaves the joint search's
        refresh to ``refresh_joint`` (the server's rounds, so that a report's policy never
        waits behind it)."""
        return self._decider.decide(now, joint)

    def refresh_joint(self, now: float, max_buckets: int) -> None:
        """Rerun the joint search for at most ``max_buckets`` of the stalest buckets (the
        server spreads it over its own loop turns, so no report waits behind it)."""
        self._decider.refresh_joint(now, max_buckets)

    # --- overrides --------------------------------------------------------------------------
    def set_override(self, override: Override) -> None:
        """Put ``override`` in force (in its scope's layer) from the next ``decide``. Raise
        ValueError (naming the field), changing nothing, for a class that cannot be tracked."""
        self._overrides.set(override)

    def check_override(self, override: Override) -> None:
        """ValueError (naming the field) when ``override`` names a class that cannot be
        tracked; changes nothing."""
        self._overrides.check(override)

    def check_operator_override(self, override: Override) -> None:
        """What an operator's override must also satisfy (``Overrides.check_operator``)."""
        drafts = self.drafts()
        largest_k = max((d.max_k for d in drafts), default=0) if len(self._engines) else None
        self._overrides.check_operator(override, [d.name for d in drafts], largest_k)

    def clear_override(self, traffic_class: str,
                       scope: OverrideScope = OverrideScope.POD) -> bool:
        """Lift the override of ``scope`` on ``traffic_class`` from the next ``decide``; False
        if none was set."""
        return self._overrides.clear(traffic_class, scope)

    def set_fleet_overrides(self, overrides: Iterable[Override]) -> list[tuple[Override, str]]:
        """The fleet's overrides as the state store holds them, replacing the previous fleet
        layer. Returns those that could not be taken, each with the reason (a class this
        controller cannot track); the rest are in force from the next ``decide``."""
        return self._overrides.set_fleet(overrides)

    def fleet_overrides(self) -> tuple[Override, ...]:
        """The fleet layer as last set, by class."""
        return self._overrides.fleet()

    # --- the fleet (specpilot.controller.core.fleet_exchange) -------------------------------------
    @property
    def evidence_half_life(self) -> float:
        """Half-life of acceptance evidence, seconds: the fleet decays exports with it too."""
        return self.config.estimator.half_life_seconds

    def export_evidence(self, now: float) -> tuple[EvidenceEntry, ...]:
        return self._fleet.export_evidence(now)

    def restore_evidence(self, entries: Iterable[EvidenceEntry], at: float, now: float) -> None:
        self._fleet.restore_evidence(entries, at, now)

    def set_fleet_evidence(self, evidence: Mapping[EvidenceKey, tuple[FloatArray, FloatArray]],
                           now: float) -> None:
        self._fleet.set_fleet_evidence(evidence, now)

    def export_costs(self, sidecar: str, now: float) -> CostExport | None:
        return self._fleet.export_costs(sidecar, now)

    def restore_costs(self, export: CostExport) -> bool:
        return self._fleet.restore_costs(export)

    def set_fleet_costs(self, exports: Iterable[CostExport], me: str, now: float,
                        max_age_seconds: float) -> int:
        return self._fleet.set_fleet_costs(exports, me, now, max_age_seconds)

    def engine_options(self, sidecar: str, now: float) -> EngineOptions | None:
        """What this controller's engines achieve, for the fleet's recommendations; None while
        no engine is connected (``specpilot.controller.core.engine_options``)."""
        return engine_options(self.config, self._engines, self._classes, self._evidence,
                              sidecar, now)

    # --- read model (specpilot.controller.core.read_model) ----------------------------------------
    @property
    def version(self) -> int:
        """Version of the policy: moves when a decide round changed what engines must apply."""
        return self._published.version

    @property
    def engines_connected(self) -> int:
        """Engines registered now (what a health check reports: cheaper than a snapshot)."""
        return len(self._engines)

    def composition(self) -> Composition | None:
        """The composition the current policy version carries (renewed by a decide round when
        it moved by more than a tolerance)."""
        return self._published.composition

    def snapshot(self, now: float) -> CoreSnapshot:
        return self._read.snapshot(now)

    def decision(self, traffic_class: str, bucket: int) -> Decision | None:
        return self._read.decision(traffic_class, bucket)

    def default_decisions(self) -> list[Decision]:
        """What an engine applies to a class the controller has not seen yet: the warm-up K."""
        return self._read.default_decisions()

    def estimate(self, traffic_class: str, draft: str, now: float,
                 positions: int | None = None) -> AcceptanceEstimate:
        return self._read.estimate(traffic_class, draft, now, positions)

    def explain(self, traffic_class: str, bucket: int, now: float) -> Explanation:
        return self._read.explain(traffic_class, bucket, now)

    def calibration(self, traffic_class: str, draft: str, now: float,
                    transformed: bool = False) -> CalibrationTable:
        return self._read.calibration(traffic_class, draft, now, transformed)

    def report_ages(self, now: float) -> dict[str, float]:
        """Seconds since each connected engine's last report, by engine id (no snapshot)."""
        return self._read.report_ages(now)

    def predicted_step_seconds(self, batch_size: int, draft: str, k: int) -> float:
        """The cost model's mean step time for ``batch_size`` sequences each verifying K drafts
        of ``draft`` ("" or K=0: no speculation), as decisions price it. KeyError for a draft
        no engine offers."""
        return self._evidence.predicted_step_seconds(batch_size, draft, k)

    def predicted_seconds(self, shape: StepShape) -> float:
        """The cost model's mean time of one step of ``shape`` (as a report's is predicted)."""
        return self._read.predicted_seconds(shape)

    def cost_fit(self) -> StepPricing:
        """The step-cost model's posterior-mean weights."""
        return self._read.cost_fit()

    def priced_drafts(self) -> tuple[str, ...]:
        """Model drafts the step-cost model prices (holds columns for)."""
        return self._read.priced_drafts()

    def joint_arms(self) -> dict[int, dict[str, Arm]]:
        """Per bucket the joint search ran for, every class's arm in the best batch."""
        return self._read.joint_arms()
