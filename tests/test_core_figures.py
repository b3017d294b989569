"""Plausible figures or none: what the decision log, the policy and the explanations show of an
arm stays within what a step can deliver (at most K + 1 tokens per step, a step time no further
above the plain step's than the ratios the cost model measured), says "too little evidence"
where the posteriors cannot rank the arms compared, and a class's table does not flip across
neighbouring batch ranges on one request's evidence.

The engines here are CPU n-gram engines as a user first runs them: a start-up profile of a few
shapes (noisy, as on a busy machine, or exact), then one request's report."""

from __future__ import annotations

import re

import numpy as np
import pytest

from specpilot.contract.records import (
    AcceptanceRecord,
    Decision,
    DraftKind,
    DraftSpec,
    EngineHello,
    EngineReport,
    Override,
    Reason,
    StepProfile,
    StepTimingRecord,
)
from specpilot.controller.core.config import CoreConfig
from specpilot.controller.core.controller import ControllerCore
from specpilot.controller.server.explain import decision_text, explanation_text
from specpilot.controller.settings import core_config, load_settings

NGRAM = DraftSpec("ngram", DraftKind.NGRAM, 4, "v")
# (batch size, verified tokens, context tokens, milliseconds): the profile of a CPU engine
# timed while other work shared its cores, cut short by its time budget. Fitted freely against
# the cost prior, it priced a plain step at batch 64 and above at the 1 us floor.
NOISY_PROFILE = ((1, 1, 0, 20.5), (16, 16, 0, 42.7), (32, 32, 0, 71.7), (1, 5, 0, 15.6),
                 (1, 1, 512, 28.0), (16, 16, 512, 33.9), (32, 32, 512, 71.6),
                 (1, 5, 512, 22.4), (1, 2, 0, 30.2), (16, 32, 0, 112.8))


def _cpu_seconds(batch: int, k: int, context: int = 0) -> float:
    """A small model on two CPU cores: memory-bound up to 16 verified tokens, then each costs
    four times as much."""
    tokens = batch * (1 + k)
    return (0.024 + 0.0012 * batch + 0.0001 * tokens + 0.0003 * max(0, tokens - 16)
            + 2e-7 * context * tokens)


def _exact_profile() -> tuple[StepProfile, ...]:
    return tuple(StepProfile(b, b * (1 + k), "", 0, _cpu_seconds(b, k, c), c)
                 for b in (1, 16, 32) for k in (0, 4, 1, 2) for c in ((0, 512) if k in (0, 4)
                                                                        else (0,)))


def _engine(profile: tuple[StepProfile, ...], config: CoreConfig | None = None
            ) -> ControllerCore:
    core = ControllerCore(config or core_config(load_settings()), np.random.default_rng(0))
    core.connect_engine(EngineHello(
        "e1", "smollm2", "v", (NGRAM,), 4, per_request_k=False, batch_wide_k=True,
        ngram_counterfactual=True, max_batch_size=256, step_profile=profile), now=0.0)
    return core


def _noisy() -> ControllerCore:
    return _engine(tuple(StepProfile(b, t, "", 0, ms / 1e3, c) for b, t, c, ms in NOISY_PROFILE))


def _report(core: ControllerCore, seq: int, batch: int, k: int, accepted: tuple[int, ...],
            seconds: float, context: int, steps: int = 20) -> None:
    """One report: ``steps`` steps of ``batch`` sequences of class chat at K, their acceptance
    ``accepted`` (verification steps by accepted drafts) and mean step ``seconds``."""
    core.ingest("e1", EngineReport(
        seq, 1.0, 0, acceptance=(AcceptanceRecord("chat", "ngram", k, accepted),),
        step_timings=(StepTimingRecord(core.config.bucket_of(batch), "ngram", k, steps,
                                       steps * batch, steps * batch * (1 + k), 0,
                                       steps * seconds, steps * batch * context),),
        running_requests=batch), now=float(seq))


