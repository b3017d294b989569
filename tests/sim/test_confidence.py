"""Per-token confidence in the simulator: the model keeps the scenarios' rates, the old policies'
runs do not move, vllm-adaptive follows vLLM's rules, the per-token oracle is the ceiling."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from benchmarks.sim import policies
from benchmarks.sim.confidence import ConfidenceModel
from benchmarks.sim.engine import SimEngine
from benchmarks.sim.scenario import Scenario, load_scenario, parse_scenario
from benchmarks.sim.specpilot_policy import SpecPilotPolicy
from benchmarks.sim.step import EngineInfo, FloatArray, StepView, TokenSlots
from benchmarks.sim.token_oracle import PerTokenOracle
from benchmarks.sim.truth import AcceptanceTruth, StepCost
from benchmarks.sim.vllm_adaptive import (
    OnlineAcceptanceEstimator,
    VLLMAdaptive,
    admit,
    draft_budget,
)
from tests.sim.conftest import scenario_data

SUITE = Path(__file__).resolve().parents[2] / "benchmarks" / "scenarios"
# The policies that never read a token's confidence (specpilot does, where its drafter is a model:
# checked here with its reading off, as on a drafter that reports none).
OLD_POLICIES = ["off", "static:all", "batch-table", "hf-heuristic", "sglang-adaptive",
                "banditspec-ucb", "trtllm-threshold", "oracle"]
OLD_PHASE_SECONDS = 8.0


def _shortened(s: Scenario, seconds: float) -> Scenario:
    load = [p.model_copy(update={"duration_seconds": min(p.duration_seconds, seconds)})
            for p in s.load]
    return s.model_copy(update={"load": load})


def _position_means(s: Scenario, model: ConfidenceModel, n: int = 20_000
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per class and position: the scenario's mean rate over requests, and the means of the
    tokens' acceptance p and of the draft's confidence q as the model draws them."""
    truth, gen = AcceptanceTruth(s), np.random.default_rng(7)
    rates, p_mean, q_mean = [], [], []
    for ci, c in enumerate(s.classes):
        cls = np.full(n, ci, dtype=np.int64)
        r = truth.request_rates(0.0, cls, np.zeros(n, dtype=np.int64),
                                c.spread * gen.standard_normal(n))
        slots = model.draw(gen, 0, cls, r)
        rates.append(r.mean(0))
        p_mean.append(slots.acceptance.mean(0))
        q_mean.append(slots.confidence.mean(0))
    return np.array(rates), np.array(p_mean), np.array(q_mean)


@pytest.mark.parametrize("path", sorted(SUITE.glob("*.yaml")), ids=lambda p: p.stem)
def test_confidence_keeps_every_scenarios_mean_acceptance_by_position(path: Path) -> None:
    s = load_scenario(path)
    rates, p_mean, _ = _position_means(s, ConfidenceModel([c.confidence for c in s.classes]))
    # 20k tokens a cell: the standard error of a mean rate is under 0.0035.
    assert np.abs(p_mean - rates).max() < 0.012


def test_a_wrong_calibration_would_move_the_mean_acceptance() -> None:
    # Control: a draft 0.5 logit over-confident; had the engine accepted by its confidence q
    # rather than by the truth p, the per-position means would be off by far more than the
    # tolerance above.
    s = load_scenario(SUITE / "load-ramp.yaml")
    classes = [c.model_copy(update={"confidence": c.confidence.model_copy(update={"bias": 0.5})})
               for c in s.classes]
    s = s.model_copy(update={"classes": classes})
    rates, p_mean, q_mean = _position_means(s, ConfidenceModel([c.confidence for c in s.classes]))
    assert np.abs(p_mean - rates).max() < 0.012
    assert np.abs(q_mean - rates).min() > 0.03


