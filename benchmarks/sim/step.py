"""What a policy sees before a step and learns after it: the interface between the simulated engine
and every policy (baselines, specpilot's adapter, the oracle)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt

IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]
FloatArray = npt.NDArray[np.float64]
NO_DRAFT = -1


@dataclass(frozen=True)
class EngineInfo:
    """The static facts every policy may know: names, kinds, K limit, the clock's phases."""

    classes: tuple[str, ...]
    drafts: tuple[str, ...]
    draft_is_model: tuple[bool, ...]
    max_k: int
    max_batch: int
    offline: tuple[bool, ...]
    # Per class: the target transforms its sampling (what a plugin sees on each request); none
    # where empty.
    transformed: tuple[bool, ...] = ()

    @property
    def primary_draft(self) -> int:
        """The draft a single-method engine is configured with: the first one listed."""
        return 0


@dataclass(frozen=True)
class TokenSlots:
    """Per decoding request (the view's order) and position 1..max_k, for one draft: drawn only
    for policies that set ``reads_confidence`` (benchmarks/sim/confidence.py)."""

    draft: int
    confidence: FloatArray  # q: what the draft says of its token; any policy may read it
    acceptance: FloatArray  # p: the token's true acceptance probability; only an oracle may


@dataclass(frozen=True)
class StepView:
    """The step about to run. Arrays are per decoding request (prefilling ones never draft)."""

    now: float
    batch_size: int  # sequences in the step, prefilling ones included (as the plugin counts)
    prefill_tokens: int
    request_ids: IntArray
    classes: IntArray
    slots: TokenSlots | None = None
    # Per decoding request: the tokens its KV cache holds before the step (prompt and generated
    # tokens, the newest one aside: the step computes it); None where not given.
    contexts: IntArray | None = None
    # Over every sequence of the step, prefilling ones included: the same, summed (what the
    # engine plugin reports as a step's context).
    context_tokens: int = 0


@dataclass(frozen=True)
class Assignment:
    """Per decoding request: the draft index (NO_DRAFT for none) and K (0 = no speculation), and
    whether the step scores it counterfactually with the n-gram draft (None: none), and how many
    tokens the draft proposed (None: K; more than K when the engine drafts first and verifies
    a cut, as vLLM's adaptive verification does: the step pays for every proposed token)."""

    draft: IntArray
    k: IntArray
    score: BoolArray | None = None
    drafted: IntArray | None = None

    @classmethod
    def uniform(cls, n: int, draft: int, k: int) -> Assignment:
        d = draft if k > 0 else NO_DRAFT
        return cls(np.full(n, d, dtype=np.int64), np.full(n, k, dtype=np.int64))

    @classmethod
    def by_class(cls, classes: IntArray, draft_of: IntArray, k_of: IntArray) -> Assignment:
        """Look each request's class up in per-class tables."""
        k = k_of[classes]
        return cls(np.where(k > 0, draft_of[classes], NO_DRAFT).astype(np.int64), k)


@dataclass(frozen=True)
class FinishedRequest:
    request_id: int
    traffic_class: int
    prompt_tokens: int
    output_tokens: int
    drafted_tokens: int
    accepted_tokens: int
    latency_seconds: float


@dataclass(frozen=True)
class StepOutcome:
    view: StepView
    assignment: Assignment
    seconds: float
    accepted: IntArray  # drafts accepted per decoding request
    emitted: IntArray  # tokens emitted per decoding request
    verified_tokens: int  # target tokens in the step: decode (1 + K each) plus prefill
    draft_passes: IntArray  # per draft
    draft_tokens: IntArray  # per draft
    finished: tuple[FinishedRequest, ...]
    # Counterfactual n-gram: drafts an n-gram draft would have had accepted at max K, per
    # decoding request; -1 where not scored.
    counterfactual_accepted: IntArray | None = None


class Policy(Protocol):
    """A policy may also set ``reads_confidence = True`` to get token slots in its views."""

    name: str

    def assign(self, view: StepView) -> Assignment: ...

    def observe(self, outcome: StepOutcome) -> None: ...
