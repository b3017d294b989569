"""Reads of the core's state: the frozen snapshot (``specpilot.controller.core.snapshot``) and the
cheaper calls that answer one question each (a decision, an estimate, engines' report ages, the cost
model's fit), so that no reader reaches into a part's state.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from specpilot.contract.pricing import StepPricing
from specpilot.contract.records import (
    CalibrationRows,
    Decision,
    DraftKind,
    DraftSpec,
    Reason,
    TokenCut,
)
from specpilot.controller.core.calibration import CalibrationTable
from specpilot.controller.core.cost_model import StepShape
from specpilot.controller.core.cut import CutPrices, token_cut
from specpilot.controller.core.mix import Arm
from specpilot.controller.core.parts import CoreParts
from specpilot.controller.core.policy import shown_arms
from specpilot.controller.core.snapshot import (
    AcceptanceEstimate,
    ClassView,
    CoreSnapshot,
    EngineView,
    Explanation,
)


class ReadModel:
    def __init__(self, parts: CoreParts) -> None:
        self._parts = parts

    def decision(self, traffic_class: str, bucket: int) -> Decision | None:
        state = self._parts.classes.get(traffic_class)
        return state.decisions.get(bucket) if state else None

    def default_decisions(self) -> list[Decision]:
        """What an engine applies to a class the controller has not seen yet: the warm-up K."""
        drafts = self._parts.engines.drafts()
        k = min(self._parts.config.policy.warmup_k, drafts[0].max_k) if drafts else 0
        return [Decision("", b, drafts[0].name if k else "", k, Reason.WARMUP)
                for b in range(self._parts.config.n_buckets)]

    def report_ages(self, now: float) -> dict[str, float]:
        """Seconds since each connected engine's last report (or its hello), by engine id."""
        return self._parts.engines.report_ages(now)

    def cost_fit(self) -> StepPricing:
        """The step-cost model's posterior-mean weights (what a composition carries)."""
        return self._parts.evidence.cost.mean.pricing()

    def priced_drafts(self) -> tuple[str, ...]:
        """Model drafts the step-cost model holds columns for, the longest-held first."""
        return self._parts.evidence.cost.drafts

    def predicted_seconds(self, shape: StepShape) -> float:
        """The cost model's mean time of one step of ``shape`` (as a report's is predicted)."""
        return self._parts.evidence.cost.predict(shape)

    def joint_arms(self) -> dict[int, dict[str, Arm]]:
        """Per bucket the joint search ran for, every class's arm in the best batch."""
        return self._parts.joint.arms()

    def estimate(self, traffic_class: str, draft: str, now: float,
                 positions: int | None = None) -> AcceptanceEstimate:
        """The acceptance posterior of (class, draft) as of ``now`` (the bare prior when no
        report named it) and the drafts its steps verify where the engines counted them.
        ``positions`` shown: the estimator's max K unless given, never more
        than it tracks (a draft may announce a longer K than the controller considers)."""
        evidence = self._parts.evidence
        estimator = evidence.estimator
        post = estimator.posterior(traffic_class, draft, now)
        tracked = post.alpha.size
        shown = tracked if positions is None else min(positions, tracked)
        proposals = evidence.proposals
        return AcceptanceEstimate(
            traffic_class=traffic_class,
            draft=draft,
            alpha=tuple(post.alpha.tolist()),
            beta=tuple(post.beta.tolist()),
            prior_alpha=post.prior_alpha,
            prior_beta=post.prior_beta,
            positions=shown,
            changes_detected=estimator.changes_detected(traffic_class, draft),
            has_evidence=estimator.has_data(traffic_class, draft),
            verified_drafts=(tuple(proposals.verified_drafts(traffic_class, draft, now)
                                   [:shown + 1].tolist())
                             if proposals.has_data(traffic_class, draft) else ()),
        )

    def calibration(self, traffic_class: str, draft: str, now: float,
                    transformed: bool = False) -> CalibrationTable:
        """P(accept | position, confidence bucket) of (class, draft) as of ``now``, each cell's
        prior the class's posterior mean acceptance at its position."""
        evidence = self._parts.evidence
        class_accept = evidence.estimator.posterior(traffic_class, draft, now).mean
        return evidence.calibration.table(traffic_class, draft, class_accept, now, transformed)

    def explain(self, traffic_class: str, bucket: int, now: float) -> Explanation:
        """The numbers behind the decision of one (class, bucket). KeyError naming what is
        unknown. (Its context takes Thompson draws like a decision's, though it shows means.)"""
        state = self._parts.classes.get(traffic_class)
        if state is None:
            raise KeyError(f"unknown class {traffic_class!r}")
        n_buckets = self._parts.config.n_buckets
        if not 0 <= bucket < n_buckets:
            raise KeyError(f"batch bucket {bucket} outside 0..{n_buckets - 1}")
        ctx = self._parts.contexts.build(traffic_class, state, self._parts.engines.drafts(), now,
                                   self._parts.evidence.mean_curves(now), every_bucket=True)
        batch = self._parts.evidence.loads.batch_size(bucket)
        policy = self._parts.config.policy
        shown = shown_arms(ctx, policy, batch)
        arms = tuple(replace(v, too_little_evidence=not shown.ranked(i, 0))
                     for i, v in enumerate(shown.table.values()))
        rates = tuple((d.name, tuple(float(r) for r in ctx.mean_rates[d.name][: d.max_k]))
                      for d in ctx.drafts)
        decision = state.decisions.get(bucket)
        # Whether the posteriors rank the arm of the best goodput by means against the
        # decision's (what the explanation's text compares).
        chosen = None if decision is None else shown.table.index(decision.arm)
        best = int(np.argmax(shown.table.goodput))
        return Explanation(traffic_class, decision, batch, arms, rates, ctx.override,
                           best_ranked=chosen is None or shown.ranked(best, chosen))

    def snapshot(self, now: float) -> CoreSnapshot:
        """The whole state as of ``now``, frozen (posteriors decay with time, so ``now``
        matters for the estimates and the engines' report ages)."""
        drafts = self._parts.engines.drafts()
        with_evidence = self._parts.evidence.estimator.keys()
        shares = self._parts.evidence.mix.shares()
        served = self._parts.evidence.served
        classes = tuple(
            ClassView(
                name=name,
                decisions=tuple(d for _, d in sorted(self._parts.classes[name].decisions.items())),
                estimates=self._estimates(name, drafts, with_evidence, now),
                overrides=tuple(self._parts.overrides.covering(name)),
                offline=name in self._parts.config.offline_classes,
                share=shares.get(name),
                measured_tokens_per_step=served.tokens_per_step(name),
                measured_speedup=served.speedup(name),
            )
            for name in self._parts.classes.names()
        )
        engines = tuple(
            EngineView(
                engine_id=engine_id,
                model=e.hello.model,
                drafts=tuple(e.drafts.values()),
                running_requests=e.running_requests,
                last_report_at=e.last_report_at,
                report_age_seconds=now - e.last_report_at,
                last_sequence=e.last_sequence,
                policy_version_applied=e.policy_version_applied,
                hardware=e.hello.hardware,
                versions_behind=self._parts.published.versions_behind(e.policy_version_applied),
            )
            for engine_id, e in self._parts.engines
        )
        return CoreSnapshot(
            at=now,
            version=self._parts.published.version,
            classes=classes,
            engines=engines,
            overrides=self._parts.overrides.all(),
            default_decisions=tuple(self.default_decisions()),
            log=self._parts.published.log,
            batch_bucket_upper_bounds=self._parts.config.batch_bucket_upper_bounds,
            measured_buckets=self._parts.evidence.loads.measured(),
            step_ratio_range=self._parts.evidence.cost.measured_ratio_range,
            offline_classes=self._parts.config.offline_classes,
            max_classes=self._parts.config.max_classes,
            composition=self._parts.published.composition,
            cut=self._token_cut(classes, now) if self._parts.config.policy.token_cut else None,
        )

    def _token_cut(self, classes: tuple[ClassView, ...], now: float) -> TokenCut:
        """What engines cut drafts with (``cut``), from the decisions of ``classes`` and the
        calibrations of the (class, draft) pairs whose confidences were counted; none for a
        class under a pinned K, which engines then neither cut nor stop the drafter early for."""
        evidence, config = self._parts.evidence, self._parts.config
        by_bucket: dict[int, list[tuple[Decision, float]]] = {}
        for view in classes:
            for d in view.decisions:
                by_bucket.setdefault(d.bucket, []).append((d, view.share or 0.0))

        means = {(view.name, e.draft): e.mean for view in classes for e in view.estimates}
        prices = CutPrices(evidence.cost, means, {d.name for d in self._parts.engines.drafts()
                                                  if d.kind == DraftKind.MODEL})
        rows = []
        for name in self._parts.classes.names():
            if (pin := self._parts.overrides.in_force(name)) is not None and pin.pin_k:
                continue  # an operator's K is verified whole: no rows, no cut
            for draft in (d.name for d in self._parts.engines.drafts()):
                for transformed in (False, True):
                    if evidence.calibration.has_data(name, draft, transformed):
                        table = self.calibration(name, draft, now, transformed)
                        rows.append(CalibrationRows(
                            name, draft, transformed, table.accept.shape[0],
                            tuple(table.accept.ravel().tolist()),
                            tuple(table.mean_accept().tolist())))
        sizes = [evidence.loads.batch_size(b) for b in range(config.n_buckets)]
        return token_cut(sizes, by_bucket, prices.seconds, prices.rate, rows, prices.survival,
                         config.policy.min_speedup - 1.0, prices.pass_seconds)

    def _estimates(self, name: str, drafts: tuple[DraftSpec, ...],
                   with_evidence: list[tuple[str, str]], now: float
                   ) -> tuple[AcceptanceEstimate, ...]:
        # Drafts of connected engines, plus any the class has evidence for from earlier engines.
        positions = {d.name: d.max_k for d in drafts}
        for cls, draft in with_evidence:
            if cls == name:
                positions.setdefault(draft, self._parts.config.estimator.max_k)
        return tuple(self.estimate(name, draft, now, k) for draft, k in positions.items())
