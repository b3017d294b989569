"""The joint search's schedule and results: per bucket, the arms that make the expected batch
fastest (``mix.joint_arms``).

Each class then scores its own arms with the others at these arms, so the per-class decisions
(with their Thompson draws, hysteresis and dwell) land on the batch optimum instead of stalling
where only a joint move gains. A search costs ~10-50 ms a bucket with many classes, so a round
refreshes only the stalest buckets.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from specpilot.contract.records import DraftSpec
from specpilot.controller.core.class_table import ClassTable
from specpilot.controller.core.config import CoreConfig
from specpilot.controller.core.engines import EngineRegistry
from specpilot.controller.core.evidence import Evidence, MeanCurves
from specpilot.controller.core.mix import Arm, JointClass, joint_arms
from specpilot.controller.core.overrides import Overrides
from specpilot.controller.core.policy import runs

# Buckets the joint search may refresh in one decide round (the rest wait for later rounds).
JOINT_BUCKETS_PER_DECIDE = 2


class JointSearch:
    def __init__(self, config: CoreConfig, engines: EngineRegistry, classes: ClassTable,
                 overrides: Overrides, evidence: Evidence) -> None:
        self._config = config
        self._engines = engines
        self._classes = classes
        self._overrides = overrides
        self._evidence = evidence
        # Per bucket: the arms of the best whole batch, and when its search ran.
        self._arms: dict[int, dict[str, Arm]] = {}
        self._at: dict[int, float] = {}

    def arm(self, bucket: int, traffic_class: str) -> Arm | None:
        """The class's arm in the bucket's best batch, if the search placed it."""
        return self._arms.get(bucket, {}).get(traffic_class)

    def arms(self) -> dict[int, dict[str, Arm]]:
        """Per bucket searched, every class's arm (a copy)."""
        return {b: dict(arms) for b, arms in self._arms.items()}

    def forget_class(self, name: str) -> None:
        for arms in self._arms.values():
            arms.pop(name, None)

    def forget_drafts(self, names: Iterable[str]) -> None:
        gone = set(names)
        for arms in self._arms.values():
            for cls in [c for c, arm in arms.items() if arm[0] in gone]:
                del arms[cls]

    def refresh(self, drafts: tuple[DraftSpec, ...], now: float, curves: MeanCurves,
                max_buckets: int | None = None) -> None:
        """Rerun the search for the buckets whose result is older than
        joint_interval_seconds, at most ``JOINT_BUCKETS_PER_DECIDE`` (stalest first) unless
        ``max_buckets`` says otherwise; every bucket at once after a detected change, unless
        ``max_buckets`` bounds the call. Batch size 1 has no others; per-request engines
        draft max K for everyone anyway (the homogeneous view is exact)."""
        shares = self._evidence.mix.shares()
        if not shares or self._engines.sunk_draft() is not None:
            return
        config, loads = self._config, self._evidence.loads
        interval = config.policy.joint_interval_seconds
        buckets = [b for b in range(config.n_buckets) if loads.batch_size(b) > 1]
        changed = any(s.change_pending for _, s in self._classes)
        if changed and max_buckets is None:
            due = buckets
        else:
            stale = [b for b in buckets
                     if changed or now - self._at.get(b, -math.inf) >= interval]
            stale.sort(key=lambda b: self._at.get(b, -math.inf))
            due = stale[:JOINT_BUCKETS_PER_DECIDE if max_buckets is None else max_buckets]
        if not due:
            return
        estimator = self._evidence.estimator
        classes = []
        for name, share in shares.items():
            state = self._classes.get(name)
            if state is None or share <= 0:
                continue
            free = (name not in config.offline_classes
                    and self._overrides.in_force(name) is None
                    and any(estimator.has_data(name, d.name) for d in drafts))
            by_draft = {d.name: curves(name, d.name) for d in drafts}
            verified = {d.name: v for d in drafts
                        if (v := curves.verified_drafts(name, d.name)) is not None}
            classes.append((name, share, by_draft, verified, state, free))
        if sum(free for *_, free in classes) < 2:
            return  # one class alone: its own decision is already the batch's best
        for b in due:
            self._at[b] = now
            joint = []
            for name, share, by_draft, verified, state, free in classes:
                d = state.decisions.get(b)
                # A decision from before an engine left or reconnected with a smaller max K
                # may name an arm no engine offers: the search starts that class off.
                arm = d.arm if d is not None and runs(drafts, *d.arm) else ("", 0)
                joint.append(JointClass(name, share, by_draft, arm, free, verified))
            self._arms[b] = joint_arms(loads.batch_size(b), joint, drafts,
                                       config.policy.max_k, self._evidence.cost.predict_mixed)
