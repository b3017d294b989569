"""Ground truth of a scenario: what a step really costs and how well each draft really predicts each
class, over time. The simulated engine draws from it; only the oracle may read it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from benchmarks.sim.scenario import Acceptance, Scenario
from specpilot.controller.core.goodput import expected_tokens_curve

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
_EPS = 1e-4  # rates are kept inside (0, 1) so their logits are finite
# Gauss-Hermite nodes for the mean over the per-request logit offset (normal): exact enough for
# E(K) curves, and deterministic.
_GH_NODES, _GH_WEIGHTS = np.polynomial.hermite_e.hermegauss(24)
_GH_WEIGHTS = _GH_WEIGHTS / _GH_WEIGHTS.sum()


def rates_vector(acceptance: Acceptance, max_k: int) -> FloatArray:
    """Per-position rates for positions 1..max_k (a list's last value repeats)."""
    values = [acceptance] if isinstance(acceptance, int | float) else list(acceptance)
    values = values[:max_k] + [values[-1]] * max(0, max_k - len(values))
    return np.clip(np.asarray(values, dtype=np.float64), _EPS, 1.0 - _EPS)


def logit(p: npt.ArrayLike) -> FloatArray:
    q = np.asarray(p, dtype=np.float64)
    return np.asarray(np.log(q) - np.log1p(-q), dtype=np.float64)


def sigmoid(x: npt.ArrayLike) -> FloatArray:
    return np.asarray(1.0 / (1.0 + np.exp(-np.asarray(x, dtype=np.float64))), dtype=np.float64)


@dataclass(frozen=True)
class StepCost:
    """Seconds of one engine step: target verification/prefill plus the model drafts' passes."""

    base: float
    per_sequence: float
    per_token: float
    ridge_tokens: int
    per_token_above_ridge: float
    noise: float
    draft_per_pass: FloatArray  # per draft (0 for n-gram)
    draft_per_token: FloatArray
    per_context_token: float = 0.0  # per context token a step's token attends to

    @classmethod
    def from_scenario(cls, s: Scenario) -> StepCost:
        c = s.cost
        return cls(c.base_ms / 1e3, c.per_sequence_ms / 1e3, c.per_token_ms / 1e3, c.ridge_tokens,
                   c.per_token_above_ridge_ms / 1e3, c.noise,
                   np.array([d.per_pass_ms / 1e3 for d in s.drafts]),
                   np.array([d.per_token_ms / 1e3 for d in s.drafts]),
                   c.per_context_token_ms / 1e3)

    def target_seconds(self, batch: float, tokens: npt.ArrayLike,
                       context_reads: npt.ArrayLike = 0.0) -> FloatArray:
        """``context_reads``: over the step's tokens, the context each attends to, summed."""
        t = np.asarray(tokens, dtype=np.float64)
        return np.asarray(self.base + self.per_sequence * batch + self.per_token * t
                          + self.per_token_above_ridge * np.maximum(0.0, t - self.ridge_tokens)
                          + self.per_context_token * np.asarray(context_reads, dtype=np.float64),
                          dtype=np.float64)

    def seconds(self, batch: int, tokens: int, passes: npt.ArrayLike,
                draft_tokens: npt.ArrayLike, context_reads: float = 0.0) -> float:
        """Noise-free seconds of a step with ``tokens`` target tokens attending to
        ``context_reads`` context tokens in all, and per draft the number of sequential passes
        and of proposed tokens."""
        drafting = float(np.dot(self.draft_per_pass, passes) + np.dot(self.draft_per_token,
                                                                         draft_tokens))
        return float(self.target_seconds(batch, tokens, context_reads)) + drafting


class AcceptanceTruth:
    """Per (class, draft, position) base logits over time; each request adds its own offset."""

    def __init__(self, scenario: Scenario) -> None:
        self.max_k = scenario.engine.max_k
        self.classes = [c.name for c in scenario.classes]
        self.drafts = [d.name for d in scenario.drafts]
        self.spread = np.array([c.spread for c in scenario.classes])
        base = np.array([[rates_vector(c.acceptance[d], self.max_k) for d in self.drafts]
                         for c in scenario.classes])
        # Epochs: the logit table in force from each change time on.
        self._times = [0.0]
        self._tables = [logit(base)]
        for drift in sorted(scenario.drift, key=lambda d: d.at_seconds):
            table = self._tables[-1].copy()
            ci, di = self.classes.index(drift.traffic_class), self.drafts.index(drift.draft)
            table[ci, di] = logit(rates_vector(drift.acceptance, self.max_k))
            self._times.append(drift.at_seconds)
            self._tables.append(table)
        self._curves: dict[tuple[int, bool], FloatArray] = {}

    def epoch(self, now: float) -> int:
        return int(np.searchsorted(self._times, now, side="right")) - 1

    def logits(self, now: float) -> FloatArray:
        """[class, draft, position] base logits in force at ``now``."""
        return self._tables[self.epoch(now)]

    def request_rates(self, now: float, cls: IntArray, draft: IntArray,
                      offset: FloatArray) -> FloatArray:
        """[request, position] true rates of requests (class, draft, logit offset)."""
        table = self.logits(now)
        return sigmoid(table[cls, draft] + offset[:, None])

    def expected_curves(self, now: float, running: bool = False) -> FloatArray:
        """[class, draft, K = 0..max_k]: mean tokens per step over the class's requests as they
        arrive, or (``running``) over the requests in a step: a request expecting E tokens per
        step stays for 1/E steps per token, so that mean is the harmonic one."""
        e = self.epoch(now)
        curves = self._curves.get((e, running))
        if curves is None:
            table = self._tables[e]
            n_c, n_d, _ = table.shape
            curves = np.zeros((n_c, n_d, self.max_k + 1))
            for ci in range(n_c):
                for di in range(n_d):
                    for z, w in zip(_GH_NODES, _GH_WEIGHTS, strict=True):
                        curve = expected_tokens_curve(sigmoid(table[ci, di] + self.spread[ci] * z))
                        curves[ci, di] += w * (1.0 / curve if running else curve)
            if running:
                curves = 1.0 / curves
            self._curves[(e, running)] = curves
        return curves

    def mean_rates(self, now: float) -> FloatArray:
        """[class, draft, position] conditional rates implied by the mean curves."""
        curves = self.expected_curves(now)
        survive = curves[..., 1:] - curves[..., :-1]  # P(accept 1..i)
        prev = np.concatenate([np.ones_like(survive[..., :1]), survive[..., :-1]], axis=-1)
        return np.asarray(survive / np.maximum(prev, 1e-12), dtype=np.float64)


def homogeneous_speedup(cost: StepCost, curve: FloatArray, draft: int, k: int,
                        batch: int) -> float:
    """Speedup of K drafts over none for a batch of ``batch`` sequences that all expect
    ``curve[k]`` tokens per step (no prefill): E(K) x plain step / drafting step."""
    plain = cost.seconds(batch, batch, np.zeros_like(cost.draft_per_pass),
                         np.zeros_like(cost.draft_per_pass))
    passes = np.zeros_like(cost.draft_per_pass)
    tokens = np.zeros_like(cost.draft_per_pass)
    passes[draft], tokens[draft] = k, k * batch
    return float(curve[k]) * plain / cost.seconds(batch, batch * (1 + k), passes, tokens)


def breakeven_acceptance(cost: StepCost, draft: int, batch: int, max_k: int) -> float:
    """The uniform per-token acceptance below which no K pays at ``batch`` (bisection)."""

    def pays(a: float) -> bool:
        curve = expected_tokens_curve(np.full(max_k, a))
        return max(homogeneous_speedup(cost, curve, draft, k, batch)
                   for k in range(1, max_k + 1)) > 1.0

    lo, hi = 0.0, 1.0 - _EPS
    if not pays(hi):
        return 1.0
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if pays(mid) else (mid, hi)
    return hi
