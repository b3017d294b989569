"""The worker-side capture of the drafter's confidence, on real tensors: the probability of the
greedy token, gathered per request and position only in steps specpilot's scheduler marked."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from specpilot.engine_plugin import draft_confidence as dc
from specpilot.engine_plugin.worker_patch import SKIP_ATTR, _wrap_propose


class _Drafter:
    """A drafter whose logits come from a fixed table, one row per request."""

    use_local_argmax_reduction = use_heterogeneous_vocab = False

    def __init__(self, logits: torch.Tensor) -> None:
        self.model = SimpleNamespace(compute_logits=lambda hidden: logits)

    def _greedy_sample(self, hidden_states: Any) -> torch.Tensor:
        return self.model.compute_logits(hidden_states).argmax(dim=-1)  # vLLM's own


LOGITS = torch.tensor([[2.0, 0.0, 0.0], [0.0, 0.0, 5.0]])
greedy = dc._wrap_greedy_sample(_Drafter._greedy_sample)


def test_a_captured_step_keeps_each_tokens_probability_by_request_and_position() -> None:
    drafter = _Drafter(LOGITS)
    with dc.capture(drafter):
        tokens = greedy(drafter, None)
        greedy(drafter, None)
    assert tokens.tolist() == [0, 2]
    last = getattr(drafter, dc._LAST)
    expected = torch.softmax(LOGITS, dim=-1).amax(dim=-1)
    assert last.shape == (2, 2)
    assert torch.allclose(last[:, 0], expected) and torch.allclose(last[:, 1], expected)


def test_outside_a_capture_nothing_is_noted() -> None:
    drafter = _Drafter(LOGITS)
    assert greedy(drafter, None).tolist() == [0, 2]  # the tokens are vLLM's argmax either way
    assert getattr(drafter, dc.NOTES_ATTR, None) is None
    assert getattr(drafter, dc._LAST, None) is None


def test_only_steps_specpilots_scheduler_marked_are_captured() -> None:
    def propose(runner: Any, scheduler_output: Any) -> list[list[int]]:
        greedy(runner.drafter, None)
        return [[0], [2]]

    wrapped = _wrap_propose(propose)

    def captured(output: Any) -> Any:
        runner = SimpleNamespace(drafter=_Drafter(LOGITS))
        wrapped(runner, output)
        return getattr(runner.drafter, dc._LAST, None)

    plain = SimpleNamespace(num_spec_tokens_to_schedule=1)
    marked = SimpleNamespace(num_spec_tokens_to_schedule=1, **{SKIP_ATTR: False})
    assert captured(plain) is None  # a plain vLLM scheduler's step costs nothing
    assert captured(marked) is not None  # the control
