"""Per-token confidence: each drafted token's true acceptance probability and the draft's
confidence in it, jointly, per class.

A token at a position whose rate (for this request) is r gets an acceptance probability
p ~ Beta(r c, (1 - r) c), c the class's concentration, so E[p] = r: the per-position rates the
scenario gives stay what every policy sees. The draft's confidence is
logit(q) = logit(p) + bias + noise x N(0, 1): bias > 0 is a draft that says more than the target
grants (the target transforms the sampling: penalties, logit bias, structured output).

Only policies that read confidence (``reads_confidence``) get token slots; the engine draws their
outcomes against p. The others keep drawing against r: with p integrated out each position is
still accepted with probability r, independently, so they see the same model, and their runs
stay identical to what they were before this module existed.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from benchmarks.sim.scenario import ConfidenceSpec
from benchmarks.sim.step import FloatArray, IntArray, Policy, TokenSlots
from benchmarks.sim.truth import logit, sigmoid

_EPS = 1e-6  # p and q stay inside (0, 1): their logits are finite


class ConfidenceModel:
    """The scenario's per-class confidence parameters, vectorised by class index."""

    def __init__(self, specs: Sequence[ConfidenceSpec]) -> None:
        """``specs``: per class, in class index order."""
        self.concentration = np.array([c.concentration for c in specs], dtype=np.float64)
        self.bias = np.array([c.bias for c in specs], dtype=np.float64)
        self.noise = np.array([c.noise for c in specs], dtype=np.float64)

    def draw(self, gen: np.random.Generator, draft: int, cls: IntArray,
             rates: FloatArray) -> TokenSlots:
        """Slots for requests of classes ``cls`` whose [request, position] rates are ``rates``."""
        c = self.concentration[cls][:, None]
        p = np.clip(gen.beta(rates * c, (1.0 - rates) * c), _EPS, 1.0 - _EPS)
        shift = self.bias[cls][:, None] + self.noise[cls][:, None] * gen.standard_normal(p.shape)
        q = np.clip(sigmoid(logit(p) + shift), _EPS, 1.0 - _EPS)
        return TokenSlots(draft, q, p)


def survival(acceptance: FloatArray) -> FloatArray:
    """[request, position] probability that every draft up to the position is accepted."""
    return np.asarray(np.cumprod(acceptance, axis=1), dtype=np.float64)


def top_slots(survival: FloatArray, budget: int) -> IntArray:
    """Per request, how many of the ``budget`` slots with the highest survival probability
    ([request, position], falling along a request) are its own: a prefix of its drafts."""
    winners = np.argsort(-survival.ravel(), kind="stable")[:budget]
    admitted = np.zeros(survival.size, dtype=bool)
    admitted[winners] = True
    return np.asarray(admitted.reshape(survival.shape).sum(axis=1), dtype=np.int64)


def reads_confidence(policy: Policy) -> bool:
    """Whether the engine should draw token slots for ``policy``'s steps."""
    return bool(getattr(policy, "reads_confidence", False))