def _one_request_on_the_noisy_engine() -> ControllerCore:
    core = _noisy()
    _report(core, 1, 4, 4, (10, 10, 10, 10, 10), 0.0849, 1365)
    core.decide(1.0)
    return core


def _speculative_ks(decisions: tuple[Decision, ...]) -> list[int]:
    return [d.k for d in sorted(decisions, key=lambda d: d.bucket)]


# --- 1: what a step can deliver ---------------------------------------------------------------
def test_every_arm_shown_is_priced_within_what_steps_measured() -> None:
    core = _one_request_on_the_noisy_engine()
    plain = []
    for bucket in range(core.config.n_buckets):
        ex = core.explain("chat", bucket, 1.0)
        off = ex.arms[0]
        plain.append((ex.batch_size, off.step_seconds))
        for a in ex.arms:
            assert a.expected_tokens <= a.k + 1, (bucket, a)
            assert a.step_seconds >= off.step_seconds, (bucket, a)
    # A larger batch never steps faster without speculation: an untimed batch size is priced
    # from the largest one timed, never as free.
    sizes = [t for _, t in sorted(plain)]
    assert sizes == sorted(sizes), plain
    assert min(sizes) > 0.01, plain
    snap = core.snapshot(1.0)
    assert snap.step_ratio_range is not None
    hi = snap.step_ratio_range[1]
    assert 1.0 <= hi < 5.0, snap.step_ratio_range
    for bucket in range(core.config.n_buckets):
        ex = core.explain("chat", bucket, 1.0)
        off = ex.arms[0]
        for a in ex.arms:
            assert a.step_seconds <= off.step_seconds * hi * (1 + 1e-9), (bucket, a)
            # Two arms' goodputs differ by at most their tokens per step and the ratio measured.
            for b in ex.arms:
                assert a.goodput <= b.goodput * (a.k + 1) * hi * (1 + 1e-9), (bucket, a, b)
    for e in snap.events("chat"):  # the whole batch is the class's: no other class to slow
        fig = e.figures
        assert fig is not None
        for f in (fig.chosen, fig.previous, fig.best):
            if f is not None:
                assert f.expected_tokens <= f.k + 1 and 1 / hi <= f.speedup <= f.k + 1, (e, f)


# --- 5: a pinned K's speedup ---------------------------------------------------------------
def test_a_pinned_k_expects_a_speedup_a_step_can_deliver() -> None:
    core = _one_request_on_the_noisy_engine()
    core.set_override(Override("chat", pin_k=2))
    core.decide(2.0)
    snap = core.snapshot(2.0)
    decisions = snap.class_view("chat").decisions
    assert {(d.reason, d.k) for d in decisions} == {(Reason.OVERRIDE, 2)}
    # At most 3 tokens a step, and a step of K=2 is no hundred plain steps ("0.00x").
    assert all(0.01 <= d.expected_speedup <= 3 for d in decisions), decisions
    # At least 1 token a step in at most the largest ratio of step times measured.
    assert snap.step_ratio_range is not None
    hi = snap.step_ratio_range[1]
    assert all(1 / hi <= d.expected_speedup for d in decisions), (hi, decisions)
    for e in snap.events("chat"):
        assert "below 0.01x" not in decision_text(e), decision_text(e)


# --- 2: too little evidence ------------------------------------------------------------------
def _cpu_engine(config: CoreConfig | None = None) -> ControllerCore:
    return _engine(_exact_profile(), config)


def _requests(core: ControllerCore, first: int, last: int, batch: int = 3, k: int = 2,
              steps: int = 20, acceptance: float = 0.45) -> None:
    """Reports of n-gram ``acceptance`` at batch ``batch``, K=2, one a second."""
    rng = np.random.default_rng(first)
    for t in range(first, last + 1):
        hist = np.bincount(np.minimum(rng.geometric(1 - acceptance, steps * batch) - 1, k),
                           minlength=k + 1)
        _report(core, t, batch, k, tuple(int(h) for h in hist), _cpu_seconds(batch, k, 300),
                300, steps)
        core.decide(float(t))


