"""The traffic mix of a batch, and what the rest of a batch costs and yields while one class picks
its arm.

Why: a model drafter runs as many sequential passes as the largest K any sequence of the step asks
of it, so a pass another class already pays for is nearly free for this class, and a class that
lengthens its drafts slows every other sequence's step too. Scoring a class's arms as if the
batch were all that class (the homogeneous view) misses both. With the mix known, a class's arm is
scored by the whole batch's goodput, the other classes held at their current choices: repeated
every decide round, this is coordinate ascent toward the batch optimum.

The mix comes from finished-request summaries the engine already sends: a request decoded for
about ``output_tokens - accepted_tokens`` steps (every step emits its accepted drafts plus one).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]


class ClassMix:
    """Decayed decode request-steps per class: their shares are the batch mix."""

    def __init__(self, half_life_seconds: float) -> None:
        self.half_life_seconds = half_life_seconds
        self._steps: dict[str, float] = {}
        self._at: float | None = None

    def observe(self, traffic_class: str, request_steps: float, now: float) -> None:
        if self._at is not None and now > self._at:
            f = float(2.0 ** (-(now - self._at) / self.half_life_seconds))
            for name in self._steps:
                self._steps[name] *= f
        self._at = now if self._at is None else max(self._at, now)
        self._steps[traffic_class] = self._steps.get(traffic_class, 0.0) + max(request_steps, 0.0)

    def shares(self) -> dict[str, float]:
        total = sum(self._steps.values())
        return {c: s / total for c, s in self._steps.items()} if total > 0 else {}

    def forget(self, traffic_class: str) -> None:
        self._steps.pop(traffic_class, None)


@dataclass(frozen=True)
class OtherClass:
    """Another class in the batch as it runs now."""

    share: float
    draft: str  # "" when off
    draft_is_model: bool
    k: int
    expected_tokens: float  # E(K) per step of its sequences under its current arm


@dataclass(frozen=True)
class BatchOthers:
    """The expected rest of a batch of ``batch_size`` around one sequence of the class deciding.

    ``self_count`` sequences run the deciding class's arm (this one plus its share of the rest);
    the others contribute fixed tokens, verified tokens and draft tokens, and the model drafts'
    passes as a distribution: with probability ``p`` some other sequence needs ``k`` passes.
    """

    batch_size: int
    self_count: float
    tokens: float
    verified_tokens: float
    draft_tokens: dict[str, float]
    # Per model draft: (passes, probability that the others' largest K for it is exactly that).
    passes: dict[str, tuple[tuple[int, float], ...]]

    @classmethod
    def build(cls, batch_size: int, own_share: float, others: Iterable[OtherClass]) -> BatchOthers:
        rest = max(batch_size - 1, 0)
        n_self = 1.0 + own_share * rest
        tokens = verified = 0.0
        draft_tokens: dict[str, float] = {}
        present: dict[str, list[tuple[int, float]]] = {}
        for o in others:
            n = o.share * rest
            tokens += n * o.expected_tokens
            verified += n * (1 + o.k)
            if o.k > 0 and o.draft_is_model:
                draft_tokens[o.draft] = draft_tokens.get(o.draft, 0.0) + n * o.k
                # P(at least one of the other sequences is of this class).
                present.setdefault(o.draft, []).append((o.k, 1.0 - (1.0 - o.share) ** rest))
        passes: dict[str, tuple[tuple[int, float], ...]] = {}
        for draft, entries in present.items():
            dist, none = [], 1.0
            for k, p in sorted(entries, reverse=True):
                dist.append((k, none * p))
                none *= 1.0 - p
            passes[draft] = tuple(dist)
        return cls(batch_size, n_self, tokens, verified, draft_tokens, passes)

    def expected_passes(self, draft: str, own_k: npt.ArrayLike) -> FloatArray:
        """E[max(own K, the others' largest K)] for ``draft``, per own K."""
        own = np.asarray(own_k, dtype=np.float64)
        out = np.zeros_like(own)
        none = 1.0
        for k, p in self.passes.get(draft, ()):
            out += p * np.maximum(own, k)
            none -= p
        return np.asarray(out + max(none, 0.0) * own, dtype=np.float64)
