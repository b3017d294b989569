"""vLLM's adaptive verification, as the installed vLLM implements it
(vllm/v1/worker/gpu/spec_decode/adaptive_verification.py and acceptance_estimator.py,
``SpeculativeConfig.enable_adaptive_verification``):

- The drafter always proposes ``num_speculative_tokens`` (K) per request; the step pays for them.
- Each draft slot's acceptance is predicted from the draft's confidence by one worker-wide
  logistic model, p = sigmoid(w x logit(q) + b_position) (a shared slope, an intercept per
  position), refitted every ``REFIT_INTERVAL`` steps by one damped Newton (IRLS) step on the slots
  the target graded: the accepted ones and the first rejected one.
- Budget: the slots' survival probabilities (running products of the predictions along a request)
  from the *previous* step's drafts (a new request's read 1), sorted; the draft budget is the
  count that maximises (sampling requests + the sum of the best scores) / (draft cost at this
  request count + verify cost at the step's tokens), both from tables profiled at start-up.
- Admission: a global top-budget over the current drafts' survival probabilities; survival falls
  along a request, so each request gets a prefix.

Adapted to the simulator: the profiled tables are the true noise-free step cost (times the
scenario's ``profile_scale``), the verify table priced at a decode-shaped batch of T / (K + 1)
sequences (vLLM's table is by token count only); requests finishing their prefill in the step
are not counted as sampling ones. vLLM has no class notion: one estimator for every request.
"""

from __future__ import annotations

import math

import numpy as np

from benchmarks.sim.confidence import survival, top_slots
from benchmarks.sim.step import Assignment, EngineInfo, FloatArray, IntArray, StepOutcome, StepView
from benchmarks.sim.truth import StepCost, logit, sigmoid

_MAX_LOG_ODDS = 40.0
_INIT_SLOPE = 0.5
_INIT_BIAS = -0.2


class OnlineAcceptanceEstimator:
    """The worker-wide calibration: ``predict`` at draft time, ``grade`` once the target has
    verified, a refit every ``REFIT_INTERVAL`` graded steps (vLLM's constants)."""

    REFIT_INTERVAL = 100
    DAMPING_OBSERVATIONS = 50.0
    L2 = 1e-3

    def __init__(self, positions: int) -> None:
        self.slope = _INIT_SLOPE
        self.intercepts = np.full(positions, _INIT_BIAS)
        self._info = np.zeros((positions, 3))  # per position: a_k, b_k, c_k of X^T W X
        self._grad = np.zeros((positions, 2))  # per position: g0_k, g1_k of X^T (y - p)
        self._counts = np.zeros(positions)
        self._steps = 0

    def predict(self, confidence: FloatArray) -> tuple[FloatArray, FloatArray]:
        """[request, position] features logit(q) and predicted acceptance."""
        feature = np.clip(logit(confidence), -_MAX_LOG_ODDS, _MAX_LOG_ODDS)
        return feature, sigmoid(self.slope * feature + self.intercepts[None, :])

    def grade(self, feature: FloatArray, pred: FloatArray, admitted: IntArray,
              accepted: IntArray) -> None:
        """Fold one step's graded slots in: the accepted ones (label 1) and the first rejected
        one (label 0); then count the step and refit when it is due."""
        pos = np.arange(feature.shape[1])[None, :]
        observed = (pos <= accepted[:, None]) & (pos < admitted[:, None])
        label = (pos < accepted[:, None]).astype(np.float64)
        w = np.where(observed, pred * (1.0 - pred), 0.0)
        resid = np.where(observed, label - pred, 0.0)
        self._info += np.stack([(w * feature * feature).sum(0), (w * feature).sum(0),
                                w.sum(0)], axis=1)
        self._grad += np.stack([(resid * feature).sum(0), resid.sum(0)], axis=1)
        self._counts += observed.sum(0)
        self._steps += 1
        if self._steps >= self.REFIT_INTERVAL:
            self._steps = 0
            self._refit()

    def _refit(self) -> None:
        """One damped Newton step on the arrowhead system [slope, intercepts]."""
        a_k, b_k, c_k = self._info.T
        c_k = c_k + self.L2
        g0, g1_k = self._grad[:, 0].sum(), self._grad[:, 1]
        n, total = self._counts, self._counts.sum()
        with np.errstate(divide="ignore", invalid="ignore"):
            step_w = (g0 - (b_k * g1_k / c_k).sum()) / (a_k.sum() + self.L2
                                                         - (b_k * b_k / c_k).sum())
            step_w *= total / (total + self.DAMPING_OBSERVATIONS)
            if not math.isfinite(step_w) or self.slope + step_w < 0.0:
                step_w = 0.0
            step_b = (g1_k - b_k * step_w) / c_k * (n / (n + self.DAMPING_OBSERVATIONS))
        self.slope += step_w
        self.intercepts += np.where(np.isfinite(step_b), step_b, 0.0)
        self._info[:] = 0.0
        self._grad[:] = 0.0
        self._counts[:] = 0.0


