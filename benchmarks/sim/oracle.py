"""The ceiling: a policy that reads the scenario's ground truth.

At every step it knows each class's true E(K) curve per draft (drifts included) and the true
step-cost function, and picks one (draft, K) per class for the batch actually in the step (its
class mix and prefill tokens) so that the step's tokens take the least time:

- The output to generate and the prompts to prefill are fixed, so time is what a policy saves. In
  a decode-only step that means the most tokens per second. In a step that also prefills, the
  prefill's time is spent anyway and decode tokens are worth the time they would take in a
  decode-only step: it maximises tokens - lambda x seconds, lambda being the best decode-only rate
  of the same batch. (Maximising such a step's own tokens per second would speculate hard there:
  a long step makes drafts look cheap although they cost more than decode-only tokens.)
- The class curves are the mean over the requests *running*, which lean toward hard ones (easy
  requests finish in fewer steps): the harmonic mean of the per-request E(K).
- The classes interact through the shared step cost (a model draft runs as many passes as the
  largest K asked of it), so it optimises them jointly: exhaustively while there are at most
  ``EXHAUSTIVE_LIMIT`` combinations (three live classes, two drafts, K up to 8), else by
  coordinate ascent from several starts, keeping the best.

It does not know individual requests' difficulty: it is the best per-class policy, which is what
specpilot and every baseline can at most be.
"""

from __future__ import annotations

import itertools

import numpy as np

from benchmarks.sim.step import (
    NO_DRAFT,
    Assignment,
    EngineInfo,
    FloatArray,
    IntArray,
    StepOutcome,
    StepView,
)
from benchmarks.sim.truth import AcceptanceTruth, StepCost

_SWEEPS = 6
EXHAUSTIVE_LIMIT = 20_000
# Prefill tokens are rounded to this grain for the decision cache (a few tokens of prefill
# do not change the best arms).
_PREFILL_GRAIN = 64
# And each class's mean context to this one, tokens.
_CONTEXT_GRAIN = 128


