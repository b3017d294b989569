"""The controller's predicted step times against the engine's measured ones, per batch bucket and
K, from the sidecar's one-step-ahead counters (``specpilot_cost_model_*`` in
controller/metrics.py: each step-timing record priced by the cost model just before it learnt
the record). Pure: the benchmark reads the counters, this module turns them into rows."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from specpilot.contract.buckets import batch_range

# (bucket, K) -> summed value of one counter.
Counters = Mapping[tuple[int, int], float]
# A cell within this relative error counts as calibrated (the goal: the cost model predicts the
# engine's step times within 10%).
GOAL_ERROR = 0.10


@dataclass(frozen=True)
class CalibrationRow:
    bucket: int
    batch_sizes: str  # the bucket's range of batch sizes, e.g. "9-16"
    k: int
    steps: float
    predicted_seconds: float  # mean per step
    measured_seconds: float

    @property
    def error(self) -> float:
        """predicted / measured - 1 (positive: the model prices the step too high)."""
        return self.predicted_seconds / self.measured_seconds - 1.0


def calibration_rows(steps: Counters, predicted: Counters, measured: Counters,
                     upper_bounds: Sequence[int]) -> tuple[CalibrationRow, ...]:
    bounds = tuple(upper_bounds)
    rows = []
    for (bucket, k), n in sorted(steps.items()):
        m = measured.get((bucket, k), 0.0)
        if n <= 0 or m <= 0:
            continue
        label = batch_range(bounds, bucket) if 0 <= bucket <= len(bounds) else str(bucket)
        rows.append(CalibrationRow(bucket, label, k, n, predicted.get((bucket, k), 0.0) / n,
                                   m / n))
    return tuple(rows)


def calibration_json(rows: Sequence[CalibrationRow]) -> list[dict[str, float | int | str]]:
    """The rows as a benchmark's result JSON holds them."""
    return [{"bucket": r.bucket, "batch_sizes": r.batch_sizes, "k": r.k, "steps": r.steps,
             "predicted_seconds": r.predicted_seconds, "measured_seconds": r.measured_seconds}
            for r in rows]


def share_within(rows: Sequence[CalibrationRow], tolerance: float = GOAL_ERROR) -> float:
    """Share of the timed steps whose cell the model predicts within ``tolerance`` (NaN: none)."""
    total = sum(r.steps for r in rows)
    if total <= 0:
        return math.nan
    return sum(r.steps for r in rows if abs(r.error) <= tolerance) / total


def calibration_markdown(name: str, rows: Sequence[CalibrationRow]) -> list[str]:
    """The lines of the calibration table of configuration ``name``, with its share within
    ``GOAL_ERROR``."""
    within = share_within(rows)
    return [f"{name}'s controller: predicted step times against the measured ones (each of the "
            "engine's step-timing records priced by the cost model just before it learnt it, "
            "over all of its runs; `specpilot_cost_model_*` metrics):", "",
            "| batch | K | steps | predicted ms | measured ms | error |",
            "|---|---|---|---|---|---|",
            *(f"| {r.batch_sizes} | {r.k} | {r.steps:.0f} | {r.predicted_seconds * 1e3:.2f} | "
              f"{r.measured_seconds * 1e3:.2f} | {r.error:+.1%} |" for r in rows), "",
            f"- steps in cells predicted within {GOAL_ERROR:.0%}: "
            f"**{'-' if math.isnan(within) else f'{within:.3f}'}**", ""]
