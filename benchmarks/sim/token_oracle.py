"""The ceiling once drafts carry per-token confidence: a policy that reads each drafted token's
true acceptance probability (the engine's token slots) and the true step cost.

Each step it picks per request how many of the engine's first draft's tokens to verify. The
expected tokens of request i at K_i are 1 + the sum of its first K_i survival probabilities
(running products of the tokens' acceptance), and the step's cost depends on the allocation only
through the tokens verified (B = sum K_i) and the draft's sequential passes (P = max K_i): for
each P the best B slots are the B highest survivals among positions 1..P (a prefix per request,
since survival falls), so scanning every (P, B) finds the exact optimum. Its objective is the
per-class oracle's (benchmarks/sim/oracle.py): tokens per second in a decode-only step, and in a
step that also prefills, tokens - lambda x seconds with lambda the batch's best decode-only rate.

It drafts only what it verifies and uses only the first draft: it is the per-request ceiling of
that draft, above the per-class oracle wherever the other drafts do not win.
"""

from __future__ import annotations

import numpy as np

from benchmarks.sim.confidence import survival, top_slots
from benchmarks.sim.step import Assignment, EngineInfo, FloatArray, StepOutcome, StepView
from benchmarks.sim.truth import StepCost


class PerTokenOracle:
    name = "per-token-oracle"
    reads_confidence = True

    def __init__(self, info: EngineInfo, cost: StepCost) -> None:
        self.info, self.cost = info, cost

    def observe(self, outcome: StepOutcome) -> None:
        return None

    def _curves(self, survival: FloatArray, batch: int, prefill: int,
                context: float) -> list[tuple[FloatArray, FloatArray]]:
        """Per P = 0..max_k: expected tokens and seconds for B = 0..n x P best slots, every
        decoding request over ``context`` tokens of context."""
        n, d = survival.shape[0], self.info.primary_draft if survival.size else 0
        out = []
        for passes in range(survival.shape[1] + 1):
            scores = np.sort(survival[:, :passes].ravel())[::-1]
            tokens = n + np.concatenate(([0.0], np.cumsum(scores)))
            b = np.arange(tokens.size)
            seconds = (self.cost.target_seconds(batch, n + prefill + b, context * (n + b))
                       + (self.cost.draft_per_pass[d] * passes if passes else 0.0)
                       + self.cost.draft_per_token[d] * b)
            out.append((tokens, seconds))
        return out

    def plan(self, survival: FloatArray, batch: int, prefill: int,
             context: float = 0.0) -> tuple[int, int]:
        """The (passes, budget) of the step's best allocation; ``context``: the decoding
        requests' mean (a slot is priced at it: exact when their contexts are equal)."""
        lam = 0.0
        if prefill:
            lam = max(float(np.max(t / s)) for t, s in self._curves(survival, batch, 0, context))
        best, choice = -np.inf, (0, 0)
        for passes, (tokens, seconds) in enumerate(self._curves(survival, batch, prefill,
                                                                context)):
            value = tokens - lam * seconds if lam > 0 else tokens / seconds
            b = int(np.argmax(value))
            if value[b] > best:
                best, choice = float(value[b]), (passes, b)
        return choice

    def assign(self, view: StepView) -> Assignment:
        slots = view.slots
        assert slots is not None, "the engine draws token slots for per-token-oracle"
        surv = survival(slots.acceptance)
        context = (float(view.contexts.mean())
                   if view.contexts is not None and view.contexts.size else 0.0)
        passes, budget = self.plan(surv, view.batch_size, view.prefill_tokens, context)
        k = top_slots(surv[:, :passes], budget) if passes else np.zeros(
            view.request_ids.size, dtype=np.int64)
        return Assignment(np.full(k.size, slots.draft, dtype=np.int64), k)
