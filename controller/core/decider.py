"""The decide loop: re-decide the classes that new evidence, an override or time may have changed,
with the pure policy's stages (``policy.choose``, then ``policy.with_probe``) on each class's
context, priced before each stage (``context.Contexts``), and publish the result.

Incremental: a class whose every bucket is settled and has no new evidence keeps its decisions
without being scored, so a round costs what the evidence since the last one touched.
"""

from __future__ import annotations

from specpilot.contract.pricing import Composition, moved
from specpilot.contract.records import Decision, DecisionEvent, DraftSpec, Reason
from specpilot.controller.core.class_table import ClassState
from specpilot.controller.core.context import Running
from specpilot.controller.core.evidence import MeanCurves
from specpilot.controller.core.parts import CoreParts
from specpilot.controller.core.policy import (
    ClassContext,
    choose,
    decision_figures,
    follow_neighbours,
    needs_neighbours,
    offered,
    priced_batch,
    with_probe,
)

# A probe share that moved by less than this factor is not worth a new policy version.
_PROBE_RATE_MATERIAL_FACTOR = 1.25
# Classes whose E(K) curves a policy carries for the engines' per-step re-picks (the largest
# shares of the mix): bounds a policy update at ~30 KiB with 16 drafts of K 8.
COMPOSITION_MAX_CLASSES = 32
# Relative move of an E(K) or of a priced step time that makes a new composition worth a policy
# version (the engines' re-picks follow what the controller learns, not each round's noise).
_COMPOSITION_TOLERANCE = 0.01


