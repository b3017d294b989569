"""Context length in the simulator: each request's context grows as it generates, a step pays for
the context its tokens read, the plugin's stats carry it, and specpilot's cost model learns the
slope and verifies fewer drafts over long contexts."""

from __future__ import annotations

from typing import Any

import numpy as np

from benchmarks.sim import policies
from benchmarks.sim.baselines import Static
from benchmarks.sim.engine import SimEngine
from benchmarks.sim.scenario import Scenario, parse_scenario
from benchmarks.sim.specpilot_policy import SpecPilotPolicy
from benchmarks.sim.step import Assignment, StepOutcome, StepView
from tests.sim.conftest import scenario_data

SLOPE_MS = 8e-5  # per context token a verified token reads, ms


def _scenario(per_context_token_ms: float, classes: list[dict[str, Any]], seconds: float = 60,
              concurrency: int = 16, noise: float = 0.02,
              engine: dict[str, Any] | None = None) -> Scenario:
    data = scenario_data(
        classes=classes, load=[{"duration_seconds": seconds, "concurrency": concurrency}],
        engine={"max_k": 6, "max_batch": 32, **(engine or {})},
        drafts=[{"name": "small", "kind": "model", "per_pass_ms": 2.0, "per_token_ms": 0.005}])
    data["cost"] = {**data["cost"], "per_token_ms": 0.01, "ridge_tokens": 256,
                    "per_token_above_ridge_ms": 0.05, "noise": noise,
                    "per_context_token_ms": per_context_token_ms}
    return parse_scenario(data)


def _class(name: str, prompt: list[int]) -> dict[str, Any]:
    return {"name": name, "share": 1, "prompt_tokens": prompt, "output_tokens": [300, 600],
            "spread": 0.3, "acceptance": {"small": 0.8}}


SHORT, LONG = _class("chat", [100, 300]), _class("docs", [4000, 6000])


class _Recording(Static):
    """static:K, keeping every outcome."""

    def __init__(self, engine: SimEngine, k: int) -> None:
        super().__init__(engine.info, k)
        self.outcomes: list[StepOutcome] = []

    def observe(self, outcome: StepOutcome) -> None:
        self.outcomes.append(outcome)


def test_context_grows_with_the_output_and_the_step_pays_for_what_its_tokens_read() -> None:
    engine = SimEngine(_scenario(SLOPE_MS, [SHORT], seconds=3, concurrency=4, noise=0.0))
    policy = _Recording(engine, 3)
    engine.run(policy)
    seen: dict[int, int] = {}
    grew = 0
    for o in policy.outcomes:
        v = o.view
        assert v.contexts is not None
        for rid, context, emitted in zip(v.request_ids.tolist(), v.contexts.tolist(),
                                         o.emitted.tolist(), strict=True):
            if rid in seen:  # the tokens it emitted last step are in its KV now
                assert context == seen[rid]
                grew += 1
            assert context >= 100
            seen[rid] = context + emitted
        if not v.prefill_tokens:
            assert v.context_tokens == int(v.contexts.sum())
            reads = float(np.dot(1 + o.assignment.k, v.contexts))
            plain = engine.cost.seconds(v.batch_size, o.verified_tokens, o.draft_passes,
                                        o.draft_tokens)
            assert o.seconds == engine.cost.seconds(v.batch_size, o.verified_tokens,
                                                    o.draft_passes, o.draft_tokens, reads)
            assert abs(o.seconds - plain - SLOPE_MS / 1e3 * reads) < 1e-12
    assert grew > 100


def _run(s: Scenario, name: str = "specpilot") -> tuple[SimEngine, SpecPilotPolicy, Any]:
    engine = SimEngine(s)
    policy = policies.build(name, engine)
    assert isinstance(policy, SpecPilotPolicy)
    return engine, policy, engine.run(policy)


def test_specpilot_reports_the_steps_context_through_the_plugins_stats() -> None:
    """Nothing drained during the run (a report interval past its end): the plugin's
    aggregator holds every decode step, its context summed as the engine reported it."""
    s = _scenario(SLOPE_MS, [SHORT, LONG], seconds=3, concurrency=8,
                  engine={"report_interval_seconds": 100.0})
    engine = SimEngine(s)
    policy = policies.build("specpilot", engine)
    assert isinstance(policy, SpecPilotPolicy)
    contexts: list[int] = []
    observe = policy.observe

    def keep(o: StepOutcome) -> None:
        if not o.view.prefill_tokens:
            contexts.append(o.view.context_tokens)
        observe(o)

    policy.observe = keep  # type: ignore[method-assign]
    engine.run(policy)
    report = policy.stats.drain(8).report(1, policy.view.version, 0, policy.view.bucket_bounds)
    assert len(contexts) > 50 and min(contexts) > 0
    assert sum(t.sum_context_tokens for t in report.step_timings) == sum(contexts)
    assert sum(t.steps for t in report.step_timings) == len(contexts)
    # An engine that reports none: the same steps, their context unknown.
    engine = SimEngine(s)
    blind = policies.build(policies.SPECPILOT_NO_CONTEXT, engine)
    assert isinstance(blind, SpecPilotPolicy)
    engine.run(blind)
    report = blind.stats.drain(8).report(1, blind.view.version, 0, blind.view.bucket_bounds)
    assert report.step_timings and all(t.sum_context_tokens == 0 for t in report.step_timings)


def _learnt_slope_ms(policy: SpecPilotPolicy) -> float:
    return policy.core._evidence.cost.mean.pricing().seconds_per_context_token * 1e3


def test_the_cost_model_learns_the_context_slope_from_simulated_steps() -> None:
    """Short and long requests share the batch, so its mean context moves from report to
    report: the column is identified. Control: with context free the slope stays near 0."""
    _, policy, _ = _run(_scenario(SLOPE_MS, [SHORT, LONG]))
    assert 0.4 * SLOPE_MS < _learnt_slope_ms(policy) < 1.5 * SLOPE_MS
    _, free, _ = _run(_scenario(0.0, [SHORT, LONG]))
    assert abs(_learnt_slope_ms(free)) < 0.05 * SLOPE_MS


def _late_k(run: Any, cls: str) -> float:
    ks = [k for k in run.k_timeline[cls] if k is not None]
    return float(np.mean(ks[len(ks) // 2:]))


def test_specpilot_verifies_fewer_drafts_over_long_contexts() -> None:
    """The same acceptance and batch, only the context differs: the long-context class gets a
    shorter K. Control: with context free both get the same K. (Served apart, as here, the
    per-token weight alone could carry the difference; the column is what carries it when the
    context moves under a fitted model: docs/benchmarks.md, long-context.)"""
    for slope, apart in ((SLOPE_MS, True), (0.0, False)):
        short = _late_k(_run(_scenario(slope, [SHORT], seconds=40))[2], "chat")
        long = _late_k(_run(_scenario(slope, [LONG], seconds=40))[2], "docs")
        if apart:
            assert long < short - 0.5, (short, long)
        else:
            assert abs(long - short) < 0.3, (short, long)


def test_a_view_without_contexts_still_assigns() -> None:
    """Views built without contexts (the other policies' tests do) price no context."""
    s = _scenario(SLOPE_MS, [SHORT])
    engine = SimEngine(s)
    policy = policies.build("specpilot", engine)
    a = policy.assign(StepView(0.0, 2, 0, np.arange(2, dtype=np.int64),
                               np.zeros(2, dtype=np.int64)))
    assert isinstance(a, Assignment) and a.k.size == 2
