"""How many drafts a deterministic drafter verifies when asked for K: n-gram and suffix drafters
propose only what they find (a short match, or none), so a step asked for K verifies fewer.

Pricing such an arm at K drafts a sequence overstates what its steps cost, the more the longer K:
the arm is then passed over where it pays. The engine counts each (class, draft, K asked)'s
steps by the drafts they verified (``AcceptanceRecord.steps_by_drafted``); this estimator turns
them into the drafts a step verifies at each K, the way acceptance is estimated: per position
i, P(the proposal reaches i | it reached i - 1), from every K asked at least i (so K = 2's
steps tell K = 4's first two positions), with the same forgetting. The drafts a step verifies
at K is then E[min(K, L)] = sum over k <= K of P(L >= k), L the proposal's natural length.

Before evidence, and at positions little evidence reached, the rate leans to 1 (by
``PRIOR_STEPS`` virtual steps that reached it): an arm is never priced below K drafts on a
guess. Model drafts propose K; their records are not kept here.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from specpilot.controller.core.acceptance import decay_factor, position_counts
from specpilot.controller.core.goodput import expected_tokens_curve

FloatArray = npt.NDArray[np.float64]

# Virtual steps per position whose proposals reached it: a handful of real steps outweigh them.
PRIOR_STEPS = 4.0


@dataclass
class _Reached:
    """Decayed counts per position: steps that asked for it and whose proposal reached the one
    before (``tried``), and those whose proposal reached it (``reached``), as of ``at``."""

    tried: FloatArray
    reached: FloatArray
    at: float


class ProposalLengths:
    """Per (class, draft): the drafts a step verifies at each K asked. Time is passed in."""

    def __init__(self, max_k: int, half_life_seconds: float) -> None:
        self.max_k = max_k
        self.half_life_seconds = half_life_seconds
        self._counts: dict[tuple[str, str], _Reached] = {}

    def observe(self, traffic_class: str, draft: str, steps_by_drafted: tuple[int, ...],
                now: float) -> None:
        """One record's steps by drafts verified (validated: K+1 counts, K <= ``max_k``)."""
        if not any(steps_by_drafted):
            return
        tried, reached = position_counts(steps_by_drafted)
        counts = self._at((traffic_class, draft), now)
        k = min(len(tried), self.max_k)
        counts.tried[:k] += tried[:k]
        counts.reached[:k] += reached[:k]

    def verified_drafts(self, traffic_class: str, draft: str, now: float) -> FloatArray:
        """Drafts a step verifies for K = 0..``max_k`` asked (K itself where nothing was
        counted)."""
        counts = self._counts.get((traffic_class, draft))
        if counts is None:
            return np.arange(self.max_k + 1, dtype=np.float64)
        f = decay_factor(self.half_life_seconds, now - counts.at)
        rates = (f * counts.reached + PRIOR_STEPS) / (f * counts.tried + PRIOR_STEPS)
        return expected_tokens_curve(np.clip(rates, 0.0, 1.0)) - 1.0

    def has_data(self, traffic_class: str, draft: str) -> bool:
        return (traffic_class, draft) in self._counts

    def forget_class(self, traffic_class: str) -> None:
        self._counts = {k: v for k, v in self._counts.items() if k[0] != traffic_class}

    def forget_draft(self, draft: str) -> None:
        self._counts = {k: v for k, v in self._counts.items() if k[1] != draft}

    def _at(self, key: tuple[str, str], now: float) -> _Reached:
        counts = self._counts.get(key)
        if counts is None:
            counts = self._counts[key] = _Reached(np.zeros(self.max_k), np.zeros(self.max_k),
                                                  now)
        elif now > counts.at:
            f = decay_factor(self.half_life_seconds, now - counts.at)
            counts.tried *= f
            counts.reached *= f
            counts.at = now
        return counts
