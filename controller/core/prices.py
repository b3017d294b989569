"""What the policy prices a class's arms with: step seconds as arrays, computed before it runs.

Why: the policy (``specpilot.controller.core.policy``) is a pure function of its context. The
decider prices the steps it will score (``price_steps``, from the step-cost model's mean and from a
decide round's draw of its weights) and the policy reads arrays: it calls nothing, and a test hands
it prices from a toy cost function the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from specpilot.contract.records import DraftSpec
from specpilot.controller.core.mix import BatchOthers, MixedSecondsFn, arm_seconds

FloatArray = npt.NDArray[np.float64]
# (batch_size, draft whose passes run, draft_is_model, max_k) -> step seconds for K = 0..max_k
StepSecondsFn = Callable[[int, str, bool, int], FloatArray]
# (batch_size, drafts, max_k) -> the relative posterior covariance of the step seconds of every
# arm of the drafts (``mix.arm_keys`` order), every sequence on the arm:
# Cov(t_a, t_b) / (t_a t_b), by the cost model's posterior
SpreadFn = Callable[[int, Sequence[DraftSpec], int], FloatArray]
_OFF = ""


@dataclass(frozen=True)
class StepPrices:
    """Step seconds under one set of cost weights, at the batch sizes a class is scored at."""

    curves: Mapping[tuple[int, str, int], FloatArray]
    """(batch size, draft, K max) -> seconds of a step whose sequences all run K = 0..K max of
    the draft; (batch size, "", 0): no speculation."""
    mixed: Mapping[tuple[int, tuple[str, ...]], FloatArray]
    """(batch size, the drafts scored) -> seconds of each of the class's arms (off, then each
    draft's K = 1..max) with the rest of the batch at the context's ``others``."""
    spread: Mapping[tuple[int, tuple[str, ...]], FloatArray] = field(default_factory=dict)
    """(batch size, the drafts scored) -> the relative posterior covariance of the arms' step
    seconds (``SpreadFn``): how well the cost model knows them, for the figures shown
    (``specpilot.controller.core.ranking``); priced by the mean costs only."""

    def off(self, batch_size: int) -> FloatArray:
        """Seconds of a step without speculation (one entry)."""
        return self.curves[(batch_size, _OFF, 0)]

    def curve(self, batch_size: int, draft: str, k_max: int) -> FloatArray:
        """Seconds for K = 0..``k_max``, every sequence on ``draft``."""
        return self.curves[(batch_size, draft, k_max)]

    def mixed_arms(self, batch_size: int, drafts: Sequence[DraftSpec]) -> FloatArray:
        """Seconds of each arm over ``drafts`` in the expected batch of ``batch_size``."""
        return self.mixed[(batch_size, tuple(d.name for d in drafts))]

    def arm_spread(self, batch_size: int, drafts: Sequence[DraftSpec]) -> FloatArray | None:
        """``spread`` of ``drafts``' arms at ``batch_size``; None where it was not priced."""
        return self.spread.get((batch_size, tuple(d.name for d in drafts)))

    def plus(self, other: StepPrices) -> StepPrices:
        """These prices and ``other``'s."""
        return StepPrices({**self.curves, **other.curves}, {**self.mixed, **other.mixed},
                          {**self.spread, **other.spread})


def price_steps(step_seconds: StepSecondsFn, mixed_seconds: MixedSecondsFn | None,
                drafts: Sequence[DraftSpec], max_k: int, batch_sizes: Iterable[int],
                others: Mapping[int, BatchOthers] | None = None,
                draft_sets: Sequence[tuple[DraftSpec, ...]] = (),
                arms: Iterable[tuple[int, str, int]] = (),
                spread: SpreadFn | None = None,
                verified: Mapping[str, FloatArray] | None = None) -> StepPrices:
    """The prices of ``drafts``' arms (K up to ``max_k``) at ``batch_sizes``: no speculation,
    and a curve per draft where the batch is all of the class, or, where ``others`` has the
    rest of the batch, every arm of ``drafts`` and of each of ``draft_sets`` in that batch
    (``mixed_seconds`` required). And the curve up to K of each of ``arms`` (batch size,
    draft, K; what a probe of the model draft reads, ``policy.probe_curves``). With
    ``spread``, the arms' relative covariance at ``batch_sizes`` too (``StepPrices.spread``).
    ``verified``: per draft, the drafts a step verifies at each K asked (``mix.arm_seconds``;
    the curves stay per K, ``verified_curve`` reads them)."""
    others = others or {}
    if others and mixed_seconds is None:
        raise ValueError("price_steps: mixed batches need mixed_seconds")
    specs = {d.name: d for d in drafts}
    curves: dict[tuple[int, str, int], FloatArray] = {}
    mixed: dict[tuple[int, tuple[str, ...]], FloatArray] = {}
    spreads: dict[tuple[int, tuple[str, ...]], FloatArray] = {}
    for b, name, k in arms:
        d = specs[name]
        curves[(b, name, k)] = step_seconds(b, d.pass_draft, bool(d.pass_draft), k)
    for b in batch_sizes:
        curves[(b, _OFF, 0)] = step_seconds(b, "", False, 0)
        if spread is not None:
            spreads[(b, tuple(specs))] = spread(b, drafts, max_k)
        o = others.get(b)
        if o is None:
            for d in drafts:
                k_max = min(max_k, d.max_k)
                curves[(b, d.name, k_max)] = step_seconds(b, d.pass_draft, bool(d.pass_draft),
                                                          k_max)
        elif mixed_seconds is not None:
            for scored in (tuple(drafts), *draft_sets):
                mixed[(b, tuple(d.name for d in scored))] = arm_seconds(o, scored, max_k,
                                                                        mixed_seconds, verified)
    return StepPrices(curves, mixed, spreads)


def verified_curve(curve: FloatArray, verified: FloatArray | None, spec: DraftSpec) -> FloatArray:
    """Step seconds at each K asked of ``spec`` from ``curve`` (seconds at K = 0..max drafts
    verified a sequence), where a step verifies ``verified[K]`` drafts (None: K): the curve
    read between its points. A draft that runs a model's passes keeps its curve, whose every
    point also prices K passes."""
    if verified is None or spec.pass_draft:
        return curve
    k_max = curve.size - 1
    return np.asarray(np.interp(np.minimum(verified[: k_max + 1], k_max), np.arange(k_max + 1),
                                curve), dtype=np.float64)
