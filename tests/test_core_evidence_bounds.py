"""What one engine can add to a class's evidence: per report, what it can verify in the interval
it covers; per class, a share that cannot outweigh the other engines'. And names that engines
bring age out with them (``name_grace_seconds``)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from specpilot.contract.confidence import N_CONFIDENCE_BUCKETS
from specpilot.contract.records import (
    AcceptanceRecord,
    BeyondRate,
    ConfidenceRecord,
    DraftKind,
    DraftSpec,
    EngineHello,
    EngineReport,
    StepProfile,
    StepTimingRecord,
)
from specpilot.contract.validation import RATE_HEADROOM, interval_bound
from specpilot.controller.core.acceptance import (
    DEPARTED,
    AcceptanceEstimator,
    EstimatorConfig,
    robust_rates,
)
from specpilot.controller.core.controller import ControllerCore
from specpilot.controller.settings import core_config, load_settings

BATCH = 64
FASTEST = 0.01  # seconds: the profile's fastest step
HELLO = EngineHello(
    engine_id="honest-1", model="m", target_vocab_hash="v1",
    drafts=(DraftSpec("d", DraftKind.MODEL, 4, "v1"), DraftSpec("ngram", DraftKind.NGRAM, 4)),
    max_k=4, max_batch_size=BATCH,
    step_profile=(StepProfile(1, 1, "", 0, FASTEST), StepProfile(BATCH, BATCH, "", 0, 0.03)),
)


def _core(*engines: str, **settings: Any) -> ControllerCore:
    core = ControllerCore(core_config(load_settings(**settings)), np.random.default_rng(0))
    for engine_id in engines:
        core.connect_engine(replace(HELLO, engine_id=engine_id), now=0.0)
    return core


def _report(seq: int, steps_by_accepted: tuple[int, ...], cls: str = "chat", draft: str = "d",
            interval: float = 1.0) -> EngineReport:
    return EngineReport(sequence=seq, interval_seconds=interval, policy_version=0,
                        acceptance=(AcceptanceRecord(cls, draft, len(steps_by_accepted) - 1,
                                                     steps_by_accepted),))


def _first(core: ControllerCore, now: float, cls: str = "chat") -> float:
    return float(core.estimate(cls, "d", now).posterior.mean[0])


# A batch of 32 at 0.99 per position, 25 steps a second: what an honest engine counts.
HONEST = (0, 0, 0, 0, 800)
HONEST_RATE = 0.99


def _honest(rng: np.random.Generator) -> tuple[int, ...]:
    """800 request-steps at K=4 with each position accepted with probability 0.99."""
    accepted = np.minimum(rng.geometric(1 - HONEST_RATE, 800) - 1, 4)
    return tuple(int(c) for c in np.bincount(accepted, minlength=5))


def test_one_report_beyond_what_its_engine_can_verify_in_its_interval_is_rejected() -> None:
    core = _core("honest-1")
    rng = np.random.default_rng(1)
    for t in range(1, 31):
        core.ingest("honest-1", _report(t, _honest(rng)), float(t))
    before = _first(core, 30.5)
    with pytest.raises(BeyondRate, match=r"acceptance: 1000000000000 verification steps"):
        core.ingest("honest-1", _report(31, (10**12, 0, 0, 0, 0)), 31.0)
    assert _first(core, 30.5) == before > 0.95
    # The same bound on confidence counts and on timed steps.
    steps, request_steps = interval_bound(1.0, BATCH, FASTEST)
    assert (steps, request_steps) == (RATE_HEADROOM / FASTEST, RATE_HEADROOM / FASTEST * BATCH)
    tried = (int(request_steps) + 1,) + (0,) * (N_CONFIDENCE_BUCKETS - 1)
    conf = ConfidenceRecord("chat", "d", 1, tried, (0,) * N_CONFIDENCE_BUCKETS)
    with pytest.raises(BeyondRate, match=r"confidence: .* tried tokens"):
        core.ingest("honest-1", replace(_report(31, (1, 0, 0, 0, 0)), confidence=(conf,)), 31.0)
    many = int(steps) + 1
    timing = StepTimingRecord(0, "", 0, many, many, many, 0, many * FASTEST)
    with pytest.raises(BeyondRate, match=r"step_timings: .* steps"):
        core.ingest("honest-1", replace(_report(31, (1, 0, 0, 0, 0)), step_timings=(timing,)),
                    31.0)
    # At the bound it is taken (what a report may count grows with its interval).
    core.ingest("honest-1", _report(31, (int(request_steps) * 10, 0, 0, 0, 0), interval=10.0),
                31.0)


def test_a_profiled_prefill_step_bounds_nothing_a_decode_step_does() -> None:
    """On a slow CPU the profile's prefill step takes seconds where a decode step takes
    milliseconds: an engine whose profile timed only that step (its budget spent) has its
    honest reports taken, 36 verification steps at batch 1 in a second. The control: the same
    seconds on a decode step do bound the report, and it is rejected."""
    slow_prefill = StepProfile(16, 16, "", 0, 6.0, prefill_tokens=512)
    slow_decode = StepProfile(1, 1, "", 0, 6.0)
    honest = _report(1, (6, 10, 10, 10))
    assert sum(honest.acceptance[0].steps_by_accepted) == 36
    for profile, taken in (((slow_prefill,), True), ((slow_prefill, slow_decode), False)):
        core = ControllerCore(core_config(load_settings()), np.random.default_rng(0))
        core.connect_engine(replace(HELLO, engine_id="slow", max_batch_size=16,
                                    step_profile=profile), now=0.0)
        if taken:
            core.ingest("slow", honest, 1.0)
            assert core.estimate("chat", "d", 1.0).posterior.mean[0] > 0.5
        else:
            with pytest.raises(BeyondRate, match="fastest profiled decode step"):
                core.ingest("slow", honest, 1.0)


def _run(poison: bool, seconds: int = 600) -> float:
    """Two honest engines at 0.99 for ``seconds``, beside (``poison``) one reporting 0
    acceptance at its full plausible rate; position 1's mean at the end."""
    engines = ("honest-1", "honest-2") + (("poisoner",) if poison else ())
    core = _core(*engines)
    rng = np.random.default_rng(2)
    _, most = interval_bound(1.0, BATCH, FASTEST)
    for t in range(1, seconds + 1):
        for engine in ("honest-1", "honest-2"):
            core.ingest(engine, _report(t, _honest(rng)), float(t))
        if poison:
            core.ingest("poisoner", _report(t, (int(most), 0, 0, 0, 0)), float(t))
    return _first(core, float(seconds))


