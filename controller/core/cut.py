"""The token cut an engine applies to each request's drafts: what it needs, computed from the
controller's evidence (``TokenCut``).

A drafted token is worth verifying when what it is expected to add pays for what it costs the
step. One more verified token per request adds ``dt`` seconds per request to a step that
yields ``G`` tokens per second (the whole batch's); it is accepted, and everything before it,
with probability ``s`` (its survival). The step's rate rises with it exactly when
``s > dt x G``: that product is the bucket's ``min_survival``. ``dt`` is read off the arm prices
the decisions themselves are taken on (one K more for every sequence of the batch, divided by
the batch size, at the bucket's decided draft and mean K), so the cut never contradicts them: a
K the decisions chose because its last token pays on average is cut only for the requests
whose own tokens are less likely than average. ``G`` is the rate without speculation times the
decisions' mean expected speedup, weighted by the classes' shares. Where verifying is free (a
small batch on a memory-bound engine) ``min_survival`` is about 0 and nothing is cut.

Pure: the step prices come in as a function.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping

from specpilot.contract.records import CalibrationRows, Decision, TokenCut

# (batch size, draft, K) -> mean step seconds, as decisions price their arms
ArmSeconds = Callable[[int, str, int], float]


def min_survival(batch_size: float, decisions: Iterable[tuple[Decision, float]],
                 seconds: ArmSeconds) -> float:
    """The survival a token must reach to be verified at ``batch_size``, for the bucket's
    ``decisions`` with their classes' weights (shares of the batch)."""
    weighted = [(d, w) for d, w in decisions if w > 0]
    speculating = [(d, w) for d, w in weighted if d.k > 0 and d.draft]
    if not speculating:
        return 0.0
    by_draft: dict[str, float] = {}
    for d, w in speculating:
        by_draft[d.draft] = by_draft.get(d.draft, 0.0) + w
    draft = max(sorted(by_draft), key=lambda name: by_draft[name])
    total = sum(w for _, w in weighted)
    mean_k = sum(d.k * w for d, w in speculating) / sum(w for _, w in speculating)
    speedup = sum(max(d.expected_speedup, 0.0) * w for d, w in weighted) / total
    batch = max(1, round(batch_size))
    k = max(1, math.floor(mean_k))
    extra = (seconds(batch, draft, k + 1) - seconds(batch, draft, k)) / batch
    rate = batch * max(speedup, 1.0) / seconds(batch, "", 0)
    return max(extra, 0.0) * rate


def token_cut(batch_sizes: Iterable[float],
              decisions_by_bucket: Mapping[int, list[tuple[Decision, float]]],
              seconds: ArmSeconds, calibrations: Iterable[CalibrationRows]) -> TokenCut:
    """The cut of every bucket (``batch_sizes`` in bucket order)."""
    return TokenCut(
        tuple(min_survival(b, decisions_by_bucket.get(i, []), seconds)
              for i, b in enumerate(batch_sizes)),
        tuple(calibrations))
