"""specpilot.engine_plugin.worker_patch without an engine: the rows rejection sampling sees, the
skip rule, and the guard that finds vLLM 0.32's internals."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from specpilot.engine_plugin.worker_patch import (
    deterministic_draft_probs,
    mark_step,
    should_skip_drafter,
)

torch = pytest.importorskip("torch")


def test_deterministic_rows_are_one_hot_at_their_own_length() -> None:
    probs = torch.rand(3, 2, 5)  # the drafter drafted 2 for requests a, b, c
    drafts = torch.tensor([1, 4, 0, 2, 3, 1, 0])  # a: 2 (model), b: 4 (n-gram), c: 1 (model)
    rows = deterministic_draft_probs(probs, ["a", "b", "c"], ["a", "b", "c"], [2, 4, 1], drafts,
                                     {"b"})
    assert rows is not None and rows.shape == (7, 5)
    assert torch.equal(rows[:2], probs[0, :2]) and torch.equal(rows[6:], probs[2, :1])
    assert torch.equal(rows[2:6], torch.nn.functional.one_hot(drafts[2:6], 5).float())


def test_a_missing_drafter_row_falls_back_to_vllms_one_hot_everywhere() -> None:
    probs = torch.rand(1, 2, 5)
    assert deterministic_draft_probs(probs, ["a"], ["a", "z"], [1, 1], torch.tensor([1, 2]),
                                     {"a"}) is None
    assert deterministic_draft_probs(probs, ["a"], ["a"], [0], torch.tensor([]), {"a"}) is None


def test_skip_only_marked_idle_decode_steps() -> None:
    def output(total: int, k: int, drafts: dict[str, list[int]]) -> SimpleNamespace:
        out = SimpleNamespace(total_num_scheduled_tokens=total, num_spec_tokens_to_schedule=k,
                              num_scheduled_tokens={"a": 1 + len(drafts.get("a", [])), "b": 1},
                              scheduled_spec_decode_tokens=drafts)
        mark_step(out, skip_drafter=True, deterministic=drafts)
        return out

    assert should_skip_drafter(output(4, 0, {"a": [1, 2]}))
    assert not should_skip_drafter(output(4, 2, {"a": [1, 2]}))  # a request wants the drafter
    assert not should_skip_drafter(output(9, 0, {"a": [1, 2]}))  # a prefill (chunk) in the step
    unmarked = SimpleNamespace(total_num_scheduled_tokens=2, num_spec_tokens_to_schedule=0,
                               num_scheduled_tokens={"a": 1, "b": 1},
                               scheduled_spec_decode_tokens={})
    assert not should_skip_drafter(unmarked)  # plain vLLM scheduler: never skip


def test_the_guard_finds_the_runner_internals() -> None:
    pytest.importorskip("vllm")
    from specpilot.engine_plugin.vllm_compat import vllm_version
    from specpilot.engine_plugin.worker_patch import install_worker_patches, patches_installed

    if not (vllm_version() or "").startswith("0.32."):
        pytest.skip("written against vLLM 0.32's runner")
    assert install_worker_patches() and install_worker_patches()  # idempotent
    assert patches_installed()
