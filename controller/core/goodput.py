"""Expected tokens per verification step and the goodput/speedup of a (draft, K) arm.

With conditional per-position acceptance rates b_1..b_K (b_i = P(accept i | accepted 1..i-1)):
    E(K) = 1 + sum_{k=1..K} prod_{i<=k} b_i
Uniform a gives the closed form (1 - a^(K+1)) / (1 - a).
"""

from __future__ import annotations

from typing import TypeVar

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]
# goodput and speedup work elementwise on arrays of arms as well as on single numbers.
Num = TypeVar("Num", float, FloatArray)


def expected_tokens_curve(rates: npt.ArrayLike) -> FloatArray:
    """E(K) for K = 0..len(rates): tokens emitted per verification step (bonus token included)."""
    b = np.asarray(rates, dtype=np.float64)
    return np.concatenate(([1.0], 1.0 + np.cumsum(np.cumprod(b))))


def expected_tokens(rates: npt.ArrayLike, k: int) -> float:
    """E(k) for the first k positions of ``rates``."""
    b = np.asarray(rates, dtype=np.float64)
    if not 0 <= k <= b.size:
        raise ValueError(f"k={k} outside 0..{b.size}")
    return float(expected_tokens_curve(b[:k])[k])


def goodput(expected: Num, batch_size: int, step_seconds: Num) -> Num:
    """Accepted (emitted) tokens per second for a batch where every sequence runs this arm."""
    return expected * batch_size / step_seconds


def speedup(expected: Num, step_seconds: Num, plain_step_seconds: float) -> Num:
    """Speedup over no speculation: E(K) x plain step time / step time with drafting."""
    return expected * plain_step_seconds / step_seconds
