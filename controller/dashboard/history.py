"""Acceptance estimates over time, for the dashboard's band chart: a bounded sample per class of
the posterior mean and credible interval of the first positions of each draft with evidence, so
a page opened now still shows the last hour. Fed snapshots; pure (no clock, no I/O)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from specpilot.controller.core.beta import credible_bounds_of
from specpilot.controller.core.snapshot import CoreSnapshot

POSITIONS_KEPT = 4  # the chart draws the first four positions


@dataclass(frozen=True)
class EstimateSample:
    at: float  # seconds since the Unix epoch
    draft: str
    # Per position 1..POSITIONS_KEPT (fewer where the draft has fewer): (mean, lower, upper).
    positions: tuple[tuple[float, float, float], ...]


class EstimateHistory:
    def __init__(self, samples_per_class: int, credible_level: float) -> None:
        self._size = samples_per_class
        self._level = credible_level
        self._samples: dict[str, deque[tuple[EstimateSample, ...]]] = {}

    def record(self, snap: CoreSnapshot) -> None:
        """One sample of every class's estimates with evidence; classes no longer tracked are
        dropped."""
        tracked = {c.name for c in snap.classes}
        for name in [n for n in self._samples if n not in tracked]:
            del self._samples[name]
        shown = [(c.name, e) for c in snap.classes for e in c.estimates if e.has_evidence]
        # Every interval in one vectorised pass (one call per estimate cost the loop over a
        # second a sample at 256 classes x 16 drafts).
        bounds = credible_bounds_of([e.alpha[:min(POSITIONS_KEPT, e.positions)] for _, e in shown],
                                    [e.beta[:min(POSITIONS_KEPT, e.positions)] for _, e in shown],
                                    self._level)
        samples: dict[str, list[EstimateSample]] = {}
        for (name, est), (lower, upper) in zip(shown, bounds, strict=True):
            mean = est.mean
            samples.setdefault(name, []).append(EstimateSample(snap.at, est.draft, tuple(
                (round(float(mean[i]), 4), round(float(lower[i]), 4), round(float(upper[i]), 4))
                for i in range(len(lower)))))
        for name, sample in samples.items():
            self._samples.setdefault(name, deque(maxlen=self._size)).append(tuple(sample))

    def of(self, traffic_class: str) -> list[EstimateSample]:
        """The class's samples, oldest first (every draft's, flattened)."""
        return [s for sample in self._samples.get(traffic_class, ()) for s in sample]