def test_the_engine_accepts_by_the_tokens_own_acceptance() -> None:
    # One class at 0.7: a policy reading confidence gets the same acceptance as a blind one,
    # and an over-confident draft (bias) changes what it says, not what is accepted.
    def rate(bias: float, reads: bool) -> float:
        data = scenario_data(
            drafts=[{"name": "small", "kind": "model", "per_pass_ms": 3.0}],
            classes=[{"name": "c", "share": 1, "prompt_tokens": 20, "output_tokens": 4000,
                      "acceptance": {"small": 0.7}, "confidence": {"bias": bias}}],
            load=[{"duration_seconds": 60, "concurrency": 4}])
        engine = SimEngine(parse_scenario(data))
        policy = policies.build("static:3", engine)
        policy.reads_confidence = reads  # type: ignore[attr-defined]
        run = engine.run(policy)
        assert run.class_drafted["c"] > 20_000
        value = run.class_acceptance()["c"]
        assert value is not None
        return value

    blind = rate(0.0, False)
    assert abs(rate(0.0, True) - blind) < 0.015
    assert abs(rate(2.0, True) - blind) < 0.015


def test_policies_that_ignore_confidence_run_alike_whatever_the_confidence_model() -> None:
    """The tokens' confidences are drawn from a stream of their own and only for the policies
    that read them: every other policy runs to the token alike under any confidence model (so
    old scenarios keep their figures). The control: vLLM's adaptive verification, which reads
    them, runs differently once the draft is over-confident and noisy."""
    base = _shortened(load_scenario(SUITE / "load-ramp.yaml"), OLD_PHASE_SECONDS)
    odd = base.model_copy(update={"classes": [
        c.model_copy(update={"confidence": c.confidence.model_copy(
            update={"bias": 2.0, "noise": 2.0, "concentration": 0.5})})
        for c in base.classes]})

    def runs(s: Scenario, names: list[str]) -> dict[str, tuple[int, int]]:
        engine = SimEngine(s)
        out = {}
        for policy in policies.expand(names, engine):
            built = policies.build(policy, engine)
            if isinstance(built, SpecPilotPolicy):
                built.reads_confidence = False
            run = engine.run(built)
            out[policy] = (run.tokens, run.steps)
        return out

    assert runs(base, [*OLD_POLICIES, "specpilot"]) == runs(odd, [*OLD_POLICIES, "specpilot"])
    # The controls: the policies that read the confidences run differently.
    assert runs(base, ["vllm-adaptive"]) != runs(odd, ["vllm-adaptive"])
    engine = SimEngine(odd)
    reading = engine.run(policies.build("specpilot", engine))
    assert (reading.tokens, reading.steps) != runs(odd, ["specpilot"])["specpilot"]


def f64(x: Any) -> FloatArray:
    return np.asarray(x, dtype=np.float64)


INFO = EngineInfo(classes=("a",), drafts=("small",), draft_is_model=(True,), max_k=3,
                  max_batch=8, offline=(False,))


def test_the_budget_is_the_best_ratio_of_expected_tokens_to_profiled_cost() -> None:
    stale = np.array([[0.9, 0.5], [0.6, 0.9]])
    # Survivals 0.9, 0.45 and 0.6, 0.54, sorted 0.9, 0.6, 0.54, 0.45; two sampling requests;
    # cost 1 + 0.5 per draft token + 0.5 per other token: ratios 2/2, 2.9/2.5, 3.5/3 (best),
    # 4.04/3.5, 4.49/4.
    verify = f64(1.0 + 0.5 * np.arange(5))
    assert draft_budget(stale, 2, 1.0, verify) == 2
    # A dearer token: the first slot alone (2.9/2.7 against 2/2 and 3.5/3.4), then none.
    assert draft_budget(stale, 2, 0.0, f64(2.0 + 0.7 * np.arange(5))) == 1
    assert draft_budget(stale, 2, 0.0, f64(2.0 + np.arange(5))) == 0


def test_slots_are_admitted_in_survival_order() -> None:
    pred = np.array([[0.5, 0.9, 0.9], [0.8, 0.7, 0.9], [0.95, 0.1, 0.9]])
    # Survivals: 0.5 0.45 0.405 | 0.8 0.56 0.504 | 0.95 0.095 0.0855.
    assert admit(pred, 3).tolist() == [0, 2, 1]
    assert admit(pred, 5).tolist() == [1, 3, 1]
    assert admit(pred, 0).tolist() == [0, 0, 0]


