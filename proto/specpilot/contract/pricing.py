"""What a step is priced with, as the controller sends it with a policy: the plugin's half of
the policy (``engine_plugin.policy.compose``) re-picks per step from it.

Why: a (class, bucket) decision is priced at the class mix the controller expects in the bucket,
but the batch of one step holds the classes in whatever counts the traffic brought. A model
drafter runs as many passes as the largest K asked of it, so which arm pays for a class moves
with the others in the step: two chat requests among six documents should not pay the drafter's
passes that eight chat requests share (the oracle of the simulator runs such a class on n-gram
drafts in 40% of its steps on ``collapse``). The controller cannot decide per step (a report
interval holds hundreds), so it sends with each policy what pricing a step needs
(``Composition``: the step-cost model's mean weights and the posterior-mean E(K) curves of the
classes), and whether a new one moved enough to be worth sending (``moved``).

Pure (numpy, dataclasses).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]
Arm = tuple[str, int]  # (draft, K); ("", 0) is off
_MIN_STEP_SECONDS = 1e-6


@dataclass(frozen=True)
class DraftPricing:
    """What a model draft adds to a step in which it drafts, seconds."""

    fixed_seconds: float
    seconds_per_pass: float
    seconds_per_token: float


@dataclass(frozen=True)
class StepPricing:
    """The step-cost model by its posterior mean weights (``controller.core.cost_model``):

        t = base + per_sequence x B + per_token x T + sum_j above_j x max(0, T - knot_j)
            + sum_d (fixed_d [d drafts] + per_pass_d x passes_d + per_token_d x tokens_d)

    with B sequences, T verified tokens, and per model draft its sequential passes and proposed
    tokens (deterministic drafts cost nothing here). Seconds."""

    base_seconds: float
    seconds_per_sequence: float
    seconds_per_token: float
    knot_tokens: tuple[int, ...]
    seconds_per_token_above: tuple[float, ...]
    drafts: Mapping[str, DraftPricing] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if len(self.knot_tokens) != len(self.seconds_per_token_above):
            raise ValueError("step pricing: one slope per knot")
        numbers = [self.base_seconds, self.seconds_per_sequence, self.seconds_per_token,
                   *self.knot_tokens, *self.seconds_per_token_above,
                   *(x for d in self.drafts.values() for x in (
                       d.fixed_seconds, d.seconds_per_pass, d.seconds_per_token))]
        if not all(math.isfinite(x) for x in numbers):
            raise ValueError("step pricing: numbers must be finite")

    def seconds(self, batch_size: float, verified_tokens: FloatArray,
                passes: Mapping[str, FloatArray], draft_tokens: Mapping[str, FloatArray]
                ) -> FloatArray:
        """Step seconds, one per entry of ``verified_tokens``; ``passes`` and ``draft_tokens``
        per model draft (entries aligned with ``verified_tokens``; a draft with 0 passes does
        not draft). Drafts without pricing cost nothing."""
        vectors = self.arrays
        v = np.asarray(verified_tokens, dtype=np.float64)
        by_pass, by_token = np.zeros((v.size, vectors.n)), np.zeros((v.size, vectors.n))
        for name, p in passes.items():
            if (i := vectors.index.get(name)) is not None:
                by_pass[:, i], by_token[:, i] = p, draft_tokens[name]
        return vectors.seconds(batch_size, v, by_pass, by_token)

    @cached_property
    def arrays(self) -> PricingArrays:
        return PricingArrays(self)


class PricingArrays:
    """``StepPricing`` as arrays over its model drafts (column ``index[name]``): the one place
    the formula is written."""

    def __init__(self, p: StepPricing) -> None:
        self.p = p
        self.index = {name: i for i, name in enumerate(p.drafts)}
        self.n = len(self.index)
        self.fixed = np.array([d.fixed_seconds for d in p.drafts.values()])
        self.per_pass = np.array([d.seconds_per_pass for d in p.drafts.values()])
        self.per_token = np.array([d.seconds_per_token for d in p.drafts.values()])
        self.knots = np.array(p.knot_tokens, dtype=np.float64)
        self.above = np.array(p.seconds_per_token_above)

    def seconds(self, batch_size: float, verified: FloatArray, passes: FloatArray,
                draft_tokens: FloatArray) -> FloatArray:
        """``StepPricing.seconds`` with passes and draft tokens as (entries x drafts)."""
        p = self.p
        t = (p.base_seconds + p.seconds_per_sequence * batch_size + p.seconds_per_token * verified
             + np.maximum(0.0, verified[:, None] - self.knots[None, :]) @ self.above
             + (passes > 0) @ self.fixed + passes @ self.per_pass
             + draft_tokens @ self.per_token)
        return np.asarray(np.maximum(t, _MIN_STEP_SECONDS), dtype=np.float64)


@dataclass(frozen=True)
class Composition:
    """What the plugin needs to price a step's arms: ``pricing``, and per (class, draft) the
    posterior-mean E(K) for K = 0..the draft's largest (classes without evidence for a draft
    have no curve for it: that draft is not an option for them). ``margin``: the relative gain
    in the step's tokens per second a re-pick needs over the decisions (0.01 = 1%)."""

    pricing: StepPricing
    expected_tokens: Mapping[tuple[str, str], tuple[float, ...]]
    margin: float

    def __post_init__(self) -> None:
        if not (math.isfinite(self.margin) and self.margin >= 0):
            raise ValueError(f"composition margin: must be a finite number >= 0, got "
                             f"{self.margin}")
        for (cls, draft), curve in self.expected_tokens.items():
            if len(curve) < 1 or not all(math.isfinite(x) and x >= 0 for x in curve):
                raise ValueError(f"composition: E(K) of ({cls!r}, {draft!r}) must be finite "
                                 "numbers >= 0, K = 0 first")

    def expected(self, traffic_class: str, arm: Arm) -> float:
        """E(K) of ``arm`` for the class (1 when off or unknown)."""
        draft, k = arm
        curve = self.expected_tokens.get((traffic_class, draft))
        return float(curve[k]) if k and curve is not None and k < len(curve) else 1.0


def moved(old: Composition | None, new: Composition | None, batch_sizes: Collection[int],
          max_k: int, tolerance: float) -> bool:
    """Whether ``new`` prices steps differently enough from ``old`` to be worth sending: a
    curve added or gone, an E(K) or the step time of some arm at one of ``batch_sizes`` (every
    sequence on one model draft at K = 0..``max_k``) moved by more than ``tolerance``
    (relative), or the margin changed."""
    if old is None or new is None:
        return old is not new
    if old.margin != new.margin or old.expected_tokens.keys() != new.expected_tokens.keys():
        return True
    for key, curve in new.expected_tokens.items():
        before = old.expected_tokens[key]
        if len(curve) != len(before) or any(
                abs(a - b) > tolerance * b for a, b in zip(curve, before, strict=True)):
            return True
    ks = np.arange(max_k + 1, dtype=np.float64)
    for b in batch_sizes:
        shapes: list[tuple[dict[str, FloatArray], dict[str, FloatArray]]] = [({}, {})]
        shapes += [({d: ks}, {d: b * ks}) for d in new.pricing.drafts]
        for passes, tokens in shapes:
            verified = b * (1.0 + ks)
            t_new = new.pricing.seconds(b, verified, passes, tokens)
            t_old = old.pricing.seconds(b, verified, passes, tokens)
            if np.any(np.abs(t_new - t_old) > tolerance * t_old):
                return True
    return False
