"""The real benchmark's traffic plan (pure): held-out ShareGPT requests of every class, mixed
by the classes' shares, in load phases of closed-loop concurrency. The same plan replays on
every configuration, so greedy outputs compare text for text."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from benchmarks.real.sharegpt import CLASSES, RealClass, TrafficRequest


@dataclass(frozen=True)
class LoadPhase:
    name: str
    concurrency: int
    requests: int


# Light, a burst, a peak, light again: the regime speculation lives in, then the one it does not.
PHASES: tuple[LoadPhase, ...] = (LoadPhase("light", 1, 3), LoadPhase("burst", 16, 24),
                                 LoadPhase("peak", 32, 32), LoadPhase("light-again", 1, 3))
# Output tokens per request at most (each class's own cap may be lower).
MAX_TOKENS = 128


def scaled(phases: Sequence[LoadPhase], factor: float) -> tuple[LoadPhase, ...]:
    """``phases`` with ``factor`` times as many requests (at least 1 each)."""
    return tuple(LoadPhase(p.name, p.concurrency, max(1, round(p.requests * factor)))
                 for p in phases)


def class_counts(classes: Sequence[RealClass], n: int) -> dict[str, int]:
    """``n`` requests split by the classes' shares (largest remainder)."""
    total = sum(c.share for c in classes)
    want = {c.name: c.share / total * n for c in classes}
    counts = {k: int(v) for k, v in want.items()}
    for name in sorted(want, key=lambda k: counts[k] - want[k])[: n - sum(counts.values())]:
        counts[name] += 1
    return counts


def build_plan(heldout: Mapping[str, Sequence[TrafficRequest]],
               phases: Sequence[LoadPhase] = PHASES, seed: int = 0,
               classes: Sequence[RealClass] = CLASSES) -> list[list[TrafficRequest]]:
    """The requests of each phase: distinct held-out requests, shuffled, deterministic in
    ``seed``. Raises ValueError when a class has too few held-out requests."""
    rng = random.Random(seed)
    pools = {c.name: rng.sample(list(heldout[c.name]), len(heldout[c.name])) for c in classes}
    taken = dict.fromkeys(pools, 0)
    plan: list[list[TrafficRequest]] = []
    for phase in phases:
        chosen: list[TrafficRequest] = []
        for name, count in class_counts(classes, phase.requests).items():
            start = taken[name]
            if start + count > len(pools[name]):
                raise ValueError(f"class {name!r} has {len(pools[name])} held-out requests; "
                                 f"the plan needs more")
            chosen += pools[name][start:start + count]
            taken[name] = start + count
        rng.shuffle(chosen)
        plan.append(chosen)
    return plan