class Decider:
    def __init__(self, parts: CoreParts) -> None:
        self._parts = parts

    def refresh_joint(self, now: float, max_buckets: int) -> None:
        """Rerun the joint search for at most ``max_buckets`` of the stalest buckets."""
        parts = self._parts
        parts.joint.refresh(parts.engines.drafts(), now, parts.evidence.mean_curves(now),
                            max_buckets)

    def decide(self, now: float, joint: bool = True) -> list[DecisionEvent]:
        """Re-decide, publish and return the events for choices that changed. ``joint=False``
        leaves the joint search's refresh to ``refresh_joint``."""
        drafts = self._parts.engines.drafts()
        if not drafts and not len(self._parts.engines):
            return []
        events: list[DecisionEvent] = []
        material = False
        curves = self._parts.evidence.mean_curves(now)
        if joint:
            self._parts.joint.refresh(drafts, now, curves)
        drawn = self._parts.contexts.draw_costs()
        # The classes as they run, per bucket (``Contexts.others``); a decision the round
        # changes is priced again, so later classes see it.
        running: Running = {}
        for name, state in self._parts.classes:
            if self._holds(name, state, drafts):
                self._parts.contexts.draw_held(name, drafts, now)
                continue
            ctx = self._parts.contexts.build(name, state, drafts, now, curves, drawn, running)
            material |= self._decide_class(ctx, state, now, curves, running, events)
        composition = self._compose(drafts, curves)
        sizes = self._priced_batch_sizes()
        if moved(self._parts.published.composition, composition, sizes,
                 self._parts.config.policy.max_k, _COMPOSITION_TOLERANCE,
                 {b: self._parts.evidence.loads.context_at(b) for b in sizes}):
            self._parts.published.composition = composition
            material = True
        return self._parts.published.publish(events, material)

    def _decide_class(self, ctx: ClassContext, state: ClassState, now: float,
                      curves: MeanCurves, running: Running, events: list[DecisionEvent]
                      ) -> bool:
        """Decide the class of ``ctx`` with the policy's two stages (the arms a probe reads
        priced in between), keep what changed in ``state`` and ``running``, and add an event
        for each new choice to ``events``; whether an engine must hear of a change."""
        policy, name = self._parts.config.policy, ctx.traffic_class
        choices = [choose(ctx, policy, bucket) for bucket in ctx.buckets]
        if needs_neighbours(ctx, choices):
            # Neighbouring buckets bound each other (``follow_neighbours``): priced at every
            # bucket's batch size first.
            for bucket in ctx.buckets:
                ctx = self._parts.contexts.priced_at(ctx, priced_batch(ctx, bucket))
            loads = self._parts.evidence.loads
            choices = follow_neighbours(ctx, policy, choices,
                                        [loads.steps(b.bucket) for b in ctx.buckets])
        ctx = self._parts.contexts.priced_for_probes(ctx, choices)
        material = False
        for bucket, choice in zip(ctx.buckets, choices, strict=True):
            new = with_probe(ctx, policy, bucket, choice)
            old = state.decisions.get(new.bucket)
            if bucket.fresh:
                # Decided on this evidence, even where hysteresis or the dwell kept the arm:
                # the next draw needs new evidence again.
                state.decided_at[new.bucket] = now
            if new is old:
                continue
            material |= _material(old, new)
            state.decisions[new.bucket] = new
            state.decided_at[new.bucket] = now
            if name in running.get(new.bucket, {}):
                o = self._parts.contexts.running(name, running[new.bucket][name].share, new.bucket,
                                           ctx.drafts, curves)
                if o is not None:
                    running[new.bucket][name] = o
            if new.same_choice(old):
                continue
            state.changed_at[new.bucket] = now
            ctx = self._parts.contexts.priced_at(ctx, priced_batch(ctx, bucket))
            events.append(DecisionEvent(
                0, now, new, old, decision_figures(ctx, policy, bucket, new, old)))
        state.change_pending = False
        return material

    def _holds(self, name: str, state: ClassState, drafts: tuple[DraftSpec, ...]) -> bool:
        """Whether deciding the class would keep every bucket's decision as it is (what
        ``decide_bucket`` does for a settled bucket without new evidence): no override, no
        detected change, not offline, and each bucket settled (on an arm the connected engines
        offer) and not fresh."""
        if (state.change_pending or not drafts or name in self._parts.config.offline_classes
                or self._parts.overrides.in_force(name) is not None):
            return False
        for b in range(self._parts.config.n_buckets):
            d = state.decisions.get(b)
            if (d is None or d.reason in (Reason.WARMUP, Reason.OVERRIDE)
                    or self._parts.contexts.fresh(state, b) or not offered(drafts, d)):
                return False
        return True

    def _priced_batch_sizes(self) -> list[int]:
        loads = self._parts.evidence.loads
        return sorted({max(1, round(loads.batch_size(b)))
                       for b in range(self._parts.config.n_buckets)})

    def _compose(self, drafts: tuple[DraftSpec, ...], curves: MeanCurves) -> Composition | None:
        """What engines that re-pick arms per step price a step with (``step_composition``):
        the cost model's mean weights and the posterior-mean E(K) of the classes with the
        largest shares, per draft they have evidence for. None when no connected engine can
        use it, or when a per-request engine's drafter runs whatever K is chosen (a per-step
        re-pick then saves verification only)."""
        engines = self._parts.engines
        if not engines.any_step_composition() or engines.sunk_draft() is not None:
            return None
        shares = self._parts.evidence.mix.shares()
        estimator, max_k = self._parts.evidence.estimator, self._parts.config.policy.max_k
        names = sorted(self._parts.classes.names(), key=lambda c: (-shares.get(c, 0.0), c))
        expected: dict[tuple[str, str], tuple[float, ...]] = {}
        for name in names[:COMPOSITION_MAX_CLASSES]:
            for d in drafts:
                if estimator.has_data(name, d.name):
                    curve = curves(name, d.name)[: min(max_k, d.max_k) + 1]
                    expected[(name, d.name)] = tuple(float(x) for x in curve)
        return Composition(self._parts.evidence.cost.mean.pricing(), expected,
                           self._parts.config.policy.composition_margin)


def _material(old: Decision | None, new: Decision) -> bool:
    """Whether the engine needs to hear about this change."""
    if old is None or not new.same_choice(old):
        return True
    if (old.probe_k, old.probe_draft) != (new.probe_k, new.probe_draft):
        return True
    lo, hi = sorted((old.probe_rate, new.probe_rate))
    return hi > 0 and (lo == 0 or hi / lo > _PROBE_RATE_MATERIAL_FACTOR)
