"""The start-up profile's hand-off: what the worker measured becomes the hello's step shapes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from specpilot.engine_plugin import profile
from specpilot.engine_plugin.profile import (
    PROFILE_BATCH_SIZES,
    PROFILE_KS,
    RawProfile,
    prefill_shape,
    profile_batch_sizes,
    profile_plan,
    profile_shapes,
    step_profile,
)


@pytest.fixture
def measured() -> Iterator[None]:
    saved = profile._measured
    try:
        yield
    finally:
        profile._measured = saved


def test_no_profile_means_an_empty_field(measured: None) -> None:
    profile._measured = None
    assert step_profile("d") == ()


def test_passes_beyond_k_are_taken_off_the_measured_step(measured: None) -> None:
    # Dummy steps run all 4 drafter passes: 2 ms a pass at these sizes.
    profile._measured = RawProfile(4, ((1, 0, 0.010, 0), (1, 2, 0.012, 0)),
                                   ((1, 0.002), (3, 0.002)))
    got = {(p.batch_size, p.draft_passes): p for p in step_profile("d")}
    assert got[(1, 0)].draft == "" and got[(1, 0)].seconds == pytest.approx(0.002)
    assert got[(1, 2)].draft == "d" and got[(1, 2)].verified_tokens == 3
    assert got[(1, 2)].seconds == pytest.approx(0.012 - 4 * 0.002 + 2 * 0.002)


def test_a_profile_is_sent_once_never_as_a_later_engines(measured: None) -> None:
    # An engine whose worker ran in this process, then one whose worker runs in another and
    # hands off nothing: the second sends no profile, not the first one's.
    profile._measured = RawProfile(0, ((16, 0, 0.004, 0),), ())
    assert len(step_profile("")) == 1
    assert step_profile("") == ()


def test_without_a_model_drafter_every_point_is_the_target_alone(measured: None) -> None:
    profile._measured = RawProfile(0, ((16, 0, 0.004, 0), (16, 2, 0.006, 0)), ())
    assert [(p.verified_tokens, p.draft, p.draft_passes) for p in step_profile("")] == [
        (16, "", 0), (48, "", 0)]


def test_shapes_go_breadth_first_so_a_short_budget_still_reaches_both_ends() -> None:
    shapes = profile_shapes(max_seqs=32, max_k=4, max_tokens=8192)
    # No speculation at every batch size, then the largest K, then the Ks between.
    assert shapes[:6] == [(1, 0), (16, 0), (32, 0), (1, 4), (16, 4), (32, 4)]
    assert sorted(shapes) == sorted((b, k) for b in PROFILE_BATCH_SIZES for k in PROFILE_KS)
    # The engine's limits: batch sizes above max_num_seqs, K above the configured K and steps
    # above max_num_batched_tokens are never timed.
    assert profile_shapes(max_seqs=16, max_k=2, max_tokens=40) == [
        (1, 0), (16, 0), (1, 2), (1, 1), (16, 1)]
    assert profile_shapes(max_seqs=8, max_k=0, max_tokens=8192) == [(1, 0)]


def test_an_engine_of_larger_batches_times_them_up_to_its_max_num_seqs() -> None:
    # The steps the cost model would otherwise price from its prior alone: doublings, then the
    # engine's own largest batch.
    assert profile_batch_sizes(256) == [1, 16, 32, 64, 128, 256]
    assert profile_batch_sizes(100) == [1, 16, 32, 64, 100]
    assert profile_batch_sizes(32) == list(PROFILE_BATCH_SIZES)
    # The batch sizes every engine times come first: a budget spent on the largest steps never
    # costs the small ones.
    assert profile_shapes(max_seqs=100, max_k=1, max_tokens=160) == [
        (1, 0), (16, 0), (32, 0), (1, 1), (16, 1), (32, 1), (64, 0), (100, 0), (64, 1)]
    assert profile_plan(100, 1, 160, 2048) == [
        (1, 0, 0), (16, 0, 0), (32, 0, 0), (1, 1, 0), (16, 1, 0), (32, 1, 0),
        (1, 0, 512), (16, 0, 512), (32, 0, 512), (1, 1, 512), (16, 1, 512), (32, 1, 512),
        (64, 0, 0), (100, 0, 0), (64, 1, 0), (64, 0, 512), (100, 0, 512), (64, 1, 512)]


class _Runner:
    """The parts of a vLLM model runner ``take_profile`` reads (no drafter)."""

    speculative_config = None
    scheduler_config = type("S", (), {"max_num_seqs": 32})()
    max_num_tokens = 8192
    max_model_len = 300
    uniform_decode_query_len = 1

    def __init__(self) -> None:
        self.calls: list[tuple[int, int | None]] = []
        self.forced: list[bool] = []  # force_attention, per call

    def _dummy_run(self, num_tokens: int, uniform_decode: bool = False,
                   force_attention: bool = False, profile_seq_lens: int | None = None) -> None:
        self.calls.append((num_tokens, profile_seq_lens))
        self.forced.append(force_attention)


def test_the_ends_are_timed_again_at_a_long_context(measured: None) -> None:
    """No speculation at every batch size is timed at the dummy's own context and again at a
    long one (capped by the model's length), so the cost model's context column is identified
    before traffic; the hello's points say which context each ran at."""
    runner = _Runner()
    raw = profile.take_profile(runner, budget_seconds=60.0)
    assert [(b, k, c) for b, k, _, c in raw.steps] == [
        (1, 0, 0), (16, 0, 0), (32, 0, 0), (1, 0, 299), (16, 0, 299), (32, 0, 299)]
    assert (16, 300) in runner.calls and (16, None) in runner.calls
    profile._measured = raw
    assert sorted({p.context_tokens for p in step_profile("")}) == [0, 299]


def test_one_step_that_prefills_is_timed_second(
        measured: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The prefill step runs right after the smallest decode step (a budget spent on the
    decode plan still has it), as vLLM's own profiling batch: 544 tokens over the 32
    sequences, no attention metadata forced (the CPU runner's worker crashes with it); the
    hello's point counts one token a sequence and the others as prefill, and survives the
    hand-off between processes. A small token budget per step caps it; the control: a budget
    of one token a sequence leaves nothing to prefill, and no prefill point is sent."""
    runner = _Runner()
    raw = profile.take_profile(runner, budget_seconds=60.0)
    first = runner.calls.index((512 + 32, None))
    assert set(runner.calls[:first]) == {(1, None)} and raw.steps[0][:2] == (1, 0)
    # Only the decode steps build their attention metadata.
    assert [f for (n, _), f in zip(runner.calls, runner.forced, strict=True)
            if n == 512 + 32] == [False] * 7
    assert all(f for (n, _), f in zip(runner.calls, runner.forced, strict=True) if n != 544)
    assert [(b, p) for b, p, _ in raw.prefill] == [(32, 512)]
    assert prefill_shape(32, 256) == (256, 32, 224)
    monkeypatch.setenv(profile.PROFILE_FILE_ENV, str(tmp_path / "profile"))
    profile._hand_off(raw, 0)
    profile._measured = None
    points = step_profile("")
    (mixed,) = [p for p in points if p.prefill_tokens]
    assert (mixed.batch_size, mixed.verified_tokens, mixed.prefill_tokens) == (32, 32, 512)
    assert len(points) == len(raw.steps) + 1
    tight = _Runner()
    tight.max_num_tokens = 32
    assert profile.take_profile(tight, budget_seconds=60.0).prefill == ()


def test_a_spent_budget_still_times_the_smallest_decode_step_and_the_prefill_step(
        measured: None) -> None:
    """On a CPU where the prefill step alone spends the budget, the profile still holds a
    decode step (the controller bounds what a report may count by the fastest one); the budget
    stops the rest of the plan."""
    raw = profile.take_profile(_Runner(), budget_seconds=0.0)
    assert [(b, k, c) for b, k, _, c in raw.steps] == [(1, 0, 0)]
    assert [(b, p) for b, p, _ in raw.prefill] == [(32, 512)]
