"""The drafter's early stop, worker side, on real tensors: a proposer shaped like vLLM's (its
draft loop calls ``_sample_draft_tokens`` once per pass) under the plugin's own wrappers. The
real engine's passes are in tests/engine/test_drafter_stop.py."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from specpilot.contract.confidence import N_CONFIDENCE_BUCKETS
from specpilot.contract.records import CalibrationRows
from specpilot.engine_plugin import drafter_stop as ds
from specpilot.engine_plugin.draft_confidence import _wrap_sample_draft_tokens, capture
from specpilot.engine_plugin.policy.cut import DrafterStop

K = 4
# Per pass, each of two requests' draft probabilities over a vocabulary of 3.
PROBS = [torch.tensor([[0.6, 0.3, 0.1], [0.1, 0.2, 0.7]]) + 0.01 * p for p in range(K)]


class _Proposer:
    """vLLM's ``SpecDecodeBaseProposer.propose`` reduced to its draft loop."""

    parallel_drafting = False

    def __init__(self) -> None:
        self.num_speculative_tokens = K
        self._last_draft_probs: torch.Tensor | None = None
        self.passes = 0

    def _sample_draft_tokens(self, hidden_states: Any, sampling_metadata: Any
                             ) -> tuple[torch.Tensor, torch.Tensor]:
        probs = PROBS[hidden_states]
        return probs.argmax(dim=-1), probs

    def propose(self, num_speculative_tokens: int) -> torch.Tensor:
        self.num_speculative_tokens = num_speculative_tokens
        self._last_draft_probs = None
        tokens, probs = [], []
        for p in range(num_speculative_tokens):
            self.passes += 1
            t, q = self._sample_draft_tokens(p, None)
            tokens.append(t)
            probs.append(q)
        self._last_draft_probs = torch.stack(probs, dim=1).contiguous()
        return torch.stack(tokens, dim=1)


_Proposer._sample_draft_tokens = _wrap_sample_draft_tokens(  # type: ignore[method-assign]
    _Proposer._sample_draft_tokens)
_Proposer.propose = ds._wrap_propose(_Proposer.propose)  # type: ignore[method-assign]


def _plan(pass_tokens: float, accept: float = 0.5) -> ds.StopPlan:
    """Both requests' tokens accepted at ``accept`` whatever their confidence, the class's
    mean 0.9: at 0.5 below the mean, so a pass priced above its gain stops the drafter."""
    rows = CalibrationRows("a", "d", False, K, (accept,) * (K * N_CONFIDENCE_BUCKETS),
                           (0.9,) * K)
    return ds.StopPlan(0.2, pass_tokens, {"r0": (rows, K), "r1": (rows, K)})


def _propose(plan: ds.StopPlan | None) -> tuple[_Proposer, torch.Tensor]:
    proposer = _Proposer()
    runner = SimpleNamespace(drafter=proposer, input_batch=SimpleNamespace(req_ids=["r0", "r1"]))
    output = SimpleNamespace(num_spec_tokens_to_schedule=K)
    ds.mark_stop(output, plan)
    with capture(proposer), ds.stopping(runner, output):
        tokens = proposer.propose(K)
    assert getattr(proposer, "_specpilot_after_pass", None) is None  # the step's stop is gone
    return proposer, tokens


@pytest.fixture(autouse=True)
def _installed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(ds._state, "installed", True)


def test_a_pass_that_does_not_pay_ends_the_draft_loop_as_a_shorter_call_would() -> None:
    proposer, tokens = _propose(_plan(pass_tokens=1e6))
    assert proposer.passes == 1 and proposer.num_speculative_tokens == 1
    assert tokens.tolist() == [[0], [2]]
    # The probabilities stay with their tokens: pass 1's, one row per request.
    assert proposer._last_draft_probs is not None
    assert torch.equal(proposer._last_draft_probs, PROBS[0].unsqueeze(1))


def test_passes_that_pay_run_and_a_step_without_a_plan_runs_every_pass() -> None:
    for plan in (_plan(pass_tokens=0.0, accept=0.9), _plan(pass_tokens=1e6, accept=0.9), None):
        proposer, tokens = _propose(plan)
        assert proposer.passes == K and tokens.shape == (2, K), plan
        assert proposer._last_draft_probs is not None
        assert proposer._last_draft_probs.shape == (2, K, 3)


def test_the_stop_never_acts_blind_nor_when_not_installed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # A pass whose confidences were not noted (a drafter the capture does not read): no stop.
    monkeypatch.setattr(ds, "NOTES_ATTR", "_nothing_noted_here")
    assert _propose(_plan(pass_tokens=1e6))[0].passes == K
    monkeypatch.undo()
    monkeypatch.setitem(ds._state, "installed", False)
    assert _propose(_plan(pass_tokens=1e6))[0].passes == K


def test_a_stop_that_fails_drafts_in_full(monkeypatch: pytest.MonkeyPatch,
                                          caplog: pytest.LogCaptureFixture) -> None:
    def broken(self: Any, confidences: Any) -> bool:
        raise ValueError("broken")

    monkeypatch.setattr(DrafterStop, "after_pass", broken)
    monkeypatch.delitem(ds._state, "failure_logged", raising=False)
    for _ in range(3):
        assert _propose(_plan(pass_tokens=1e6))[0].passes == K
    assert caplog.text.count("the drafter's stop failed") == 1  # once, not every step


def test_the_installed_stop_matches_this_vllm() -> None:
    cls, why = ds._proposer_class()
    assert cls is not None, why