class Oracle:
    name = "oracle"

    def __init__(self, info: EngineInfo, truth: AcceptanceTruth, cost: StepCost) -> None:
        self.info, self.truth, self.cost = info, truth, cost
        n_d, max_k = len(info.drafts), info.max_k
        # Arms: row 0 off, then (draft d, K) for K = 1..max_k.
        self.arm_draft = np.array([NO_DRAFT] + [d for d in range(n_d) for _ in range(max_k)])
        self.arm_k = np.array([0] + [k for _ in range(n_d) for k in range(1, max_k + 1)])
        self._onehot = np.zeros((self.arm_k.size, n_d))
        for i, d in enumerate(self.arm_draft):
            if d != NO_DRAFT:
                self._onehot[i, d] = 1.0
        self._cache: dict[tuple[object, ...], IntArray] = {}
        self._combos: dict[int, IntArray] = {}

    def observe(self, outcome: StepOutcome) -> None:
        return None

    def _class_arm_values(self, curves: FloatArray, c: int) -> FloatArray:
        """E(K) of class c for every arm."""
        out = np.ones(self.arm_k.size)
        for i in range(1, self.arm_k.size):
            out[i] = curves[c, self.arm_draft[i], self.arm_k[i]]
        return out

    def _responses(self, counts: IntArray, context: FloatArray, arms: IntArray,
                   values: FloatArray, c: int, batch: int, prefill: int,
                   lam: float) -> FloatArray:
        """The objective (tokens - lam x seconds, or tokens per second when lam is 0) for every
        arm of class c, the others' arms fixed; ``context``: per class, its decoding requests'
        context summed."""
        others = np.arange(counts.size) != c
        n = counts * others
        k_o = self.arm_k[arms]
        onehot_o = self._onehot[arms] * (n > 0)[:, None]
        tokens = float(np.dot(n, values[np.arange(counts.size), arms])) + counts[c] * values[c]
        verified = prefill + float(np.dot(n, 1 + k_o)) + counts[c] * (1 + self.arm_k)
        reads = float(np.dot(context * others, 1 + k_o)) + context[c] * (1 + self.arm_k)
        passes = np.maximum((onehot_o * k_o[:, None]).max(axis=0)[None, :],
                            self._onehot * self.arm_k[:, None])
        dtok = (n[:, None] * onehot_o * k_o[:, None]).sum(axis=0)[None, :] + (
            counts[c] * self._onehot * self.arm_k[:, None])
        seconds = (self.cost.target_seconds(batch, verified, reads)
                   + passes @ self.cost.draft_per_pass + dtok @ self.cost.draft_per_token)
        return _objective(tokens, seconds, lam)

    def _ascend(self, counts: IntArray, context: FloatArray, arms: IntArray,
                values: FloatArray, batch: int, prefill: int,
                lam: float) -> tuple[IntArray, float]:
        """Best responses class by class until no class gains."""
        live = np.flatnonzero(counts > 0)
        best = 0.0
        for _ in range(_SWEEPS):
            moved = False
            for c in live:
                r = self._responses(counts, context, arms, values, c, batch, prefill, lam)
                a = int(np.argmax(r))
                if r[a] > r[arms[c]] + 1e-12 * abs(r[arms[c]]):
                    arms = arms.copy()
                    arms[c] = a
                    moved = True
                best = float(r[arms[c]])
            if not moved:
                break
        return arms, best

    def _exhaustive(self, counts: IntArray, context: FloatArray, values: FloatArray,
                    batch: int, prefill: int, lam: float) -> IntArray:
        live = np.flatnonzero(counts > 0)
        if not live.size:
            return np.zeros(counts.size, dtype=np.int64)
        n_arms = self.arm_k.size
        combos = self._combos.get(live.size)
        if combos is None:
            combos = np.array(list(itertools.product(range(n_arms), repeat=live.size)),
                              dtype=np.int64).reshape(-1, live.size)
            self._combos[live.size] = combos
        n = counts[live].astype(np.float64)
        k = self.arm_k[combos]  # (M, L)
        onehot = self._onehot[combos]  # (M, L, D)
        tokens = (values[live[None, :], combos] * n).sum(axis=1)
        verified = prefill + ((1 + k) * n).sum(axis=1)
        reads = ((1 + k) * context[live]).sum(axis=1)
        passes = (onehot * k[..., None]).max(axis=1)
        dtok = (onehot * (k * n)[..., None]).sum(axis=1)
        seconds = (self.cost.target_seconds(batch, verified, reads)
                   + passes @ self.cost.draft_per_pass + dtok @ self.cost.draft_per_token)
        best = combos[int(np.argmax(_objective(tokens, seconds, lam)))]
        arms = np.zeros(counts.size, dtype=np.int64)
        arms[live] = best
        return arms

    def _multistart(self, counts: IntArray, context: FloatArray, values: FloatArray,
                    batch: int, prefill: int, lam: float) -> IntArray:
        off = np.zeros(counts.size, dtype=np.int64)
        starts = [off]
        # Each class's best response while every other class is off.
        starts.append(np.array([int(np.argmax(self._responses(counts, context, off, values, c,
                                                              batch, prefill, lam)))
                                for c in range(counts.size)]))
        # Every class on the same arm (one per arm).
        starts.extend(np.full(counts.size, a, dtype=np.int64) for a in range(1, self.arm_k.size))
        results = [self._ascend(counts, context, a, values, batch, prefill, lam)
                   for a in starts]
        return max(results, key=lambda r: r[1])[0]

    def best_arms(self, now: float, counts: IntArray, batch: int, prefill: int,
                  context: FloatArray | None = None) -> IntArray:
        """Per class: the arm index (into arm_draft/arm_k) for this batch; ``context``: per
        class, its decoding requests' context summed (None: none). The prefill chunks' own
        context is left out: it costs every arm the same."""
        prefill = _PREFILL_GRAIN * round(prefill / _PREFILL_GRAIN)
        mean_context: tuple[int, ...] = ()
        if self.cost.per_context_token and context is not None:
            grains = np.round(context / np.maximum(counts, 1) / _CONTEXT_GRAIN)
            mean_context = tuple((_CONTEXT_GRAIN * grains.astype(np.int64)).tolist())
        context = np.asarray(mean_context or np.zeros(counts.size), dtype=np.float64) * counts
        key = (self.truth.epoch(now), tuple(counts.tolist()), batch, prefill, mean_context)
        arms = self._cache.get(key)
        if arms is None:
            curves = self.truth.expected_curves(now, running=True)
            values = np.array([self._class_arm_values(curves, c) for c in range(counts.size)])
            search = (self._exhaustive if self.arm_k.size ** int((counts > 0).sum())
                      <= EXHAUSTIVE_LIMIT else self._multistart)
            arms = search(counts, context, values, batch, 0, 0.0)
            if prefill:
                # lambda: the best decode-only rate of this batch, tokens per second.
                off = np.zeros(counts.size, dtype=np.int64)
                live = int(np.flatnonzero(counts > 0)[0]) if counts.any() else 0
                lam = float(self._responses(counts, context, arms, values, live, batch, 0, 0.0)[
                    arms[live]]) if counts.any() else 0.0
                arms = search(counts, context, values, batch, prefill, lam) if lam > 0 else off
            self._cache[key] = arms
        return arms

    def assign(self, view: StepView) -> Assignment:
        counts = np.bincount(view.classes, minlength=len(self.info.classes)).astype(np.int64)
        context = (None if view.contexts is None else np.asarray(np.bincount(
            view.classes, weights=view.contexts, minlength=counts.size), dtype=np.float64))
        arms = self.best_arms(view.now, counts, view.batch_size, view.prefill_tokens, context)
        return Assignment.by_class(view.classes, self.arm_draft[arms].astype(np.int64),
                                   self.arm_k[arms].astype(np.int64))


def _objective(tokens: FloatArray | float, seconds: FloatArray, lam: float) -> FloatArray:
    out = tokens - lam * seconds if lam > 0 else tokens / seconds
    return np.asarray(out, dtype=np.float64)
