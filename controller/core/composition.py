"""Per-step arms from the batch actually running: the plugin's half of the policy.

Why: a (class, bucket) decision is priced at the class mix the controller expects in the bucket,
but the batch of one step holds the classes in whatever counts the traffic brought. A model
drafter runs as many passes as the largest K asked of it, so which arm pays for a class moves
with the others in the step: two chat requests among six documents should not pay the drafter's
passes that eight chat requests share (the oracle of the simulator runs such a class on n-gram
drafts in 40% of its steps on ``collapse``). The controller cannot decide per step (a report
interval holds hundreds), so it sends with each policy what pricing a step needs
(``Composition``: the step-cost model's mean weights and the posterior-mean E(K) curves of the
classes), and the plugin re-picks, per step, the arms of the classes whose decision is a
settled goodput choice (``step_arms``): coordinate ascent on the step's tokens per second from
the decisions, kept only where it beats them by ``margin``. Explorations, probes, warm-up,
overrides and offline pins are left as decided: they exist to learn or because an operator said.

Pure (numpy, dataclasses): the plugin, the simulator and the tests call the same function.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import numpy.typing as npt

from specpilot.contract.records import Reason

FloatArray = npt.NDArray[np.float64]
Arm = tuple[str, int]  # (draft, K); ("", 0) is off
OFF: Arm = ("", 0)
# Coordinate-ascent sweeps over the adjustable classes of a step (it stops when none moves).
_SWEEPS = 2
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


class ClassArms:
    """One class's arms as arrays: E(K), K, and per model draft the passes each asks (K on its
    own draft's column, 0 elsewhere; deterministic drafts ask none)."""

    def __init__(self, comp: Composition, traffic_class: str, arms: list[Arm]) -> None:
        self.arms = arms
        self.values = np.array([comp.expected(traffic_class, a) for a in arms])
        self.ks = np.array([float(k) for _, k in arms])
        index = comp.pricing.arrays.index
        self.passes = np.zeros((len(arms), len(index)))
        for i, (draft, k) in enumerate(arms):
            if k and draft in index:
                self.passes[i, index[draft]] = k


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

    @cached_property
    def options(self) -> dict[str, ClassArms]:
        """Per class: its arms, off first."""
        arms: dict[str, list[Arm]] = {}
        for (cls, draft), curve in sorted(self.expected_tokens.items()):
            arms.setdefault(cls, [OFF]).extend((draft, k) for k in range(1, len(curve)))
        return {c: ClassArms(self, c, a) for c, a in arms.items()}

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


def adjustable(reason: Reason | None, probing: bool) -> bool:
    """Whether a decision may be re-picked per step: a settled goodput choice without probes
    (an exploration, a probe, warm-up, a detected change being absorbed, an override or an
    offline pin is run as decided)."""
    return reason is Reason.GOODPUT and not probing


