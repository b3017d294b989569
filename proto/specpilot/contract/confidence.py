"""The draft's confidence in a drafted token, bucketed the same way by the engine that counts and
the controller that calibrates: the draft model's probability of the token it proposed (its
largest probability under greedy drafting).

The buckets are narrower towards 1, where a drafter's tokens crowd and where the choice between
verifying one more position or not is made. Pure.
"""

from __future__ import annotations

import bisect

import numpy as np
import numpy.typing as npt

CONFIDENCE_EDGES = (0.0, 0.2, 0.4, 0.6, 0.75, 0.85, 0.93, 0.98, 1.0)
N_CONFIDENCE_BUCKETS = len(CONFIDENCE_EDGES) - 1
_INNER_EDGES = np.asarray(CONFIDENCE_EDGES[1:-1])
_INNER_EDGE_LIST = list(CONFIDENCE_EDGES[1:-1])


def confidence_bucket(confidence: float) -> int:
    """``confidence_buckets`` of one value, without numpy (the engine's hot path)."""
    if not 0.0 <= confidence <= 1.0:  # NaN fails too
        raise ValueError(f"confidence: {confidence!r} is not a probability in [0, 1]")
    return bisect.bisect_right(_INNER_EDGE_LIST, confidence)


def confidence_buckets(confidence: npt.ArrayLike) -> npt.NDArray[np.int64]:
    """The bucket of each confidence in [0, 1] (a bucket holds its lower edge; 1.0 the last).
    ValueError for a value outside [0, 1] or not finite: a drafter's probability never is."""
    q = np.asarray(confidence, dtype=np.float64)
    if q.size and not (np.isfinite(q).all() and q.min() >= 0.0 and q.max() <= 1.0):
        raise ValueError("confidence: every value must be a probability in [0, 1]")
    return np.searchsorted(_INNER_EDGES, q, side="right").astype(np.int64)


def bucket_midpoints() -> npt.NDArray[np.float64]:
    """Each bucket's middle confidence: what a calibrated draft's tokens in it are accepted at."""
    edges = np.asarray(CONFIDENCE_EDGES)
    return np.asarray((edges[:-1] + edges[1:]) / 2.0, dtype=np.float64)