def draft_budget(stale: FloatArray, sampling: int, draft_seconds: float,
                 verify_seconds: FloatArray) -> int:
    """vLLM's ``get_num_tokens``: the number of draft slots to verify. ``stale`` is the
    [request, position] predictions the budget reads, ``verify_seconds[b]`` the profiled verify
    cost with b draft tokens on top of the step's other tokens."""
    scores = np.sort(survival(stale).ravel())[::-1][:verify_seconds.size - 1]
    tokens = np.concatenate(([sampling], sampling + np.cumsum(scores)))
    return int(np.argmax(tokens / (draft_seconds + verify_seconds[:tokens.size])))


def admit(pred: FloatArray, budget: int) -> IntArray:
    """vLLM's ``_assign_draft_token_budget``: the global top-``budget`` slots by survival."""
    return top_slots(survival(pred), budget)


class VLLMAdaptive:
    """The policy: draft K for every decoding request, verify the admitted prefix."""

    reads_confidence = True

    def __init__(self, info: EngineInfo, cost: StepCost, k: int, max_batched_tokens: int,
                 profile_scale: float = 1.0) -> None:
        if not info.draft_is_model[info.primary_draft]:
            raise ValueError("vllm-adaptive needs a model draft first: it reads its confidence")
        self.info, self.k = info, k
        self.name = "vllm-adaptive" if k == info.max_k else f"vllm-adaptive:{k}"
        self.estimator = OnlineAcceptanceEstimator(k)
        tokens = np.arange(max_batched_tokens + 1)
        batch = np.maximum(1, np.ceil(tokens / (k + 1)))
        self._verify = cost.target_seconds(batch, tokens) * profile_scale  # by token count
        d = info.primary_draft
        self._draft_pass = float(cost.draft_per_pass[d]) * k * profile_scale
        self._draft_token = float(cost.draft_per_token[d]) * k * profile_scale
        self._stale: dict[int, FloatArray] = {}
        self._graded: tuple[FloatArray, FloatArray] | None = None

    def assign(self, view: StepView) -> Assignment:
        n = view.request_ids.size
        slots = view.slots
        assert slots is not None, "the engine draws token slots for vllm-adaptive"
        feature, pred = self.estimator.predict(slots.confidence[:, :self.k])
        ones = np.ones(self.k)
        stale = np.array([self._stale.get(int(r), ones) for r in view.request_ids]).reshape(
            n, self.k)
        non_draft = n + view.prefill_tokens
        room = max(0, min(n * self.k, self._verify.size - 1 - non_draft))
        budget = draft_budget(stale, n, self._draft_pass + self._draft_token * view.batch_size,
                              self._verify[non_draft:non_draft + room + 1])
        k = admit(pred, budget) if budget < n * self.k else np.full(n, self.k, dtype=np.int64)
        for i, r in enumerate(view.request_ids):
            self._stale[int(r)] = pred[i]
        self._graded = (feature, pred)
        draft = np.full(n, slots.draft, dtype=np.int64)
        return Assignment(draft, k, drafted=np.full(n, self.k, dtype=np.int64))

    def observe(self, outcome: StepOutcome) -> None:
        if self._graded is not None:
            self.estimator.grade(*self._graded, outcome.assignment.k, outcome.accepted)
            self._graded = None
        for f in outcome.finished:
            self._stale.pop(f.request_id, None)