def test_an_engine_poisoning_at_its_full_plausible_rate_moves_a_shared_class_by_less_than_the_hysteresis_margin() -> None:  # noqa: E501
    margin = core_config(load_settings()).policy.hysteresis_ratio
    honest, poisoned = _run(poison=False), _run(poison=True)
    assert honest > 0.98
    assert abs(poisoned - honest) / honest < margin, (honest, poisoned)


def test_a_single_engine_alone_learns_as_before() -> None:
    """One source: its rates are the posterior's, whatever the share bound."""
    core = _core("honest-1")
    core.ingest("honest-1", _report(1, (30, 70, 0, 0, 0)), 1.0)
    post = core.estimate("chat", "d", 1.0).posterior
    # Beta(1, 1) prior plus 70 of 100 at position 1, 0 of 70 at position 2.
    assert post.mean[0] == pytest.approx(71 / 102)
    assert post.mean[1] == pytest.approx(1 / 72)


def test_robust_rates_let_no_source_outweigh_the_rest() -> None:
    def rates(*sources: tuple[float, float]) -> float:
        accepts = np.array([[a] for a, _ in sources], dtype=float)
        rejects = np.array([[r] for _, r in sources], dtype=float)
        return float(robust_rates(accepts, rejects, 30.0)[0])

    assert rates((70, 30)) == pytest.approx(0.7)  # alone: its own
    assert rates((990, 10), (990, 10), (0, 100_000)) == pytest.approx(0.99)  # outvoted
    assert rates((500, 500), (900, 100)) == pytest.approx(0.7)  # two: between them
    # A newcomer with a handful of tries does not outweigh a long-running engine.
    assert rates((9000, 1000), (0, 3)) == pytest.approx(0.9)
    assert np.isnan(robust_rates(np.zeros((2, 1)), np.zeros((2, 1)), 30.0)[0])


def test_names_short_lived_engines_bring_age_out_after_the_grace_period() -> None:
    grace = 60.0
    core = _core("honest-1", name_grace_seconds=grace, max_absent_drafts=1000)
    core.ingest("honest-1", _report(1, HONEST), 1.0)
    baseline = sum(len(c.estimates) for c in core.snapshot(1.0).classes)
    for i in range(40):
        names = tuple(DraftSpec(f"ngram-{i}-{j}", DraftKind.NGRAM, 4) for j in range(15))
        hello = replace(HELLO, engine_id=f"brief-{i}", drafts=names, step_profile=())
        now = 2.0 + i
        core.connect_engine(hello, now)
        core.ingest(hello.engine_id,
                    EngineReport(sequence=1, interval_seconds=1.0, policy_version=0,
                                 acceptance=tuple(AcceptanceRecord("chat", d.name, 1, (1, 1))
                                                  for d in names)), now)
        core.disconnect_engine(hello.engine_id)
        core.forget_departed(now)
    # 600 estimates held while within the grace period...
    assert sum(len(c.estimates) for c in core.snapshot(45.0).classes) == baseline + 600
    assert core.forget_departed(45.0 + grace) != ()
    # ... and the baseline once every name aged out; the honest engine's evidence stays.
    snap = core.snapshot(200.0)
    assert sum(len(c.estimates) for c in snap.classes) == baseline
    assert core.forget_departed(200.0) == ()
    assert _first(core, 200.0) > 0.9


