"""Counterfactual n-gram scoring: proposals are scored as the K asked, so a short or empty
proposal counts as the 1 + accepted tokens its step would really yield."""

from __future__ import annotations

from collections.abc import Sequence

from engine_plugin.ngram import CounterfactualNgram, NgramProposer


def test_short_and_empty_proposals_are_scored_as_k_asked() -> None:
    proposals = {3: [7, 8], 5: []}

    def propose(tokens: Sequence[int], k: int) -> list[int]:
        assert k == 4
        return list(proposals.get(len(tokens), []))

    cf = CounterfactualNgram(propose, k=4)
    prompt = [1, 2]
    assert cf.step("r", [*prompt, 5], num_prompt_tokens=2) is None  # proposes [7, 8]
    # The request produced 7 then 1: one of the two proposed tokens accepted, scored out of 4.
    assert cf.step("r", [*prompt, 5, 7], 2) is None  # still consistent with the proposal
    assert cf.step("r", [*prompt, 5, 7, 1], 2) == (4, 1)  # diverged: resolved; proposes []
    # The empty proposal made at 5 tokens resolves at the next step as no draft accepted.
    assert cf.step("r", [*prompt, 5, 7, 1, 3], 2) == (4, 0)


def test_proposer_finds_the_continuation_of_a_repeated_ngram() -> None:
    proposer = NgramProposer(2, 5, max_model_len=64)
    tokens = [10, 11, 12, 13, 14, 15, 10, 11, 12]
    assert proposer.propose(tokens, 3) == [13, 14, 15]
    assert proposer.propose([1, 2, 3, 4], 3) == []
