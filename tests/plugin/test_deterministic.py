"""Counterfactual scoring of deterministic drafts: proposals are scored as the K asked, so a
short or empty proposal counts as the 1 + accepted tokens its step would really yield; and the
incremental n-gram proposer (per-request buffers appended with the new tokens) proposes and
scores exactly what proposals from the whole context, re-read every step, do."""

from __future__ import annotations

import random
from collections.abc import Sequence

import numpy as np
import pytest

from specpilot.engine_plugin import ngram
from specpilot.engine_plugin.deterministic import Counterfactual
from specpilot.engine_plugin.ngram import NgramProposer


def test_a_proposal_is_scored_only_after_a_new_token() -> None:
    """A request in chunked prefill: its list holds the whole prompt and grows by nothing from
    step to step, so an empty proposal must not be scored as a step with none accepted."""
    cf = Counterfactual(lambda req_id, tokens, num_prompt, k: [], k=4)
    prompt = [1, 2, 3]
    assert [cf.step("r", prompt, 3) for _ in range(5)] == [None] * 5
    assert cf.step("r", [*prompt, 9], 3) == (4, 0)  # the prefill's sampled token came


def test_short_and_empty_proposals_are_scored_as_k_asked() -> None:
    proposals = {3: [7, 8], 5: []}

    def propose(req_id: str, tokens: Sequence[int], num_prompt_tokens: int, k: int
                ) -> list[int]:
        assert (req_id, num_prompt_tokens, k) == ("r", 2, 4)
        return list(proposals.get(len(tokens), []))

    cf = Counterfactual(propose, k=4)
    prompt = [1, 2]
    assert cf.step("r", [*prompt, 5], num_prompt_tokens=2) is None  # proposes [7, 8]
    # The request produced 7 then 1: one of the two proposed tokens accepted, scored out of 4.
    assert cf.step("r", [*prompt, 5, 7], 2) is None  # still consistent with the proposal
    assert cf.step("r", [*prompt, 5, 7, 1], 2) == (4, 1)  # diverged: resolved; proposes []
    # The empty proposal made at 5 tokens resolves at the next step as no draft accepted.
    assert cf.step("r", [*prompt, 5, 7, 1, 3], 2) == (4, 0)


def test_the_matcher_is_compiled_when_the_proposer_is_built() -> None:
    """numba compiles vLLM's matcher on its first call (about a second on a CPU); the proposer
    calls it when it is built, at engine start, so no served step's scheduler waits on it. Run
    in a fresh process: the control shows importing the matcher compiles nothing."""
    import subprocess
    import sys

    script = ("from vllm.v1.spec_decode.ngram_proposer import "
              "_find_longest_matched_ngram_and_propose_tokens as find\n"
              "before = len(find.signatures)\n"
              "from specpilot.engine_plugin.ngram import NgramProposer\n"
              "NgramProposer(2, 5, 2048)\n"
              "print(before, len(find.signatures))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300, check=True)
    before, after = map(int, done.stdout.split()[-2:])
    assert (before, after) == (0, 1), done.stdout + done.stderr


def test_proposer_finds_the_continuation_of_a_repeated_ngram() -> None:
    proposer = NgramProposer(2, 5, max_model_len=64)
    tokens = [10, 11, 12, 13, 14, 15, 10, 11, 12]
    assert proposer.propose_tokens(tokens, 3) == [13, 14, 15]
    assert proposer.propose_tokens([1, 2, 3, 4], 3) == []
    window = np.asarray(tokens, dtype=np.int32)
    assert proposer.propose_window(window, len(tokens), 3) == [13, 14, 15]
    assert proposer.propose("r", tokens, 2, 3) == [13, 14, 15]


@pytest.mark.parametrize(("window", "steps"), [(16, 3000), (64, 3000), (2048, 600)])
@pytest.mark.parametrize("seed", range(3))
def test_incremental_scorer_matches_the_reference(monkeypatch: pytest.MonkeyPatch, window: int,
                                                  steps: int, seed: int) -> None:
    """Random streams of several interleaved requests: each step appends 1-6 tokens (a verified
    step), sometimes hundreds (the request was served by n-gram drafts and not scored), sometimes
    vLLM rewrites the list (a streaming session's next input: the last token dropped and prompt
    tokens added, or only the last token replaced). Proposals and (K, accepted) records must be
    identical, call by call."""
    monkeypatch.setattr(ngram, "MAX_CONTEXT_TOKENS", window)
    rng = random.Random(seed)
    k = rng.choice([1, 3, 4, 8])
    proposer = NgramProposer(2, rng.choice([3, 5]), max_model_len=6000)
    new_proposals: list[list[int]] = []
    old_proposals: list[list[int]] = []

    def new_propose(req_id: str, tokens: Sequence[int], num_prompt: int, kk: int) -> list[int]:
        new_proposals.append(proposer.propose(req_id, tokens, num_prompt, kk))
        return new_proposals[-1]

    def old_propose(req_id: str, tokens: Sequence[int], num_prompt: int, kk: int) -> list[int]:
        old_proposals.append(proposer.propose_tokens(tokens, kk))  # the context read whole
        return old_proposals[-1]

    new, old = Counterfactual(new_propose, k), Counterfactual(old_propose, k)
    vocab = rng.choice([3, 8, 50])  # small vocabularies repeat n-grams: proposals are not empty
    streams: dict[str, tuple[list[int], int]] = {}
    for _ in range(steps):
        req = f"r{rng.randrange(5)}"
        if req not in streams or rng.random() < 0.002:
            if req in streams:  # finished: forgotten, and the id comes back as a new request
                new.forget(req)
                old.forget(req)
                proposer.finish(req, *streams[req])
            prompt = rng.randrange(0, 40)
            streams[req] = ([rng.randrange(vocab) for _ in range(prompt)], prompt)
        tokens, num_prompt = streams[req]
        r = rng.random()
        if r < 0.01 and len(tokens) > num_prompt:  # streaming session: new input
            del tokens[-1]
            tokens.extend(rng.randrange(vocab) for _ in range(rng.randrange(0, 5)))
            num_prompt = len(tokens)
        elif r < 0.015 and len(tokens) > num_prompt:  # same, with no input: the prompt stays
            tokens[-1] = vocab
        elif r < 0.03:
            jump = rng.randrange(window // 2, 3 * window)
            tokens.extend(rng.randrange(vocab) for _ in range(jump))
        else:
            # Half the time the n-gram proposal itself comes true (then one token of the target's
            # own), so proposals resolve both ways.
            if rng.random() < 0.5:
                tokens.extend(proposer.propose_tokens(tokens, rng.randrange(1, k + 1)))
            tokens.extend(rng.randrange(vocab) for _ in range(rng.randrange(1, 4)))
        streams[req] = (tokens, num_prompt)
        assert new.step(req, tokens, num_prompt) == old.step(req, tokens, num_prompt)
    assert new_proposals == old_proposals
    assert sum(map(bool, new_proposals)) > 100  # the comparison covered real proposals
