"""The simulated engine, the oracle and specpilot's adapter, on small scenarios."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from benchmarks.sim import policies
from benchmarks.sim.engine import SimEngine
from benchmarks.sim.oracle import Oracle
from benchmarks.sim.scenario import Scenario, parse_scenario
from benchmarks.sim.specpilot_policy import SpecPilotPolicy
from specpilot.engine_plugin import profile
from specpilot.engine_plugin.profile import PROFILE_BATCH_SIZES
from tests.sim.conftest import scenario_data


def test_runs_are_deterministic_and_conserve_tokens(tiny: Scenario) -> None:
    engine = SimEngine(tiny)
    a = engine.run(policies.build("specpilot", engine))
    b = engine.run(policies.build("specpilot", engine))
    assert a.tokens == b.tokens and a.steps == b.steps and a.k_timeline == b.k_timeline
    assert a.tokens == sum(a.class_tokens.values()) == sum(a.phase_tokens)
    assert a.finished > 0
    # Another seed: a different run.
    c = SimEngine(tiny, seed=99).run(policies.build("specpilot", SimEngine(tiny, seed=99)))
    assert c.tokens != a.tokens


def test_speculation_raises_tokens_per_step_as_acceptance_says() -> None:
    # One class at acceptance 0.9, K=4: E(K) ~ 4.1 tokens per step (lower with per-request spread).
    s = parse_scenario(scenario_data(classes=[
        {"name": "easy", "share": 1, "prompt_tokens": 50, "output_tokens": 5000, "spread": 0,
         "acceptance": {"small": 0.9, "ngram": 0.2}}]))
    engine = SimEngine(s)
    run = engine.run(policies.build("static:4", engine))
    expected = (1 - 0.9**5) / (1 - 0.9)
    per_step = run.tokens / run.steps / 2  # two requests decode in every step
    assert abs(per_step - expected) < 0.1
    rate = run.class_acceptance()["easy"]
    assert rate is not None and abs(rate - (expected - 1) / 4) < 0.02


def brute_force(oracle: Oracle, counts: np.ndarray, batch: int, now: float = 0.0,
                context: np.ndarray | None = None) -> float:
    """Best expected tokens/s over every combination of arms, straight from the definitions
    (``context``: per class, its requests' context summed)."""
    curves = oracle.truth.expected_curves(now, running=True)
    cost = oracle.cost
    best = 0.0
    live = [c for c in range(counts.size) if counts[c]]
    for arms in itertools.product(range(oracle.arm_k.size), repeat=len(live)):
        tokens, verified, reads = 0.0, 0, 0.0
        passes = np.zeros(len(oracle.info.drafts))
        dtok = np.zeros(len(oracle.info.drafts))
        for c, a in zip(live, arms, strict=True):
            k, d = int(oracle.arm_k[a]), int(oracle.arm_draft[a])
            tokens += counts[c] * (curves[c, d, k] if k else 1.0)
            verified += counts[c] * (1 + k)
            reads += (1 + k) * (0.0 if context is None else context[c])
            if k:
                passes[d] = max(passes[d], k)
                dtok[d] += counts[c] * k
        best = max(best, tokens / cost.seconds(batch, verified, passes, dtok, reads))
    return best


@pytest.mark.parametrize("per_context_token_ms", [0.0, 2e-4])
def test_oracle_finds_the_joint_optimum(per_context_token_ms: float) -> None:
    data = scenario_data()
    data["cost"] = {**data["cost"], "per_context_token_ms": per_context_token_ms}
    engine = SimEngine(parse_scenario(data))
    oracle = policies.build("oracle", engine)
    assert isinstance(oracle, Oracle)
    for counts, mean_context in (([1, 0], [0, 0]), ([2, 1], [128, 4096]),
                                 ([5, 9], [8192, 256]), ([16, 0], [2048, 0])):
        c = np.array(counts, dtype=np.int64)
        context = np.asarray(c * np.array(mean_context), dtype=np.float64)
        arms = oracle.best_arms(0.0, c, int(c.sum()), 0, context)
        curves = engine.truth.expected_curves(0.0, running=True)
        values = np.array([oracle._class_arm_values(curves, i) for i in range(2)])
        got = oracle._responses(c, context, arms, values, 0, int(c.sum()), 0, 0.0)[arms[0]]
        assert abs(got - brute_force(oracle, c, int(c.sum()), context=context)) < 1e-9 * got


def test_the_oracle_is_not_beaten_beyond_noise(tiny: Scenario) -> None:
    engine = SimEngine(tiny)
    names = ["off", "static:1", "static:3", "static:5", "sglang-adaptive", "specpilot", "oracle"]
    runs = {n: engine.run(policies.build(n, engine)) for n in names}
    ceiling = runs["oracle"].throughput
    for name, run in runs.items():
        assert run.throughput <= 1.02 * ceiling, (name, run.throughput, ceiling)


def test_specpilot_runs_the_real_core_through_reports(tiny: Scenario) -> None:
    engine = SimEngine(tiny)
    policy = policies.build("specpilot", engine)
    assert isinstance(policy, SpecPilotPolicy)
    engine.run(policy)
    core = policy.core
    snap = core.snapshot(float(tiny.duration_seconds))
    # About one report per simulated second, every one accepted in order.
    assert abs(policy.reports - tiny.duration_seconds) <= 2
    assert [(e.engine_id, e.last_sequence) for e in snap.engines] == [
        ("sim-engine-0", policy.reports)]
    # What it learned from the reports alone: the easy class speculates, the hard one does not.
    easy, hard = core.decision("easy", 1), core.decision("hard", 1)
    assert easy is not None and hard is not None
    assert easy.k >= 3 and easy.draft == "small"
    # The hard class never runs the model draft (n-gram drafts cost nothing, so one may still pay
    # a little). Which n-gram K is a near-tie (K=1..6 within ~1.5% by means, inside the
    # hysteresis margin), so the K it lands on depends on the seed, not on what it learned.
    assert hard.k == 0 or hard.draft == "ngram"
    ngram = [a.speedup for a in core.explain("hard", 1, float(tiny.duration_seconds)).arms
             if a.draft == "ngram"]
    margin = 1 + core.config.policy.hysteresis_ratio
    assert hard.k == 0 or ngram[hard.k - 1] >= max(ngram) / margin
    # Its class mix estimate comes from the finished-request summaries.
    assert {c.name for c in snap.classes if c.share is not None} == {"easy", "hard"}


def test_offline_classes_reach_the_controller_pinned_off() -> None:
    data = scenario_data()
    data["classes"][0]["offline"] = True
    engine = SimEngine(parse_scenario(data))
    policy = policies.build("specpilot", engine)
    run = engine.run(policy)
    assert run.class_drafted["easy"] == 0
    assert "easy" in policy.core.config.offline_classes  # type: ignore[attr-defined]


def test_a_biased_start_up_profile_reaches_the_cost_model_before_any_step() -> None:
    """``engine.profile_scale`` scales what the simulated plugin's profile sends, plain steps
    and speculative ones apart: the controller then prices unseen shapes from the bias, as it
    would on a real engine whose profile times the forward passes only."""
    def priced(scale: list[float]) -> tuple[float, float]:
        data = scenario_data(engine={"max_k": 6, "max_batch": 16, "profile_scale": scale})
        policy = policies.build("specpilot", SimEngine(parse_scenario(data)))
        assert isinstance(policy, SpecPilotPolicy)
        return (policy.core.predicted_step_seconds(8, "", 0),
                policy.core.predicted_step_seconds(8, "small", 4))

    # Speculative points scaled by 0.8, not lower: much below, some would price a step that
    # verifies drafts below a plain one, which the cost model refuses (its weights physical).
    exact, plain_fast, spec_fast = priced([1.0, 1.0]), priced([0.5, 1.0]), priced([1.0, 0.8])
    print(f"batch 8, off and K=4: exact {exact}, plain x0.5 {plain_fast}, "
          f"speculative x0.8 {spec_fast}")
    assert plain_fast[0] < 0.7 * exact[0]
    assert spec_fast[1] < 0.85 * exact[1]
    assert abs(spec_fast[0] / exact[0] - 1) < 0.1  # the plain points are not scaled


def test_an_engine_of_large_batches_prices_its_large_verification_steps_from_its_profile(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine of 256 sequences times the large steps it serves at start-up: the controller
    prices K=2 at batch 256 (768 verified tokens, far above the ridge) from that, not from the
    prior's slope above the ridge, which overprices it (and a price too high is never tried, so
    never corrected)."""
    data = scenario_data(engine={"max_k": 4, "max_batch": 256, "max_batched_tokens": 8192})

    def error() -> float:
        engine = SimEngine(parse_scenario(data))
        policy = policies.build("specpilot", engine)
        assert isinstance(policy, SpecPilotPolicy)
        truth = engine.cost.seconds(256, 256 * 3, [2, 0], [512, 0])
        return abs(policy.core.predicted_step_seconds(256, "small", 2) / truth - 1)

    profiled = error()
    # Control: the batch sizes of an engine of 32 sequences only.
    monkeypatch.setattr(profile, "profile_batch_sizes",
                        lambda max_seqs: [b for b in PROFILE_BATCH_SIZES if b <= max_seqs])
    unprofiled = error()
    print(f"K=2 at batch 256, relative error: profiled {profiled:.3f}, "
          f"up to 32 {unprofiled:.3f}")
    assert profiled < 0.05
    assert unprofiled > 0.15
