"""Assembles the flat context the policy decides a class on (``policy.ClassContext``): the class's
posteriors with one Thompson draw per draft, its buckets, the override in force, the rest of the
batch, and every step the policy may score priced in advance (``prices.price_steps``).

The round's randomness is drawn here and only here, in a fixed order (one draw of the cost
weights per decide round, then per class in table order one draw per draft), so that runs stay
comparable draw for draw.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from functools import partial

import numpy as np

from specpilot.contract.records import DraftSpec
from specpilot.controller.core.class_table import ClassState, ClassTable
from specpilot.controller.core.config import CoreConfig
from specpilot.controller.core.cost_model import PricedCosts
from specpilot.controller.core.engines import EngineRegistry
from specpilot.controller.core.evidence import Evidence, MeanCurves
from specpilot.controller.core.joint import JointSearch
from specpilot.controller.core.mix import BatchOthers, OtherClass, other_class
from specpilot.controller.core.overrides import Overrides
from specpilot.controller.core.policy import (
    BucketState,
    Choice,
    ClassContext,
    priced_batch,
    probe_curves,
    runs,
    unpriced_decision,
)
from specpilot.controller.core.prices import StepPrices, price_steps

# Per bucket, every class as it runs (``Contexts.running``): kept by a decide round for all its
# classes, so each is priced once a round, not once per deciding class (at 256 classes that
# was most of a round).
Running = dict[int, dict[str, OtherClass]]
# The prices of a context before it is priced (``Contexts._priced``).
_UNPRICED = StepPrices({}, {})


class Contexts:
    def __init__(self, config: CoreConfig, rng: np.random.Generator, engines: EngineRegistry,
                 classes: ClassTable, overrides: Overrides, evidence: Evidence,
                 joint: JointSearch) -> None:
        self._config = config
        self._rng = rng
        self._engines = engines
        self._classes = classes
        self._overrides = overrides
        self._evidence = evidence
        self._joint = joint

    def draw_costs(self) -> PricedCosts:
        """The round's draw of the step-cost weights (taken before any acceptance draw)."""
        return self._evidence.cost.draw(self._rng)

    def draw_held(self, name: str, drafts: tuple[DraftSpec, ...], now: float) -> None:
        """Take the draws of a class that holds its decisions unscored, so that what the other
        classes draw does not depend on which classes held."""
        for d in drafts:
            self._evidence.estimator.posterior(name, d.name, now).sample(self._rng)

    def fresh(self, state: ClassState, bucket: int) -> bool:
        """Whether the class's decision for ``bucket`` has new evidence behind it: acceptance
        data for the class and decode steps in the bucket since the bucket was last decided."""
        decided = state.decided_at.get(bucket, -math.inf)
        return state.evidence_at > decided and self._evidence.bucket_seen_at(bucket) > decided

    def build(self, name: str, state: ClassState, drafts: tuple[DraftSpec, ...], now: float,
              curves: MeanCurves, drawn: PricedCosts | None = None,
              running: Running | None = None, every_bucket: bool = False) -> ClassContext:
        """The context, priced for the buckets whose decision the policy prices
        (``policy.unpriced_decision`` is None for them), or at ``every_bucket`` (for an
        explanation). ``drawn``: the decide round's draw of the cost weights (None: sampled
        goodput is priced by the mean costs). ``running``: see ``others``."""
        estimator, loads = self._evidence.estimator, self._evidence.loads
        sunk = self._engines.sunk_draft()
        sampled, mean, position1, posteriors = {}, {}, {}, {}
        for d in drafts:
            post = estimator.posterior(name, d.name, now)
            sampled[d.name] = post.sample(self._rng)
            mean[d.name] = post.mean
            position1[d.name] = (float(post.alpha[0]), float(post.beta[0]))
            posteriors[d.name] = (post.alpha, post.beta)
        buckets = tuple(
            BucketState(b, loads.batch_size(b), state.decisions.get(b), state.changed_at.get(b),
                        fresh=self.fresh(state, b))
            for b in range(self._config.n_buckets)
        )
        unpriced = ClassContext(
            traffic_class=name,
            now=now,
            drafts=drafts,
            sampled_rates=sampled,
            mean_rates=mean,
            change_detected=state.change_pending,
            recovering=any(estimator.recovering(name, d.name, now) for d in drafts),
            offline=name in self._config.offline_classes,
            override=self._overrides.in_force(name),
            buckets=buckets,
            prices=_UNPRICED,
            # Per-request engines draft max K for everyone anyway: the homogeneous view is
            # exact.
            others=self.others(name, drafts, curves, running) if sunk is None else {},
            position1=position1,
            drafter_sunk=sunk is not None,
            evidence=frozenset(d.name for d in drafts if estimator.has_data(name, d.name)),
            posteriors=posteriors,
            verified_drafts={d.name: v for d in drafts
                             if (v := curves.verified_drafts(name, d.name)) is not None},
            ratio_cap=(None if (measured := self._evidence.cost.measured_ratio_range) is None
                       else measured[1]),
        )
        policy = self._config.policy
        priced = [b for b in unpriced.buckets
                  if every_bucket or unpriced_decision(unpriced, policy, b) is None]
        # Priced at the bucket's batch size (probes, overrides) and at the one its arms are
        # scored at (offline work: the largest); a Thompson draw scores a fresh bucket.
        mean_sizes = {n for b in priced for n in (b.batch_size, priced_batch(unpriced, b))}
        drawn_sizes = {priced_batch(unpriced, b) for b in priced if b.fresh}
        return self._priced(unpriced, mean_sizes, drawn, drawn_sizes)

    def priced_at(self, ctx: ClassContext, batch_size: int) -> ClassContext:
        """``ctx`` priced by the mean costs at ``batch_size`` too (what a decision's figures
        are taken at, ``policy.decision_figures``)."""
        if (batch_size, "", 0) in ctx.prices.curves:
            return ctx
        more = self._priced(ctx, {batch_size}, None, set())
        return replace(ctx, prices=ctx.prices.plus(more.prices))

    def priced_for_probes(self, ctx: ClassContext, choices: Sequence[Choice]) -> ClassContext:
        """``ctx`` with what the choices' probes read (``policy.probe_curves``, one choice per
        bucket) priced by the mean costs."""
        policy = self._config.policy
        arms = {curve for b, c in zip(ctx.buckets, choices, strict=True)
                for curve in probe_curves(ctx, policy, b, c)}
        arms.difference_update(ctx.prices.curves)
        if not arms:
            return ctx
        cost = self._evidence.cost
        more = price_steps(partial(cost.predict_curve, sunk_draft=self._engines.sunk_draft()),
                           None, ctx.drafts, self._config.policy.max_k, (), arms=arms)
        return replace(ctx, prices=ctx.prices.plus(more))

    def _priced(self, ctx: ClassContext, mean: set[int], drawn: PricedCosts | None,
                sampled: set[int]) -> ClassContext:
        """``ctx`` with its steps priced by the mean costs at the batch sizes ``mean`` (with a
        draft an override forces scored alone) and by ``drawn`` at ``sampled``."""
        if not mean:
            return ctx
        max_k = self._config.policy.max_k
        cost, sunk = self._evidence.cost, self._engines.sunk_draft()
        forced = tuple((d,) for d in ctx.drafts
                       if ctx.override is not None and d.name == ctx.override.force_draft)
        prices = price_steps(
            partial(cost.predict_curve, sunk_draft=sunk), cost.predict_mixed, ctx.drafts,
            max_k, mean, ctx.others, forced, spread=partial(cost.arm_spread, sunk_draft=sunk),
            verified=ctx.verified_drafts)
        drawn_prices = None if drawn is None else price_steps(
            partial(drawn.predict_curve, sunk_draft=sunk), drawn.predict_mixed, ctx.drafts,
            max_k, sampled, ctx.others, verified=ctx.verified_drafts)
        return replace(ctx, prices=prices, drawn_prices=drawn_prices)

    def others(self, name: str, drafts: tuple[DraftSpec, ...], curves: MeanCurves,
               running: Running | None = None) -> dict[int, BatchOthers]:
        """Per bucket batch size: the rest of a batch as the other classes run now (empty while
        the mix is unknown: every batch is then scored as if it were all this class).
        ``running``: per bucket, every class as it runs, filled for the buckets it lacks."""
        shares = self._evidence.mix.shares()
        if not shares:
            return {}
        running = {} if running is None else running
        out: dict[int, BatchOthers] = {}
        for b in range(self._config.n_buckets):
            if b not in running:
                running[b] = {other: o for other, share in shares.items()
                              if (o := self.running(other, share, b, drafts, curves))}
            batch = self._evidence.loads.batch_size(b)
            out[batch] = BatchOthers.build(batch, shares.get(name, 0.0),
                                           (o for other, o in running[b].items()
                                            if other != name))
        return out

    def running(self, name: str, share: float, bucket: int, drafts: tuple[DraftSpec, ...],
                curves: MeanCurves) -> OtherClass | None:
        """Class ``name`` at the arm it runs in ``bucket`` (the joint search's where it has
        one), as another class in the batch; None when it has no share or state."""
        state = self._classes.get(name)
        if share <= 0 or state is None:
            return None
        d = state.decisions.get(bucket)
        draft, k = d.arm if d is not None and runs(drafts, *d.arm) else ("", 0)
        target = self._joint.arm(bucket, name)
        if target is not None and runs(drafts, *target):
            draft, k = target
        e = float(curves(name, draft)[k]) if k else 1.0
        verified = curves.verified_drafts(name, draft) if k else None
        return other_class(share, (draft, k), e, drafts,
                           None if verified is None else float(verified[k]))
