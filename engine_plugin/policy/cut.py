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

import math
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


# Gains within this fraction of what the class's mean tokens would gain count as the mean's: the
# two come from one calibration, and a difference inside its error (cells still near their
# prior, a cold controller's) must not stop the drafter at a K its decision chose.
_PAR_BAND = 0.05


class DrafterStop:
    """The drafter's early stop for one step: after each of its passes, whether another pays.

    A model drafter drafts position p of every request in its p-th pass, so a pass is worth
    running while what the requests still being drafted are expected to gain from it (and from
    the passes it makes possible) pays for it. Each request is priced as the cut prices its
    tokens: its survival so far (the calibrated chance that every token up to now is accepted)
    times the class's mean acceptance at each position ahead (those tokens are not drafted
    yet), less ``min_survival`` per slot (their verification); a pass costs ``pass_tokens``.
    The next pass pays when, for some horizon h, the requests' gains over the next h positions
    exceed h passes, or come within ``_PAR_BAND`` of what they would gain with the class's mean
    tokens: a decision chose its K at the mean, so tokens as likely as the class's keep the K it
    paid for whatever the two estimates of a pass's worth say, and only less likely ones stop
    the drafter.

    A request whose survival fell below ``min_survival`` is cut there and wants nothing more, a
    request at its decided K neither; one the cut does not cover (no calibration, no mean
    acceptance, or positions beyond its calibration) wants every pass up to its K, as without
    a stop. Only ever shortens: the passes never exceed the largest K asked. Pure; a few
    microseconds per request and pass."""

    def __init__(self, requests: Sequence[tuple[CalibrationRows | None, int]],
                 min_survival: float, pass_tokens: float) -> None:
        """``requests``: per request in the drafter's row order, its calibration rows (None:
        not cut) and the K its decision asks of the drafter."""
        self._rows = [r if r is not None and r.mean_accept else None for r, _ in requests]
        self._k = [k for _, k in requests]
        self._survival = [1.0] * len(requests)
        self._min = min_survival
        self._pass = pass_tokens
        self.passes = 0

    def after_pass(self, confidences: Sequence[float]) -> bool:
        """Count the pass just run (``confidences``: each request's confidence in the token it
        drafted, row order); True when the next pass pays."""
        self.passes = position = self.passes + 1
        # Per request still drafting: (its gain, the class mean's) over 1, 2, ... positions.
        gains: list[list[tuple[float, float]]] = []
        # Once one request pays for the next pass, the others' survivals are still brought up
        # to this pass: a later pass prices them from their every token.
        pays = False
        for i, rows in enumerate(self._rows):
            k = self._k[i]
            if k <= position:
                continue
            if rows is None or position > rows.positions:
                pays = True
                continue
            survival = self._survival[i] * rows.accept[
                (position - 1) * N_CONFIDENCE_BUCKETS + confidence_bucket(confidences[i])]
            self._survival[i] = survival
            if survival < self._min:
                self._k[i] = 0  # cut here, and survival only falls
                continue
            if pays or k > rows.positions:
                pays = True
                continue
            ahead = self._ahead(survival, math.prod(rows.mean_accept[:position]),
                                rows.mean_accept[position:k])
            if ahead is None:
                pays = True  # this request alone pays for the passes
                continue
            gains.append(ahead)
        if pays:
            return True
        # Past its K a request's gains stay what they reached.
        for h in range(max((len(g) for g in gains), default=0)):
            gain = sum(g[min(h, len(g) - 1)][0] for g in gains)
            par = sum(g[min(h, len(g) - 1)][1] for g in gains)
            if gain > (h + 1) * self._pass or (par > 0.0 and gain >= par * (1.0 - _PAR_BAND)):
                return True
        return False

    def _ahead(self, survival: float, mean: float, accept: Sequence[float]
               ) -> list[tuple[float, float]] | None:
        """A request's (gain, the class mean's gain) over 1, 2, ... positions ahead; None
        where its own gain alone pays for the passes."""
        out, gain, par = [], 0.0, 0.0
        for h, a in enumerate(accept):
            survival *= a
            mean *= a
            gain += max(survival - self._min, 0.0)
            par += max(mean - self._min, 0.0)
            if gain > (h + 1) * self._pass:
                return None
            out.append((gain, par))
        return out


class CutTable:
    """A ``TokenCut`` indexed for the scheduler: calibration rows by (class, draft,
    transformed), checked once when the policy arrives (a malformed one is dropped whole)."""

    def __init__(self, cut: TokenCut) -> None:
        rows: dict[tuple[str, str, bool], CalibrationRows] = {}
        for r in cut.calibrations:
            if (r.positions < 0 or len(r.accept) != r.positions * N_CONFIDENCE_BUCKETS
                    or not all(0.0 <= a <= 1.0 for a in (*r.accept, *r.mean_accept))
                    or len(r.mean_accept) not in (0, r.positions)):
                raise ValueError(f"calibration of {r.traffic_class!r}/{r.draft!r}: "
                                 f"{len(r.accept)} values and {len(r.mean_accept)} means for "
                                 f"{r.positions} positions, each a probability")
            rows[(r.traffic_class, r.draft, r.transformed)] = r
        if not all(s >= 0.0 for s in cut.min_survival):  # NaN fails too
            raise ValueError("min_survival: every value must be a number >= 0")
        if not all(0.0 <= t < math.inf for t in cut.pass_tokens):
            raise ValueError("pass_tokens: every value must be a finite number >= 0")
        self.min_survival = cut.min_survival
        self.pass_tokens = cut.pass_tokens
        self._rows = rows

    @property
    def any_rows(self) -> bool:
        return bool(self._rows)

    def rows(self, traffic_class: str, draft: str, transformed: bool) -> CalibrationRows | None:
        return self._rows.get((traffic_class, draft, transformed))