def step_arms(comp: Composition, counts: Mapping[str, int], arms: Mapping[str, Arm],
              free: Collection[str], batch_size: float) -> dict[str, Arm]:
    """The arm of every class in the step: ``arms`` (each class's decision; every class in
    ``counts`` must have one), with the classes in ``free`` re-picked for the step's
    ``counts`` (decoding sequences per class) where that beats the decisions' tokens per
    second by ``comp.margin``. ``batch_size``: the step's sequences (what the cost model's
    per-sequence term prices)."""
    live = [c for c, n in counts.items() if n > 0]
    options = comp.options
    # A class whose decision has no curve here cannot be priced against its options.
    movable = sorted((c for c in live if c in free and c in options
                      and arms[c] in options[c].arms), key=lambda c: (-counts[c], c))
    if not movable:
        return dict(arms)
    p = comp.pricing.arrays
    # Per live class: its row (the option it runs) in its own options, or its fixed figures.
    at = {c: options[c].arms.index(arms[c]) for c in movable}
    fixed = [c for c in live if c not in at]
    f_tokens = sum(counts[c] * comp.expected(c, arms[c]) for c in fixed)
    f_verified = sum(counts[c] * (1 + arms[c][1]) for c in fixed)
    f_passes = np.zeros(p.n)
    f_dtok = np.zeros(p.n)
    for c in fixed:
        draft, k = arms[c]
        if k and draft in p.index:
            f_passes[p.index[draft]] = max(f_passes[p.index[draft]], k)
            f_dtok[p.index[draft]] += counts[c] * k

    def others(skip: str | None) -> tuple[float, float, FloatArray, FloatArray]:
        tokens, verified = f_tokens, f_verified
        passes, dtok = f_passes.copy(), f_dtok.copy()
        for c in movable:
            if c != skip:
                o, i, n = options[c], at[c], counts[c]
                tokens += n * o.values[i]
                verified += n * (1.0 + o.ks[i])
                passes = np.maximum(passes, o.passes[i])
                dtok += n * o.passes[i]
        return tokens, verified, passes, dtok

    def rate() -> float:
        tokens, verified, passes, dtok = others(None)
        return float(tokens / p.seconds(batch_size, np.array([verified]), passes[None, :],
                                        dtok[None, :])[0])

    def ascend() -> float:
        """Best responses class by class (most sequences first) until none moves."""
        for _ in range(_SWEEPS):
            changed = False
            for c in movable:
                o, n = options[c], counts[c]
                tokens, verified, passes, dtok = others(c)
                rates = (tokens + n * o.values) / p.seconds(
                    batch_size, verified + n * (1.0 + o.ks), np.maximum(passes, o.passes),
                    dtok + n * o.passes)
                best = int(np.argmax(rates))
                if rates[best] > rates[at[c]] * (1.0 + 1e-9):
                    at[c] = best
                    changed = True
            if not changed:
                break
        return rate()

    base = rate()
    # Two starts: the decisions, and every free class off. A class riding on a pass another
    # pays for holds that one on the drafter (alone, neither gains by leaving it); from off,
    # the free classes find out whether the pass pays at all in this step.
    best_rate = ascend()
    best = dict(at)
    at.update({c: 0 for c in movable})
    if (from_off := ascend()) > best_rate:
        best, best_rate = dict(at), from_off
    if best_rate < base * (1.0 + comp.margin):
        return dict(arms)
    return {**arms, **{c: options[c].arms[i] for c, i in best.items()}}


# A step as the engine sees it, per traffic class present: its decision's class (classes folded
# into "other" or on the default decision share one), the decision's arm, whether that arm may
# be re-picked (``adjustable``), and the class's decoding sequences.
StepClass = tuple[str, Arm, bool, int]


class StepComposer:
    """``step_arms`` for one composition, with its answers remembered: a step's classes and
    counts recur from step to step, so the search runs once per distinct step (at most
    ``cache_size`` remembered, then all forgotten at once). The engine plugin holds one per
    policy and the simulator's adapter one per policy it applies."""

    def __init__(self, composition: Composition, cache_size: int = 4096) -> None:
        self.composition = composition
        self._cache_size = cache_size
        self._cache: dict[tuple[object, ...], dict[str, Arm]] = {}

    def repick(self, step: Iterable[StepClass], batch_size: int) -> dict[str, Arm]:
        """The decision classes whose arm this step re-picks, with that arm (empty where the
        decisions stand); ``batch_size``: the step's sequences."""
        key = (batch_size, tuple(sorted(step)))
        changed = self._cache.get(key)
        if changed is None:
            if len(self._cache) >= self._cache_size:
                self._cache.clear()
            changed = self._cache[key] = self._search(key[1], batch_size)
        return changed

    def _search(self, step: Iterable[StepClass], batch_size: int) -> dict[str, Arm]:
        counts: dict[str, int] = {}
        arms: dict[str, Arm] = {}
        free: set[str] = set()
        for name, arm, movable, n in step:
            counts[name] = counts.get(name, 0) + n
            arms[name] = arm
            if movable:
                free.add(name)
        if not free:
            return {}
        chosen = step_arms(self.composition, counts, arms, free, batch_size)
        return {c: a for c, a in chosen.items() if a != arms[c]}