def _view(q: np.ndarray, ids: tuple[int, ...], prefill: int = 0) -> StepView:
    n = len(ids)
    slots = TokenSlots(0, q, q)
    return StepView(0.0, n, prefill, np.array(ids, dtype=np.int64), np.zeros(n, dtype=np.int64),
                    slots)


def _cost(per_token_ms: float) -> StepCost:
    s = parse_scenario(scenario_data(cost={
        "base_ms": 10, "per_token_ms": per_token_ms, "ridge_tokens": 10_000,
        "per_token_above_ridge_ms": 0, "noise": 0}))
    return StepCost.from_scenario(s)


def test_vllm_adaptive_drafts_k_and_verifies_its_budget_by_survival() -> None:
    policy = VLLMAdaptive(INFO, _cost(2.0), 3, 64)
    q = np.array([[0.99, 0.99, 0.99], [0.6, 0.3, 0.2]])
    a = policy.assign(_view(q, (1, 2)))
    # First step: nothing stale (every slot reads 1), so the budget is all or nothing:
    # 2 + 6 tokens for 10 + 2 x 8 ms against 2 for 10 + 2 x 2 ms.
    assert a.drafted is not None and a.drafted.tolist() == [3, 3]
    assert a.k.tolist() == [3, 3]
    # Second step: the budget reads the first step's predictions; the admission this step's.
    _, pred1 = policy.estimator.predict(q)
    _, pred2 = policy.estimator.predict(q[::-1].copy())
    verify = f64(10e-3 + 2e-3 * (2 + np.arange(7)))
    budget = draft_budget(pred1, 2, 0.0, verify)
    assert 0 < budget < 6
    b = policy.assign(_view(q[::-1].copy(), (1, 2)))
    assert b.k.tolist() == admit(pred2, budget).tolist()
    assert b.k.sum() == budget


def test_the_online_calibration_learns_a_logistic_truth() -> None:
    est, gen = OnlineAcceptanceEstimator(2), np.random.default_rng(3)
    for _ in range(30 * est.REFIT_INTERVAL):
        q = gen.uniform(0.02, 0.98, (16, 2))
        feature, pred = est.predict(q)
        truth = 1 / (1 + np.exp(-(1.5 * feature + np.array([0.5, -0.5]))))
        ok = gen.random(q.shape) < truth
        accepted = np.cumprod(ok, axis=1).sum(axis=1)
        est.grade(feature, pred, np.full(16, 2), accepted)
    assert abs(est.slope - 1.5) < 0.15
    assert np.abs(est.intercepts - [0.5, -0.5]).max() < 0.2


def test_the_per_token_oracle_plan_is_the_exact_optimum() -> None:
    cost = _cost(0.5)
    oracle = PerTokenOracle(INFO, cost)
    gen = np.random.default_rng(5)
    for _ in range(20):
        p = gen.uniform(0.05, 0.99, (3, 3))
        surv = f64(np.cumprod(p, axis=1))
        passes, budget = oracle.plan(surv, 3, 0)
        best = 0.0
        for ks in itertools.product(range(4), repeat=3):
            tokens = 3 + sum(surv[i, :k].sum() for i, k in enumerate(ks))
            seconds = cost.seconds(3, 3 + sum(ks), [max(ks), 0], [sum(ks), 0])
            best = max(best, tokens / seconds)
        k = oracle.assign(_view(p, (0, 1, 2))).k
        tokens = 3 + sum(surv[i, :int(x)].sum() for i, x in enumerate(k))
        got = tokens / cost.seconds(3, 3 + int(k.sum()), [k.max(), 0], [k.sum(), 0])
        assert got == pytest.approx(best, rel=1e-12)
        assert int(k.sum()) == budget and int(k.max()) <= passes


def _small_mix() -> dict[str, Any]:
    return scenario_data(
        drafts=[{"name": "small", "kind": "model", "per_pass_ms": 3.0, "per_token_ms": 0.02}],
        classes=[
            {"name": "easy", "share": 0.5, "prompt_tokens": [50, 200],
             "output_tokens": [50, 200], "acceptance": {"small": [0.9, 0.8, 0.7]}},
            {"name": "hard", "share": 0.5, "prompt_tokens": [50, 200],
             "output_tokens": [50, 200], "acceptance": {"small": 0.4},
             "confidence": {"bias": 1.0}},
        ],
        load=[{"duration_seconds": 15, "concurrency": 1},
              {"duration_seconds": 15, "concurrency": 12}])


