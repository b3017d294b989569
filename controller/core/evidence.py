"""What the controller has learnt from its engines: acceptance posteriors per (class, draft), the
class mix of the batch, each class's measured speedup, the step-cost model and the batch size
each bucket runs at; and how a report adds to them (``ingest``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping

import numpy as np
import numpy.typing as npt

from specpilot.contract.buckets import BucketLoads
from specpilot.contract.records import (
    DraftKind,
    DraftSpec,
    EngineHello,
    EngineReport,
    IngestResult,
    StepPrediction,
)
from specpilot.controller.core.acceptance import AcceptanceEstimator
from specpilot.controller.core.calibration import ConfidenceCalibration
from specpilot.controller.core.class_table import ClassTable
from specpilot.controller.core.config import CoreConfig
from specpilot.controller.core.cost_model import CostChangeTest, StepCostModel, StepShape
from specpilot.controller.core.engines import EngineRegistry, EngineState
from specpilot.controller.core.goodput import expected_tokens_curve
from specpilot.controller.core.mix import ClassMix, ServedSpeedup
from specpilot.controller.core.proposals import ProposalLengths

FloatArray = npt.NDArray[np.float64]


class MeanCurves:
    """Posterior-mean E(K) curves (K = 0..the estimator's max K) of (class, draft) as of one
    instant, and the drafts a step verifies at each K, each computed once: a decide round asks
    for the same ones per class and bucket."""

    def __init__(self, estimator: AcceptanceEstimator, proposals: ProposalLengths,
                 now: float) -> None:
        self._estimator = estimator
        self._proposals = proposals
        self._now = now
        self._curves: dict[tuple[str, str], FloatArray] = {}
        self._verified: dict[tuple[str, str], FloatArray | None] = {}

    def verified_drafts(self, traffic_class: str, draft: str) -> FloatArray | None:
        """Drafts a step of (class, draft) verifies for K = 0..max K asked; None where the
        engines counted none (a step verifies K)."""
        key = (traffic_class, draft)
        if key not in self._verified:
            self._verified[key] = (self._proposals.verified_drafts(traffic_class, draft,
                                                                   self._now)
                                   if self._proposals.has_data(traffic_class, draft) else None)
        return self._verified[key]

    def __call__(self, traffic_class: str, draft: str) -> FloatArray:
        curve = self._curves.get((traffic_class, draft))
        if curve is None:
            curve = expected_tokens_curve(
                self._estimator.posterior(traffic_class, draft, self._now).mean)
            self._curves[(traffic_class, draft)] = curve
        return curve


def step_cost_model(config: CoreConfig,
                    context_at: Callable[[float], float] | None = None) -> StepCostModel:
    """A fresh step-cost model with ``config``'s knots, prior, forgetting and change test,
    designed over its batch buckets; ``context_at``: the mean context per sequence steps of a
    batch size run at (None: context unpriced)."""
    return StepCostModel(
        config.cost_knots_tokens,
        config.cost_prior,
        config.cost_half_life_steps,
        [config.bucket_batch_size(b) for b in range(config.n_buckets)],
        config.policy.max_k,
        context_at,
        CostChangeTest(config.cost_change_tolerance, config.cost_change_threshold_steps),
    )


class Evidence:
    def __init__(self, config: CoreConfig, engines: EngineRegistry) -> None:
        self._engines = engines
        self.estimator = AcceptanceEstimator(config.estimator)
        self.proposals = ProposalLengths(config.estimator.max_k,
                                         config.estimator.half_life_seconds)
        self.calibration = ConfidenceCalibration(config.estimator)
        self.mix = ClassMix(config.traffic_half_life_seconds)
        self.served = ServedSpeedup(config.traffic_half_life_seconds)
        # Per bucket: the batch size and context its decode steps ran at (what its decisions
        # are priced at), and when an engine last reported such steps.
        self.loads = BucketLoads(config.batch_bucket_upper_bounds,
                                 config.traffic_half_life_seconds)
        self.cost = step_cost_model(config, self.loads.context_at)
        self._bucket_seen: dict[int, float] = {}
        self._profile_weight = config.cost_prior.profile_weight_steps
        # Drafts forgotten for want of an engine announcing them, while the fleet's store
        # still holds evidence of them (``FleetExchange.set_fleet_evidence``).
        self.forgotten_drafts: set[str] = set()

    def bucket_seen_at(self, bucket: int) -> float:
        """When an engine last reported decode steps in ``bucket`` (-inf: never)."""
        return self._bucket_seen.get(bucket, -math.inf)

    def mean_curves(self, now: float) -> MeanCurves:
        return MeanCurves(self.estimator, self.proposals, now)

    def predicted_step_seconds(self, batch_size: int, draft: str, k: int) -> float:
        """The cost model's mean step time for ``batch_size`` sequences each verifying K drafts
        of ``draft`` ("" or K=0: no speculation), as decisions price it (a per-request engine's
        drafter runs its passes whatever K is). KeyError for a draft no engine offers."""
        spec = next((d for d in self._engines.drafts() if d.name == draft), None)
        if draft and spec is None:
            raise KeyError(f"unknown draft {draft!r}")
        pass_draft = spec.pass_draft if spec is not None and k > 0 else ""
        return self.cost.predict_arm(batch_size, k, pass_draft, bool(pass_draft),
                                     self._engines.sunk_draft())

    # --- drafts and classes coming and going ----------------------------------------------------
    def add_drafts(self, hello: EngineHello, accepted: dict[str, DraftSpec], now: float) -> None:
        """Cost columns for ``accepted``'s new model drafts; then the engine's start-up profile
        centres the cost prior (``profile_center_steps``) and enters the cost model as observed
        steps of stated weight (``profile_weight_steps``), so the model starts from this
        hardware and live timings still take over. Points timing a draft the controller refused
        are skipped (their passes have no cost column)."""
        self.cost.ensure_drafts(n for n, d in accepted.items() if d.kind is DraftKind.MODEL)
        points = [(StepShape(p.batch_size, p.verified_tokens, p.draft, p.draft_passes,
                             p.batch_size * p.draft_passes, p.context_tokens, p.prefill_tokens),
                   p.seconds)
                  for p in hello.step_profile
                  if not p.draft or (p.draft in accepted
                                     and accepted[p.draft].kind is DraftKind.MODEL)]
        if not points:
            return
        self.cost.set_profile(points)
        self.cost.observe_profile(points, self._profile_weight)

    def forget_drafts(self, names: Iterable[str]) -> None:
        """Model drafts no connected engine announces: their cost columns and estimates."""
        names = list(names)
        self.cost.forget_drafts(names)
        for name in names:
            self.estimator.forget_draft(name)
            self.proposals.forget_draft(name)
            self.calibration.forget_draft(name)

    def held_drafts(self) -> set[str]:
        """Drafts with estimates or cost columns."""
        return self.estimator.drafts() | set(self.cost.drafts)

    def forget_class(self, name: str) -> None:
        """The class's estimates, share of the mix and measured speedup."""
        self.estimator.forget_class(name)
        self.proposals.forget_class(name)
        self.calibration.forget_class(name)
        self.mix.forget(name)
        self.served.forget(name)

    # --- reports --------------------------------------------------------------------------------
    def ingest(self, engine: EngineState, report: EngineReport, mapping: Mapping[str, str],
               classes: ClassTable, now: float) -> IngestResult:
        """Add a validated report whose class names count under ``mapping`` (every class of it
        tracked in ``classes``); marks the classes with new evidence or a detected change."""
        changes: list[tuple[str, str]] = []
        for rec in report.acceptance:
            cls = mapping[rec.traffic_class]
            state = classes[cls]
            if self.estimator.observe(cls, rec.draft, rec.steps_by_accepted, now,
                                      source=engine.hello.engine_id):
                state.change_pending = True
                changes.append((cls, rec.draft))
            if sum(rec.steps_by_accepted):
                state.evidence_at = now
            spec = engine.drafts.get(rec.draft)
            if rec.steps_by_drafted and spec is not None and spec.kind is not DraftKind.MODEL:
                # A model drafter proposes K: only deterministic proposals run short.
                self.proposals.observe(cls, rec.draft, rec.steps_by_drafted, now)
        for conf in report.confidence:
            # The calibration refines the class's acceptance; its changes re-decide nothing yet.
            self.calibration.observe(conf, mapping[conf.traffic_class], now)
        # The batch mix in decode request-steps: verification steps as they happen for classes
        # that speculate, finished requests' output - accepted (each step emits its accepted
        # drafts plus one token) for classes that do not.
        verified: dict[str, int] = {}
        for rec in report.acceptance:
            if not rec.counterfactual:
                cls = mapping[rec.traffic_class]
                verified[cls] = verified.get(cls, 0) + sum(rec.steps_by_accepted)
        for cls, steps in verified.items():
            self.mix.observe(cls, steps, now)
        self._observe_served(engine, report, mapping, now)
        for req in report.finished:
            cls = mapping[req.traffic_class]
            classes[cls].evidence_at = now  # traffic, even with no drafts to count
            if cls not in verified:
                self.mix.observe(cls, max(req.output_tokens - req.accepted_tokens, 1), now)
        predictions, costs_changed = self._observe_timings(engine, report, now)
        folded = tuple(sorted(n for n, v in mapping.items() if v != n))
        return IngestResult(folded_classes=folded, changes_detected=tuple(changes),
                            step_predictions=tuple(predictions),
                            step_costs_changed=costs_changed)

    def _observe_served(self, engine: EngineState, report: EngineReport,
                        mapping: Mapping[str, str], now: float) -> None:
        """Served speculative steps for the measured speedup, priced by the costs as they were
        before the report (its timings are learnt after)."""
        n = max(report.running_requests, 1)
        ratios: dict[tuple[str, int], float] = {}  # a report's records share a few arms

        def ratio(draft: str, k: int) -> float:
            if (draft, k) not in ratios:
                ratios[(draft, k)] = (self.predicted_step_seconds(n, draft, k)
                                      / self.predicted_step_seconds(n, "", 0))
            return ratios[(draft, k)]

        for rec in report.acceptance:
            steps = sum(rec.steps_by_accepted)
            if rec.counterfactual or rec.k == 0 or steps == 0:
                continue
            spec = engine.drafts.get(rec.draft)
            if rec.steps_by_drafted and spec is not None and not spec.pass_draft:
                # Each step priced at the drafts it verified (no model passes to price).
                priced = sum(h * ratio(rec.draft, d)
                             for d, h in enumerate(rec.steps_by_drafted) if h)
            else:
                priced = steps * ratio(rec.draft, rec.k)
            tokens = sum((1 + a) * h for a, h in enumerate(rec.steps_by_accepted))
            self.served.observe(mapping[rec.traffic_class], steps, tokens, priced, now)

    def _observe_timings(self, engine: EngineState, report: EngineReport,
                         now: float) -> tuple[list[StepPrediction], bool]:
        """The report's step timings, each predicted by the costs as they were before the
        report (one solve per report, not per record), then learnt; and whether they showed the
        step costs changed (the cost model's change test)."""
        predictions = []
        learnt: list[tuple[StepShape, float, int, float]] = []
        for st in report.step_timings:
            if st.steps <= 0:
                continue
            spec = engine.drafts.get(st.draft)
            is_model = spec is not None and spec.kind is DraftKind.MODEL
            shape = StepShape(
                batch_size=st.sum_batch_size / st.steps,
                verified_tokens=st.sum_verified_tokens / st.steps,
                draft=st.draft if is_model else "",
                draft_passes=float(st.k) if is_model and st.sum_draft_tokens > 0 else 0.0,
                draft_tokens=st.sum_draft_tokens / st.steps if is_model else 0.0,
                # 0 (unknown, from older plugins) leaves the context column unread.
                context_tokens=st.sum_context_tokens / st.sum_batch_size,
                prefill_tokens=st.sum_prefill_tokens / st.steps,
            )
            measured = st.sum_step_seconds / st.steps
            self._bucket_seen[st.batch_bucket] = now
            self.loads.observe(st.batch_bucket, st.steps, st.sum_batch_size, now,
                               st.sum_context_tokens)
            predicted = self.cost.predict(shape)
            predictions.append(StepPrediction(st.batch_bucket, st.k, st.steps, predicted,
                                              measured))
            learnt.append((shape, measured, st.steps, predicted))
        changed = False
        for shape, measured, steps, predicted in learnt:
            changed |= self.cost.observe(shape, measured, steps, predicted=predicted)
        return predictions, changed
