"""The token cut an engine applies to each request's drafts: what it needs, computed from the
controller's evidence (``TokenCut``).

When the engine cuts, the drafts exist: the drafter's passes are paid whatever is verified, so
a cut saves only verification. A slot (one drafted token of one request) adds ``dt`` seconds of
verification to a step that yields ``G`` tokens per second, and is accepted, with everything
before it, with probability ``s`` (its survival). The step's rate rises with the slot exactly
when ``s > dt x G``: that product is the bucket's ``min_survival``, the rule of a global top-k
of the step's slots by survival (verification slots are alike whichever request they serve, so
one threshold per batch size serves every class).

``dt`` is the target's verification price per slot, read off the step-cost model's mean
weights (the one pricing formula) between the step without drafts and the step the decisions
verify in full: the mean slope over the range the cut moves the step in. The hinge of a
compute-bound engine makes the slot dearer near the decisions' full drafts than below; the
mean is what a cut that removes some of the slots saves per slot, and the step is never priced
beyond the K the decisions chose (where the learned slope is an extrapolation). Where verifying
is about free (a memory-bound batch) ``dt`` and so ``min_survival`` are about 0 and nothing is
cut. ``G`` is the decisions' rate: the rate without speculation times their mean expected
speedup, weighted by the classes' shares (the drafter included: it is what the step yields).

A decision chose its K because its last token pays for its verification and its drafting on
average, so the threshold is never above the class's own mean survival at that K (the product
of its mean acceptance up to K): a request whose tokens are as likely as the class's keeps the
K its decision paid the drafter for, and only the less likely ones are shortened. (A decision
that pays its drafter while the cut would verify nothing contradicts itself; this cap rules it
out whatever the cost model's error.) Calibrations hold a prior at the class's acceptance, so
a confidence bucket counted rarely reads about the class's mean and is not cut either. And
where verifying every decided draft takes less of the step than the gain a decision needs over
no speculation (``min_speedup``), the most the cut could save is inside the cost model's error,
and what it costs is not: each cut moves the evidence the decisions learn from (the steps'
verified tokens, the class's acceptance). Nothing is cut there.

Pure: the step prices and the class's acceptance come in as functions.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from specpilot.contract.records import CalibrationRows, Decision, TokenCut

# (batch size, tokens the target verifies) -> mean step seconds (drafting apart: it is sunk)
VerifySeconds = Callable[[int, float], float]
# a speculating decision -> its class's mean survival at its K (mean acceptance multiplied up
# to K), None where unknown
DecisionSurvival = Callable[[Decision], "float | None"]


def min_survival(batch_size: float, decisions: Iterable[tuple[Decision, float]],
                 seconds: VerifySeconds,
                 survival: DecisionSurvival = lambda d: None, min_gain: float = 0.0) -> float:
    """The survival a token must reach to be verified at ``batch_size``, for the bucket's
    ``decisions`` with their classes' weights (shares of the batch); 0 (nothing cut) where
    verifying all their drafts takes less than ``min_gain`` of the step (a fraction)."""
    weighted = [(d, w) for d, w in decisions if w > 0]
    speculating = [d for d, w in weighted if d.k > 0 and d.draft]
    if not speculating:
        return 0.0
    total = sum(w for _, w in weighted)
    mean_k = sum(d.k * w for d, w in weighted if d.k > 0 and d.draft) / total
    speedup = sum(max(d.expected_speedup, 0.0) * w for d, w in weighted) / total
    batch = max(1, round(batch_size))
    plain = seconds(batch, batch)
    drafts = batch * mean_k
    full = seconds(batch, batch + drafts)
    if full - plain <= min_gain * full:
        return 0.0
    per_slot = (full - plain) / drafts
    threshold = per_slot * batch * max(speedup, 1.0) / plain
    caps = [s for d in speculating if (s := survival(d)) is not None]
    return min([threshold, *caps])


def token_cut(batch_sizes: Iterable[float],
              decisions_by_bucket: Mapping[int, list[tuple[Decision, float]]],
              seconds: VerifySeconds, calibrations: Iterable[CalibrationRows],
              survival: DecisionSurvival = lambda d: None, min_gain: float = 0.0) -> TokenCut:
    """The cut of every bucket (``batch_sizes`` in bucket order)."""
    return TokenCut(
        tuple(min_survival(b, decisions_by_bucket.get(i, []), seconds, survival, min_gain)
              for i, b in enumerate(batch_sizes)),
        tuple(calibrations))