def _one_step_at_16(core: ControllerCore) -> None:
    """One step of 16 sequences at K=2 drafting for a class of acceptance about a third: 4 first
    drafts accepted, 1 of them the second."""
    _report(core, 1, 16, 2, (12, 3, 1), _cpu_seconds(16, 2, 300), 300, steps=1)
    core.decide(1.0)


def test_one_request_is_too_little_evidence_to_rank_and_many_are_enough() -> None:
    core = _cpu_engine()
    _one_step_at_16(core)
    measured = core.config.bucket_of(16)
    first = core.snapshot(1.0).class_view("chat").decisions[measured]
    text = explanation_text(core.explain("chat", measured, 1.0))
    assert "too little evidence to tell it from no speculation" in text, text
    assert not re.search(r"\d\.\d\dx no speculation", text), text
    assert first.k > 0 and first.too_little_evidence, first
    # A minute of requests: the measured bucket's choice is told from no speculation.
    _requests(core, 2, 60, batch=16, acceptance=0.35)
    later = core.snapshot(60.0).class_view("chat").decisions[measured]
    text = explanation_text(core.explain("chat", measured, 60.0))
    assert later.k > 0 and not later.too_little_evidence, later
    assert re.search(r"\d\.\d\dx no speculation", text), text


def test_how_sure_a_ranking_must_be_is_one_setting() -> None:
    """A coin flip ranks nothing: at rank_probability just above 0.5 the same evidence that
    said "too little evidence" ranks the arms; the decisions are the same."""
    lax = core_config(load_settings(rank_probability=0.501))
    sure, coin = _cpu_engine(), _cpu_engine(lax)
    for core in (sure, coin):
        _one_step_at_16(core)
    sure_decisions = sure.snapshot(1.0).class_view("chat").decisions
    coin_decisions = coin.snapshot(1.0).class_view("chat").decisions
    assert [d.arm for d in sure_decisions] == [d.arm for d in coin_decisions]
    assert any(d.too_little_evidence for d in sure_decisions)
    assert not any(d.too_little_evidence for d in coin_decisions)


def test_the_spread_of_expected_tokens_is_that_of_the_beta_posteriors() -> None:
    from specpilot.controller.core.ranking import tokens_covariance

    alpha, beta = np.array([3.0, 5.0, 2.0, 8.0]), np.array([2.0, 4.0, 6.0, 1.0])
    rates = np.random.default_rng(0).beta(alpha, beta, size=(200_000, 4))
    tokens = np.concatenate([np.ones((rates.shape[0], 1)),
                             1 + np.cumsum(np.cumprod(rates, axis=1), axis=1)], axis=1)
    assert tokens_covariance(alpha, beta, 4) == pytest.approx(np.cov(tokens.T), abs=2e-3)


# --- 3: neighbouring batch ranges ---------------------------------------------------------
def test_one_request_leaves_the_k_of_a_class_falling_as_the_batch_grows() -> None:
    exact = _cpu_engine()
    _requests(exact, 1, 1)
    for core in (exact, _one_request_on_the_noisy_engine()):
        ks = _speculative_ks(core.snapshot(1.0).class_view("chat").decisions)
        assert ks == sorted(ks, reverse=True), ks


def test_buckets_without_steps_of_their_own_keep_their_decisions() -> None:
    """Bounded by their neighbours when first decided, they stay put as evidence arrives
    elsewhere: a decision changes on evidence of its own only."""
    core = _cpu_engine()
    _requests(core, 1, 1)
    first = {d.bucket: d.arm for d in core.snapshot(1.0).class_view("chat").decisions}
    _requests(core, 2, 40)
    measured = set(core.snapshot(40.0).measured_buckets)
    later = {d.bucket: d.arm for d in core.snapshot(40.0).class_view("chat").decisions}
    assert {b: later[b] for b in first if b not in measured} == {
        b: first[b] for b in first if b not in measured}
    assert all(e.decision.bucket in measured for e in core.snapshot(40.0).events("chat")
               if e.at > 1.0)
