"""Per-step arms from the batch actually running: the engine's half of the composition.

A (class, bucket) decision is priced at the class mix the controller expects in the bucket; the
controller sends with each policy what pricing a step needs (``specpilot.contract.pricing``:
the step-cost model's mean weights and the posterior-mean E(K) curves of the classes), and the
engine re-picks, per step, the arms of the classes whose decision is a settled goodput choice
(``step_arms``): coordinate ascent on the step's tokens per second from the decisions, kept only
where it beats them by the composition's margin. Explorations, probes, warm-up, overrides and
offline pins are left as decided: they exist to learn or because an operator said.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping

import numpy as np

from specpilot.contract.pricing import Arm, Composition, FloatArray
from specpilot.contract.records import Reason

OFF: Arm = ("", 0)
# At most this many coordinate-ascent sweeps over the adjustable classes of a step. It stops
# when none moves (every move raises the step's rate, so it ends); two sweeps were not always
# enough to get there, and the search runs once per distinct step (``StepComposer``).
_SWEEPS = 8
# Context grid points per doubling that a step's context is priced at (``StepComposer``).
_CONTEXT_GRID = 8


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


def class_arms(comp: Composition) -> dict[str, ClassArms]:
    """Per class with a curve: its arms, off first."""
    arms: dict[str, list[Arm]] = {}
    for (cls, draft), curve in sorted(comp.expected_tokens.items()):
        arms.setdefault(cls, [OFF]).extend((draft, k) for k in range(1, len(curve)))
    return {c: ClassArms(comp, c, a) for c, a in arms.items()}


def adjustable(reason: Reason | None, probing: bool) -> bool:
    """Whether a decision may be re-picked per step: a settled goodput choice without probes
    (an exploration, a probe, warm-up, a detected change being absorbed, an override or an
    offline pin is run as decided)."""
    return reason is Reason.GOODPUT and not probing


def step_arms(comp: Composition, counts: Mapping[str, int], arms: Mapping[str, Arm],
              free: Collection[str], batch_size: float,
              options: Mapping[str, ClassArms] | None = None,
              context_tokens: float = 0.0) -> dict[str, Arm]:
    """The arm of every class in the step: ``arms`` (each class's decision; every class in
    ``counts`` must have one), with the classes in ``free`` re-picked for the step's
    ``counts`` (decoding sequences per class) where that beats the decisions' tokens per
    second by ``comp.margin``. ``batch_size``: the step's sequences (what the cost model's
    per-sequence term prices). ``options``: ``class_arms(comp)``, where the caller keeps it.
    ``context_tokens``: the step's mean context per sequence (what its context term prices)."""
    live = [c for c, n in counts.items() if n > 0]
    if options is None:
        options = class_arms(comp)
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
                                        dtok[None, :], context_tokens)[0])

    def ascend() -> float:
        """Best responses class by class (most sequences first) until none moves."""
        for _ in range(_SWEEPS):
            changed = False
            for c in movable:
                o, n = options[c], counts[c]
                tokens, verified, passes, dtok = others(c)
                rates = (tokens + n * o.values) / p.seconds(
                    batch_size, verified + n * (1.0 + o.ks), np.maximum(passes, o.passes),
                    dtok + n * o.passes, context_tokens)
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
    ``cache_size`` remembered, then all forgotten at once). ``PolicyView`` holds one per
    policy."""

    def __init__(self, composition: Composition, cache_size: int = 4096) -> None:
        self.composition = composition
        self.options = class_arms(composition)
        self._cache_size = cache_size
        self._cache: dict[tuple[object, ...], dict[str, Arm]] = {}

    def repick(self, step: Iterable[StepClass], batch_size: int,
               context_tokens: float = 0.0) -> dict[str, Arm]:
        """The decision classes whose arm this step re-picks, with that arm (empty where the
        decisions stand); ``batch_size``: the step's sequences, ``context_tokens`` their mean
        context (priced on a grid of ~9% steps, so steps of nearly the same context share one
        answer: contexts grow every step)."""
        grid = round(_CONTEXT_GRID * math.log2(1.0 + max(context_tokens, 0.0)))
        key = (batch_size, grid, tuple(sorted(step)))
        changed = self._cache.get(key)
        if changed is None:
            if len(self._cache) >= self._cache_size:
                self._cache.clear()
            changed = self._cache[key] = self._search(key[2], batch_size,
                                                      2.0 ** (grid / _CONTEXT_GRID) - 1.0)
        return changed

    def _search(self, step: Iterable[StepClass], batch_size: int,
                context_tokens: float) -> dict[str, Arm]:
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
        chosen = step_arms(self.composition, counts, arms, free, batch_size, self.options,
                           context_tokens)
        return {c: a for c, a in chosen.items() if a != arms[c]}