def test_the_per_token_oracle_is_the_ceiling() -> None:
    s = parse_scenario(_small_mix())
    names = ["off", "static:all", "batch-table", "sglang-adaptive", "specpilot", "oracle",
             "vllm-adaptive", "vllm-adaptive:3"]
    for seed in (3, 4):
        engine = SimEngine(s, seed)
        ceiling = engine.run(policies.build("per-token-oracle", engine)).throughput
        for name in policies.expand(names, engine):
            run = engine.run(policies.build(name, engine))
            assert run.throughput <= ceiling, (seed, name, run.throughput, ceiling)


def _counted(policy: SpecPilotPolicy, names: tuple[str, ...]) -> dict[str, list[int]]:
    """Per class: the drafts the drafter proposed and those verified, as ``policy`` assigns."""
    counts = {c: [0, 0] for c in names}
    assign = policy.assign

    def counting(view: StepView) -> Any:
        a = assign(view)
        drafted = a.k if a.drafted is None else a.drafted
        for c, name in enumerate(names):
            mine = view.classes == c
            counts[name][0] += int(drafted[mine].sum())
            counts[name][1] += int(a.k[mine].sum())
        return a

    policy.assign = counting  # type: ignore[method-assign]
    return counts


def _reports(policy: SpecPilotPolicy) -> list[Any]:
    """The reports ``policy`` hands its controller core, as they come."""
    reports: list[Any] = []
    ingest = policy.core.ingest

    def kept(engine_id: str, report: Any, now: float) -> Any:
        reports.append(report)
        return ingest(engine_id, report, now)

    policy.core.ingest = kept  # type: ignore[method-assign]
    return reports


def _cut_mix() -> Scenario:
    """The token cut on (it is off by default). Verifying costs (0.2 ms a token on a 10 ms
    step): "sure" is 0.95 at every position, every token alike; "mixed" is 0.7 of tokens that
    are either sure or hopeless, its draft's confidence telling them apart."""
    return parse_scenario(scenario_data(
        engine={"max_k": 4, "max_batch": 16},
        cost={"base_ms": 10, "per_sequence_ms": 0.1, "per_token_ms": 0.2, "ridge_tokens": 10_000,
              "per_token_above_ridge_ms": 0.2, "noise": 0.0},
        drafts=[{"name": "small", "kind": "model", "per_pass_ms": 1.0, "per_token_ms": 0.01}],
        classes=[
            {"name": "sure", "share": 0.5, "prompt_tokens": 50, "output_tokens": [200, 400],
             "spread": 0.0, "acceptance": {"small": 0.95},
             "confidence": {"concentration": 1000, "noise": 0.1}},
            {"name": "mixed", "share": 0.5, "prompt_tokens": 50, "output_tokens": [200, 400],
             "spread": 0.0, "acceptance": {"small": 0.7},
             "confidence": {"concentration": 0.3, "noise": 0.1}},
        ],
        load=[{"duration_seconds": 40, "concurrency": 8}],
        specpilot={"token_cut": True}))


