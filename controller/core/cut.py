"""The token cut an engine applies to each request's drafts: what it needs, computed from the
controller's evidence (``TokenCut``).

A drafted token is worth verifying when what it is expected to add pays for what it costs the
step. One more verified token adds ``dt`` seconds to a step that yields ``G`` tokens per second
(the whole batch's); it is accepted, and everything before it, with probability ``s`` (its
survival). The step's rate rises with it exactly when ``s > dt x G``: that product is the
bucket's ``min_survival``. ``dt`` is the step-cost model's mean slope in verified tokens at the
bucket's batch size and the tokens its decisions verify (the drafter's passes are sunk by then:
the cut comes after drafting); ``G`` is the rate without speculation times the decisions' mean
expected speedup, weighted by the classes' shares. Where verifying is free (a small batch on a
memory-bound engine) ``min_survival`` is about 0 and nothing is cut.

Pure: the step prices come in as a function.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from specpilot.contract.records import CalibrationRows, Decision, TokenCut

# (batch size, verified tokens) -> mean step seconds, verification only (no drafter passes)
StepSeconds = Callable[[float, float], float]


def min_survival(batch_size: float, decisions: Iterable[tuple[Decision, float]],
                 seconds: StepSeconds) -> float:
    """The survival a token must reach to be verified at ``batch_size``, for the bucket's
    ``decisions`` with their classes' weights (shares of the batch)."""
    weighted = [(d, w) for d, w in decisions if w > 0]
    total = sum(w for _, w in weighted)
    mean_k = sum(d.k * w for d, w in weighted) / total if total else 0.0
    speedup = sum(max(d.expected_speedup, 0.0) * w for d, w in weighted) / total if total else 1.0
    verified = batch_size * (1.0 + mean_k)
    extra = seconds(batch_size, verified + 1.0) - seconds(batch_size, verified)
    rate = batch_size * max(speedup, 1.0) / seconds(batch_size, batch_size)
    return max(extra, 0.0) * rate


def token_cut(batch_sizes: Iterable[float],
              decisions_by_bucket: Mapping[int, list[tuple[Decision, float]]],
              seconds: StepSeconds, calibrations: Iterable[CalibrationRows]) -> TokenCut:
    """The cut of every bucket (``batch_sizes`` in bucket order)."""
    return TokenCut(
        tuple(min_survival(b, decisions_by_bucket.get(i, []), seconds)
              for i, b in enumerate(batch_sizes)),
        tuple(calibrations))
