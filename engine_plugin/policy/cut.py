"""The token cut, engine side: how many of a request's drafts are worth verifying, from the
drafter's confidence in each token and the controller's ``TokenCut`` (``controller.core.cut``
says why the rule is what it is).

Each token's chance of acceptance is read from the calibration of the request's class and draft
at its position and confidence bucket; the survival of position p is the product up to p. The
drafts are cut before the first position whose survival falls below the bucket's
``min_survival``. Only ever shortens: the class's decision (draft, K, off, overrides) cut first.
Pure; microseconds per request.
"""

from __future__ import annotations

from collections.abc import Sequence

from specpilot.contract.confidence import N_CONFIDENCE_BUCKETS, confidence_bucket
from specpilot.contract.records import CalibrationRows, TokenCut


def cut_length(confidences: Sequence[float], rows: CalibrationRows,
               min_survival: float) -> int:
    """The drafts (of those ``confidences`` describe, in order) worth verifying. Positions the
    calibration does not cover are kept."""
    survival = 1.0
    accept = rows.accept
    for position, confidence in enumerate(confidences):
        if position >= rows.positions:
            break
        survival *= accept[position * N_CONFIDENCE_BUCKETS + confidence_bucket(confidence)]
        if survival < min_survival:
            return position
    return len(confidences)


class CutTable:
    """A ``TokenCut`` indexed for the scheduler: calibration rows by (class, draft,
    transformed), checked once when the policy arrives (a malformed one is dropped whole)."""

    def __init__(self, cut: TokenCut) -> None:
        rows: dict[tuple[str, str, bool], CalibrationRows] = {}
        for r in cut.calibrations:
            if (r.positions < 0 or len(r.accept) != r.positions * N_CONFIDENCE_BUCKETS
                    or not all(0.0 <= a <= 1.0 for a in r.accept)):
                raise ValueError(f"calibration of {r.traffic_class!r}/{r.draft!r}: "
                                 f"{len(r.accept)} values for {r.positions} positions")
            rows[(r.traffic_class, r.draft, r.transformed)] = r
        if not all(s >= 0.0 for s in cut.min_survival):  # NaN fails too
            raise ValueError("min_survival: every value must be a number >= 0")
        self.min_survival = cut.min_survival
        self._rows = rows

    @property
    def any_rows(self) -> bool:
        return bool(self._rows)

    def rows(self, traffic_class: str, draft: str, transformed: bool) -> CalibrationRows | None:
        return self._rows.get((traffic_class, draft, transformed))
