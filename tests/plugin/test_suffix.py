"""The plugin's suffix draft (``specpilot.engine_plugin.suffix``) on arctic-inference's real suffix
trees: proposals from the request's own prompt and from earlier requests' responses, a rewritten
token list, the engine's settings, and counterfactual scoring."""

from __future__ import annotations

from types import SimpleNamespace

from specpilot.engine_plugin.deterministic import Counterfactual
from specpilot.engine_plugin.suffix import SuffixProposer, SuffixTrees, suffix_available

PATTERN = [10, 11, 12, 13, 14, 15, 16, 17]


def proposer(**trees: float) -> SuffixProposer:
    return SuffixProposer(SuffixTrees(**trees), max_model_len=256)  # type: ignore[arg-type]


def test_the_package_is_installed_here() -> None:
    assert suffix_available()  # make setup builds it: every test below runs the real trees


def test_a_pattern_of_the_prompt_is_continued() -> None:
    p = proposer()
    prompt = [*PATTERN, 1, 2, 3]
    tokens = [*prompt, 10, 11, 12]
    # max_spec_factor 1: a draft is at most as long as the match (3 tokens here), and at most K.
    assert p.propose("r", tokens, len(prompt), 4) == [13, 14, 15]
    assert p.propose("r", tokens, len(prompt), 2) == [13, 14]
    assert proposer(max_spec_factor=2.0).propose("r", tokens, len(prompt), 4) == [13, 14, 15, 16]
    # The request's own response joins its tree as it grows: appended, not re-read.
    tokens += [13, 14, 15, 16, 17, 5, 6, 7, 8, 9]
    assert p.propose("r", [*tokens, 5, 6], len(prompt), 3) == [7, 8]


def _served_then_finished(p: SuffixProposer, req_id: str, response: list[int]) -> None:
    prompt = [1, 2, 3]
    p.propose(req_id, [*prompt, response[0]], len(prompt), 4)  # proposed for once: in the cache
    p.finish(req_id, [*prompt, *response], len(prompt))  # the rest of its response added


def test_an_earlier_response_is_proposed_for_a_later_request() -> None:
    p = proposer()
    response = [40, 41, 42, 43, 44, 45, 46, 47]
    _served_then_finished(p, "r1", response)
    later = [7, 8, 9, 40, 41, 42]
    assert p.propose("r2", later, 3, 4) == [43, 44, 45]
    # Without a global tree, nothing of r1's is kept.
    p = proposer(max_cached_requests=0)
    _served_then_finished(p, "r1", response)
    assert p.propose("r2", later, 3, 4) == []
    # A request never proposed for never enters the cache (its cost is not paid).
    p = proposer()
    p.finish("r1", [1, 2, 3, *response], 3)
    assert p.propose("r2", later, 3, 4) == []


def test_a_rewritten_token_list_restarts_the_request() -> None:
    p = proposer()
    tokens = [*PATTERN, 10, 11]
    assert p.propose("r", tokens, len(PATTERN), 2) == [12, 13]
    # A streaming session's next input: the list is rewritten with a new prompt.
    fresh = [20, 21, 22, 23, 24, 20, 21]
    assert p.propose("r", fresh, 5, 3) == [22, 23]
    p.finish("r", fresh, 5)
    assert "r" not in p._fed


def test_no_room_left_in_the_model_means_no_draft() -> None:
    p = SuffixProposer(SuffixTrees(), max_model_len=len(PATTERN) + 3)
    tokens = [*PATTERN, 10, 11]
    # As vLLM's proposer: at most max_model_len - len - 1 tokens (room for the bonus token).
    assert p.propose("r", tokens, len(PATTERN), 4) == []
    assert p.propose("r", tokens[:-1], len(PATTERN), 4) == [11]


def test_the_engines_settings_are_read_from_its_speculative_config() -> None:
    spec = SimpleNamespace(suffix_decoding_max_tree_depth=8,
                           suffix_decoding_max_cached_requests=5,
                           suffix_decoding_max_spec_factor=2.0,
                           suffix_decoding_min_token_prob=0.2)
    assert SuffixTrees.from_spec(spec) == SuffixTrees(8, 5, 2.0, 0.2)
    assert SuffixTrees.from_spec(None) == SuffixTrees()  # vLLM's defaults: 24, 10000, 1.0, 0.1


def test_counterfactual_scoring_of_suffix_proposals() -> None:
    p = proposer()
    cf = Counterfactual(p.propose, k=3)
    prompt = [*PATTERN, 1]
    tokens = [*prompt, 10, 11]
    assert cf.step("r", tokens, len(prompt)) is None  # proposes [12, 13] (a 2-token match)
    tokens += [12, 13, 14, 15]
    assert cf.step("r", tokens, len(prompt)) == (3, 2)  # both came true, scored as K=3 asked
    tokens += [99]  # against the proposal made at that length, [16, 17, 1]: none came true
    assert cf.step("r", tokens, len(prompt)) == (3, 0)