def test_an_engine_that_reconnects_within_the_grace_period_keeps_its_evidence() -> None:
    core = _core("honest-1", name_grace_seconds=60.0)
    core.ingest("honest-1", _report(1, HONEST, draft="ngram"), 1.0)
    core.disconnect_engine("honest-1")
    assert core.forget_departed(2.0) == ()
    core.connect_engine(HELLO, 30.0)
    assert core.forget_departed(100.0) == ()
    assert core.estimate("chat", "ngram", 100.0).has_evidence


def test_absent_drafts_beyond_the_limit_go_at_once_longest_absent_first() -> None:
    core = _core("honest-1", max_absent_drafts=2)
    for i in range(4):
        name = f"ngram-{i}"
        hello = replace(HELLO, engine_id=f"brief-{i}", step_profile=(),
                        drafts=(DraftSpec(name, DraftKind.NGRAM, 4),))
        core.connect_engine(hello, float(i))
        core.ingest(hello.engine_id, _report(1, (1, 1), draft=name), float(i))
        core.disconnect_engine(hello.engine_id)
        core.forget_departed(float(i))
    held = {e.draft for c in core.snapshot(4.0).classes for e in c.estimates}
    assert held == {"d", "ngram", "ngram-2", "ngram-3"}


def test_the_fleet_store_does_not_bring_back_a_forgotten_draft() -> None:
    core = _core("honest-1", name_grace_seconds=10.0)
    hello = replace(HELLO, engine_id="brief", step_profile=(),
                    drafts=(DraftSpec("ngram-x", DraftKind.NGRAM, 4),))
    core.connect_engine(hello, 0.0)
    core.ingest("brief", _report(1, (1, 1), draft="ngram-x"), 0.0)
    core.disconnect_engine("brief")
    core.forget_departed(0.0)
    assert core.forget_departed(20.0) == ("ngram-x",)
    stored = {("chat", "ngram-x"): (np.array([50.0]), np.array([50.0]))}
    core.set_fleet_evidence(stored, 21.0)
    assert not core.estimate("chat", "ngram-x", 21.0).has_evidence
    core.connect_engine(hello, 22.0)  # announced again: the fleet's evidence counts
    core.set_fleet_evidence(stored, 22.0)
    assert core.estimate("chat", "ngram-x", 22.0).has_evidence


def test_a_departed_engine_joins_one_departed_voice_and_stays_outvoted() -> None:
    core = _core("honest-1", "honest-2", "poisoner", name_grace_seconds=10.0)
    rng = np.random.default_rng(3)
    _, most = interval_bound(1.0, BATCH, FASTEST)
    for t in range(1, 61):
        for engine in ("honest-1", "honest-2"):
            core.ingest(engine, _report(t, _honest(rng)), float(t))
        core.ingest("poisoner", _report(t, (int(most), 0, 0, 0, 0)), float(t))
    core.disconnect_engine("poisoner")
    core.forget_departed(60.0)
    assert core.estimate("chat", "d", 60.0).posterior.mean[0] > 0.98
    core.forget_departed(71.0)
    assert core.estimate("chat", "d", 71.0).posterior.mean[0] > 0.98


def test_departed_sources_merge_into_one() -> None:
    estimator = AcceptanceEstimator(EstimatorConfig(max_k=2))
    for source, h in (("a", (10, 90, 0)), ("b", (10, 90, 0)), ("c", (900, 0, 0)),
                      ("d", (900, 0, 0))):
        estimator.observe("chat", "d", h, 0.0, source=source)
    estimator.forget_sources({"c", "d"}, 0.0)
    assert estimator.sources("chat", "d") == (DEPARTED, "a", "b")
    assert estimator.all_sources() == {DEPARTED, "a", "b"}
    # Pooled evidence unchanged; the two that left count as one voice, outvoted by two.
    post = estimator.posterior("chat", "d", 0.0)
    assert post.effective_tries[0] == pytest.approx(2000)
    assert post.mean[0] == pytest.approx((1 + 0.9 * 2000) / 2002)
