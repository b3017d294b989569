"""Deterministic drafts propose what they find: the drafts a step verifies at each K asked,
estimated from the engines' counts, and arms priced at what they verify, not at K."""

from __future__ import annotations

import numpy as np
import pytest

from specpilot.contract.records import DraftKind, DraftSpec, Reason
from specpilot.controller.core.mix import BatchOthers, OtherClass, arm_seconds
from specpilot.controller.core.policy import PolicyConfig, decide_bucket
from specpilot.controller.core.proposals import PRIOR_STEPS, ProposalLengths
from tests.test_core_policy import _ctx, _step_seconds

HALF_LIFE = 100.0


def test_nothing_counted_prices_k_drafts() -> None:
    lengths = ProposalLengths(4, HALF_LIFE)
    assert lengths.verified_drafts("chat", "suffix", 0.0).tolist() == [0, 1, 2, 3, 4]
    assert not lengths.has_data("chat", "suffix")


def test_the_drafts_verified_are_the_expected_proposal_length_capped_at_k() -> None:
    """Half the steps asked for 4 found nothing, a quarter 1 draft, a quarter all 4:
    E[min(K, L)] = 0.5, 0.75, 1.0, 1.25 for K = 1..4. Steps asked for 2 tell the first two
    positions of every longer K."""
    lengths = ProposalLengths(4, HALF_LIFE)
    lengths.observe("chat", "suffix", (2000, 1000, 0, 0, 1000), 0.0)
    v = lengths.verified_drafts("chat", "suffix", 0.0)
    np.testing.assert_allclose(v, [0, 0.5, 0.75, 1.0, 1.25], atol=0.01)
    # Only K = 2 counted for another class: positions 3-4 stay at the prior (every proposal
    # that reached 2 goes on), so K = 4 is priced as K = 2's drafts plus two more.
    lengths.observe("code", "suffix", (500, 0, 500), 0.0)
    np.testing.assert_allclose(lengths.verified_drafts("code", "suffix", 0.0),
                               [0, 0.5, 1.0, 1.5, 2.0], atol=0.01)


def test_counts_are_forgotten_on_the_half_life_back_to_k() -> None:
    lengths = ProposalLengths(4, HALF_LIFE)
    lengths.observe("chat", "suffix", (1000, 0, 0, 0, 0), 0.0)
    assert lengths.verified_drafts("chat", "suffix", 0.0)[4] < 0.05
    # One half-life later, new steps that propose all 4 weigh twice the old ones.
    lengths.observe("chat", "suffix", (0, 0, 0, 0, 1000), HALF_LIFE)
    again = lengths.verified_drafts("chat", "suffix", HALF_LIFE)
    assert again[1] == pytest.approx(2 / 3, abs=0.01)
    # Long after, the prior (K) is back.
    assert lengths.verified_drafts("chat", "suffix", 30 * HALF_LIFE)[4] == pytest.approx(
        4.0, abs=0.01)


def test_forgetting_a_class_or_draft_drops_its_counts() -> None:
    lengths = ProposalLengths(4, HALF_LIFE)
    lengths.observe("chat", "suffix", (10, 0, 0, 0, 0), 0.0)
    lengths.observe("code", "ngram", (10, 0, 0, 0, 0), 0.0)
    lengths.forget_class("chat")
    lengths.forget_draft("ngram")
    assert not lengths.has_data("chat", "suffix") and not lengths.has_data("code", "ngram")


# A step whose verified tokens cost (batch 1): a short suffix draft is cheap, a full one not.
COSTLY_TOKENS = _step_seconds(0.020, 0.004, 0.0)
RATES = [0.5, 0.3, 0.3, 0.3]  # scored as K asked: a short proposal's tail counts rejected
SHORT = np.array([0.0, 0.6, 0.8, 0.9, 1.0])  # proposals rarely run past one token