def test_specpilot_counts_the_confidences_it_verified_and_cuts_a_low_calibration() -> None:
    s = _cut_mix()
    engine = SimEngine(s)
    policy = policies.build("specpilot", engine)
    assert isinstance(policy, SpecPilotPolicy) and policy.reads_confidence
    reports = _reports(policy)
    counts = _counted(policy, engine.info.classes)
    engine.run(policy)
    counted = {(r.traffic_class, r.draft, r.transformed) for rep in reports
               for r in rep.confidence}
    assert counted == {("sure", "small", False), ("mixed", "small", False)}
    # Position 1 of every verification is counted, and no later position more often.
    first = sum(sum(r.tried_by_bucket) for rep in reports for r in rep.confidence
                if r.position == 1)
    assert first > 1000
    # The cut: the mixed class, whose hopeless tokens its draft's confidence tells apart,
    # verifies a far smaller share of the drafts it drafted than the sure one.
    sure, mixed = counts["sure"], counts["mixed"]
    assert sure[0] > 1000 and mixed[0] > 1000, counts
    assert mixed[1] / mixed[0] < sure[1] / sure[0] - 0.2, counts
    # Every request is scored as the K it drafted, its cut tail rejected (the plugin's
    # on_output): the class's acceptance is not learnt from the tokens the cut kept alone.
    scored = {c: 0 for c in counts}
    for rep in reports:
        for a in rep.acceptance:
            scored[a.traffic_class] += a.k * sum(a.steps_by_accepted)
    # (Drafted, not verified: the mixed class's differ by far more than the steps after the
    # last report, which no report counts.)
    for c, (drafted, _) in counts.items():
        assert drafted * 0.95 <= scored[c] <= drafted, (scored, counts)


def test_specpilot_spellings_force_the_cut_on_or_off_and_name_their_runs() -> None:
    engine = SimEngine(_cut_mix())  # the scenario turns the cut on
    for name, cut in (("specpilot", True), ("specpilot-cut", True), ("specpilot-nocut", False)):
        policy = policies.build(name, engine)
        assert isinstance(policy, SpecPilotPolicy)
        assert (policy.name, policy.settings.token_cut) == (name, cut)
        assert (policy.core.snapshot(0.0).cut is not None) == cut


def test_specpilot_without_confidences_counts_none_and_cuts_nothing() -> None:
    engine = SimEngine(_cut_mix())
    policy = policies.build("specpilot", engine)
    assert isinstance(policy, SpecPilotPolicy)
    policy.reads_confidence = False
    reports = _reports(policy)
    counts = _counted(policy, engine.info.classes)
    engine.run(policy)
    assert reports and not any(rep.confidence for rep in reports)
    assert all(drafted == verified and drafted > 1000 for drafted, verified in counts.values())


def test_a_transformed_class_is_counted_apart() -> None:
    data = scenario_data(classes=[
        {"name": "easy", "share": 0.5, "prompt_tokens": [50, 200], "output_tokens": [50, 200],
         "acceptance": {"small": 0.9, "ngram": 0.2}},
        {"name": "hard", "share": 0.5, "prompt_tokens": [50, 200], "output_tokens": [50, 200],
         "acceptance": {"small": 0.6, "ngram": 0.05},
         "confidence": {"bias": 1.5, "transformed": True}}],
        load=[{"duration_seconds": 10, "concurrency": 4}])
    engine = SimEngine(parse_scenario(data))
    policy = policies.build("specpilot", engine)
    assert isinstance(policy, SpecPilotPolicy)
    reports = _reports(policy)
    engine.run(policy)
    assert {(r.traffic_class, r.transformed) for rep in reports for r in rep.confidence} == {
        ("easy", False), ("hard", True)}


def test_the_cost_model_prices_a_verified_token_above_nothing_on_a_real_run() -> None:
    # Every step of a run verifies all it drafted (the cut only starts once its prices do),
    # so nothing in the data splits a token's price between the target and the drafter: the
    # prior must. Left to the ridge, this run's fit priced a verified token at -7e-4 s and a
    # drafted one at +7e-4 s by the second phase (the truth: 2e-5 and 1e-5), every slot below
    # nothing, and the cut never cut.
    s = load_scenario(SUITE / "confidence-ramp.yaml")
    s = s.model_copy(update={"load": s.load[:2]})
    engine = SimEngine(s, s.seed)
    policy = policies.build("specpilot-cut", engine)
    assert isinstance(policy, SpecPilotPolicy)
    engine.run(policy)
    snap = policy.core.snapshot(80.0)
    assert snap.composition is not None and snap.cut is not None
    fit = snap.composition.pricing  # the cost model's weights, as engines receive them
    assert 1e-6 < fit.seconds_per_token < 1e-4
    assert 1e-6 < fit.drafts["llama-1b"].seconds_per_token < 1e-4
    # With its prices right the cut does cut at a batch of 8 (none at a batch of one).
    assert max(snap.cut.min_survival) > 0.0
