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
cut. ``G`` is the decisions' rate: the tokens per second of the step they compose
(``CutPrices.rate``; the drafter included: it is what the step yields).

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

The drafter stops early (``pass_tokens``) where no request's tokens ahead pay for another of its
passes: a pass adds ``dp`` seconds (the draft's price per pass at the batch size, its tokens
included, read off the same formula), worth ``dp x G`` tokens of the step's rate. Unlike a
verification slot a pass is not sunk when the engine decides it, so it is priced even where
verifying is about free (a batch of one, where the passes are most of what a draft costs).

Pure: the step prices and the class's acceptance come in as functions (``CutPrices`` reads them
off the controller's evidence).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping

import numpy as np
import numpy.typing as npt

from specpilot.contract.records import CalibrationRows, Decision, TokenCut
from specpilot.controller.core.cost_model import StepCostModel, StepShape

FloatArray = npt.NDArray[np.float64]

# (batch size, tokens the target verifies) -> mean step seconds (drafting apart: it is sunk)
VerifySeconds = Callable[[int, float], float]
# (batch size, draft) -> the seconds one more pass of the draft adds to a step, its tokens included
PassSeconds = Callable[[int, str], float]
# (batch size, the bucket's decisions with their weights) -> tokens per second of the step they
# compose
StepRate = Callable[[int, "list[tuple[Decision, float]]"], float]
# a speculating decision -> its class's mean survival at its K (mean acceptance multiplied up
# to K), None where unknown
DecisionSurvival = Callable[[Decision], "float | None"]


def min_survival(batch_size: float, decisions: Iterable[tuple[Decision, float]],
                 seconds: VerifySeconds, rate: StepRate,
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
    batch = max(1, round(batch_size))
    plain = seconds(batch, batch)
    drafts = batch * mean_k
    full = seconds(batch, batch + drafts)
    if full - plain <= min_gain * full:
        return 0.0
    threshold = (full - plain) / drafts * rate(batch, weighted)
    caps = [s for d in speculating if (s := survival(d)) is not None]
    return min([threshold, *caps])


def pass_tokens(batch_size: float, decisions: Iterable[tuple[Decision, float]],
                pass_seconds: PassSeconds, rate: StepRate) -> float:
    """The tokens one more drafter pass must be expected to add at ``batch_size`` to be run,
    for the bucket's ``decisions`` with their classes' weights: the decisions' drafts' mean price
    per pass times the decisions' rate (0 where none speculates: nothing is drafted)."""
    weighted = [(d, w) for d, w in decisions if w > 0]
    drafting = [(d, w) for d, w in weighted if d.k > 0 and d.draft]
    if not drafting:
        return 0.0
    batch = max(1, round(batch_size))
    per_pass = sum(pass_seconds(batch, d.draft) * w for d, w in drafting) / sum(
        w for _, w in drafting)
    return max(per_pass, 0.0) * rate(batch, weighted)


def token_cut(batch_sizes: Iterable[float],
              decisions_by_bucket: Mapping[int, list[tuple[Decision, float]]],
              seconds: VerifySeconds, rate: StepRate, calibrations: Iterable[CalibrationRows],
              survival: DecisionSurvival = lambda d: None, min_gain: float = 0.0,
              pass_seconds: PassSeconds | None = None) -> TokenCut:
    """The cut of every bucket (``batch_sizes`` in bucket order); ``pass_seconds`` None: the
    drafter is never stopped early."""
    sizes = list(batch_sizes)
    return TokenCut(
        tuple(min_survival(b, decisions_by_bucket.get(i, []), seconds, rate, survival, min_gain)
              for i, b in enumerate(sizes)),
        tuple(calibrations),
        () if pass_seconds is None else tuple(
            pass_tokens(b, decisions_by_bucket.get(i, []), pass_seconds, rate)
            for i, b in enumerate(sizes)))


class CutPrices:
    """The prices the cut is computed from, read off the step-cost model's mean weights and the
    classes' mean acceptance (``means``: per (class, draft), by position) at one instant:
    ``seconds`` (``VerifySeconds``), ``pass_seconds``, ``survival`` and ``rate`` (``StepRate``:
    the step the bucket's decisions compose, each class's expected tokens at its K, the target
    verifying every draft, the most drafting model draft running the largest K asked of it for
    every sequence, as a per-request engine drafts)."""

    def __init__(self, cost: StepCostModel, means: Mapping[tuple[str, str], FloatArray],
                 model_drafts: Collection[str]) -> None:
        self._cost = cost
        self._means = means
        self._model = model_drafts

    def seconds(self, batch_size: int, verified_tokens: float) -> float:
        return self._cost.predict(StepShape(batch_size, verified_tokens))

    def pass_seconds(self, batch_size: int, draft: str) -> float:
        one, two = (self._cost.predict(StepShape(batch_size, batch_size, draft, passes,
                                                 batch_size * passes)) for passes in (1, 2))
        return two - one

    def survival(self, decision: Decision) -> float | None:
        mean = self._means.get((decision.traffic_class, decision.draft))
        return None if mean is None or mean.size < decision.k else float(
            np.prod(mean[:decision.k]))

    def rate(self, batch_size: int, weighted: list[tuple[Decision, float]]) -> float:
        total = sum(w for _, w in weighted)
        tokens = verified = 0.0
        passes: dict[str, float] = {}
        for d, w in weighted:
            mean = self._means.get((d.traffic_class, d.draft)) if d.k > 0 else None
            k = 0 if mean is None else min(d.k, mean.size)
            gained = 0.0 if mean is None else float(np.cumprod(mean[:k]).sum())
            tokens += w / total * (1.0 + gained)
            verified += w / total * (1 + k)
            if k and d.draft in self._model:
                passes[d.draft] = max(passes.get(d.draft, 0), k)
        drafter = max(passes, key=lambda n: passes[n], default="")
        drafted = passes.get(drafter, 0.0)
        step = self._cost.predict(StepShape(batch_size, batch_size * verified, drafter, drafted,
                                            batch_size * drafted))
        return batch_size * tokens / step