def test_an_arm_is_priced_at_the_drafts_it_verifies_and_longer_k_wins_where_they_are_few() -> None:
    suffix = (DraftSpec("suffix", DraftKind.SUFFIX, 4),)
    cfg = PolicyConfig(max_k=4, dwell_seconds=10.0, hysteresis_ratio=0.05)
    ctx, state = _ctx({"suffix": RATES}, None, None, step_seconds=COSTLY_TOKENS, drafts=suffix)
    priced_at_k = decide_bucket(ctx, cfg, state)
    ctx, state = _ctx({"suffix": RATES}, None, None, step_seconds=COSTLY_TOKENS, drafts=suffix,
                      verified_drafts={"suffix": SHORT})
    priced_at_proposals = decide_bucket(ctx, cfg, state)
    # At K drafts each, the tokens past the first do not pay for themselves; at what the
    # drafter proposes they cost little, and a long K takes the tokens it finds.
    assert (priced_at_k.k, priced_at_k.reason) == (1, Reason.GOODPUT)
    assert priced_at_proposals.k >= 3 and priced_at_proposals.reason is Reason.GOODPUT
    assert priced_at_proposals.expected_speedup > priced_at_k.expected_speedup


def test_a_model_draft_is_priced_at_k_whatever_it_verifies() -> None:
    """The control: a model drafter runs K passes, and its curve prices them with its tokens;
    counts of short steps do not make it cheaper."""
    model = (DraftSpec("d", DraftKind.MODEL, 4),)
    cfg = PolicyConfig(max_k=4, dwell_seconds=10.0, hysteresis_ratio=0.05)
    decisions = []
    for verified in ({}, {"d": SHORT}):
        ctx, state = _ctx({"d": RATES}, None, None, step_seconds=COSTLY_TOKENS, drafts=model,
                          verified_drafts=verified)
        decisions.append(decide_bucket(ctx, cfg, state))
    assert decisions[0] == decisions[1] and decisions[0].k == 1


def test_a_mixed_batch_prices_the_class_and_the_others_at_their_verified_drafts() -> None:
    def seconds(batch: float, verified: np.ndarray, *_: object) -> np.ndarray:
        return 0.01 + 0.001 * np.asarray(verified, dtype=np.float64)

    suffix = (DraftSpec("suffix", DraftKind.SUFFIX, 4),)
    # Another class on suffix K=4 that verifies 1 draft a step: 2 tokens a sequence, not 5.
    o_short = BatchOthers.build(9, 0.5, [OtherClass(0.5, "", False, 4, 1.5, verified=1.0)])
    o_full = BatchOthers.build(9, 0.5, [OtherClass(0.5, "", False, 4, 1.5)])
    assert o_full.verified_tokens - o_short.verified_tokens == pytest.approx(4 * 3.0)
    at_k = arm_seconds(o_short, suffix, 4, seconds)
    short = arm_seconds(o_short, suffix, 4, seconds, {"suffix": SHORT})
    n = o_short.self_count
    # Off is the same; each K is cheaper by its undrafted tokens, one per sequence per token.
    assert short[0] == at_k[0]
    np.testing.assert_allclose(at_k[1:] - short[1:],
                               0.001 * n * (np.arange(1, 5) - SHORT[1:]))


def test_the_controller_counts_deterministic_proposals_and_shows_them() -> None:
    """Through the core: an n-gram draft's counts reach its estimate (what GetPolicy and the
    dashboard show), a model draft's do not (it proposes K; its short steps are cuts)."""
    from specpilot.contract.records import AcceptanceRecord, EngineReport
    from tests.test_core_controller import _core

    core = _core()
    core.ingest("e1", EngineReport(sequence=1, interval_seconds=1.0, policy_version=0,
                                   acceptance=(
        AcceptanceRecord("chat", "ngram", 4, (80, 10, 5, 5, 0),
                         steps_by_drafted=(60, 20, 10, 0, 10)),
        AcceptanceRecord("chat", "d", 4, (50, 20, 10, 10, 10),
                         steps_by_drafted=(0, 50, 0, 0, 50)),
    )), now=1.0)
    ngram = core.estimate("chat", "ngram", 1.0, positions=4).verified_drafts
    # Per position, proposals that reached it of those that reached the one before (of 100,
    # 40, 20, 10 steps: 40, 20, 10, 10), each beside the prior's steps that all reached it.
    p = PRIOR_STEPS
    rates = np.array([(40 + p) / (100 + p), (20 + p) / (40 + p), (10 + p) / (20 + p), 1.0])
    np.testing.assert_allclose(ngram, np.concatenate([[0], np.cumsum(np.cumprod(rates))]))
    assert core.estimate("chat", "d", 1.0).verified_drafts == ()
