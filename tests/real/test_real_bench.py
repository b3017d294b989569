"""The real benchmark's pure parts: the traffic plan, the per-request figures from vLLM's
result, the exactness count, and the ratios and ceiling against the static configurations."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from benchmarks.demo.configs import EngineConfig, specpilot_config, without_token_cut
from benchmarks.real.bench import (
    ConfigFigures,
    Run,
    figures,
    real_configs,
    real_optional_configs,
    request_rows,
    select_configs,
    versus,
)
from benchmarks.real.plan import LoadPhase, build_plan, class_counts
from benchmarks.real.sharegpt import CLASSES, TrafficRequest
from specpilot.controller.settings import core_config, load_settings

PHASES = (LoadPhase("light", 1, 4), LoadPhase("peak", 8, 12))


def _request(cls: str, i: int) -> TrafficRequest:
    temperature = next(c.temperature for c in CLASSES if c.name == cls)
    return TrafficRequest(f"{cls}-{i}", cls, [{"role": "user", "content": f"q{i}"}], 10,
                          "a", 128, temperature)


HELDOUT = {c.name: [_request(c.name, i) for i in range(20)] for c in CLASSES}


def test_class_counts_follow_the_shares_and_add_up() -> None:
    counts = class_counts(CLASSES, 20)
    assert sum(counts.values()) == 20
    assert counts == {"chat": 8, "code": 5, "long": 4, "offline": 3}


def test_the_plan_is_deterministic_distinct_and_mixed() -> None:
    plan = build_plan(HELDOUT, PHASES, seed=3)
    assert plan == build_plan(HELDOUT, PHASES, seed=3)
    assert plan != build_plan(HELDOUT, PHASES, seed=4)
    assert [len(p) for p in plan] == [4, 12]
    ids = [r.id for p in plan for r in p]
    assert len(ids) == len(set(ids))  # no request twice
    assert {r.class_name for r in plan[1]} == {c.name for c in CLASSES}


def test_the_plan_refuses_more_requests_than_a_class_holds() -> None:
    with pytest.raises(ValueError, match="held-out requests"):
        build_plan(HELDOUT, (LoadPhase("huge", 1, 100),))


def _run(name: str, plan: list[list[TrafficRequest]], rate: float, texts: dict[str, str],
         tpot: float = 0.01) -> Run:
    phases = []
    for requests in plan:
        n = len(requests)
        tokens = [50] * n
        duration = sum(tokens) / rate
        phases.append({"duration": duration, "total_output_tokens": sum(tokens),
                       "output_throughput": rate, "output_lens": tokens, "ttfts": [0.1] * n,
                       "latencies": [0.1 + 49 * tpot] * n,
                       "generated_texts": [texts.get(r.id, "same") for r in requests],
                       "spec_decode_draft_tokens": 100, "spec_decode_accepted_tokens": 40})
    return Run(name, 0, phases)


def test_figures_count_greedy_mismatches_only_and_read_tpot() -> None:
    plan = build_plan(HELDOUT, PHASES)
    reference = _run("off", plan, 100.0, {})
    greedy = frozenset(c.name for c in CLASSES if c.temperature == 0)
    a_chat = next(r for p in plan for r in p if r.class_name == "chat")
    a_code = next(r for p in plan for r in p if r.class_name == "code")
    other = _run("x", plan, 100.0, {a_chat.id: "sampled differs", a_code.id: "greedy differs"})
    f = figures("x", [other], plan, reference, PHASES, greedy, None, None)
    assert f.mismatched == 1  # the sampled class may differ; the greedy one may not
    assert f.latency.tpot_p50 == pytest.approx(0.01)
    assert f.acceptance["light"] == pytest.approx(0.4)
    rows = request_rows(other, plan)
    assert len(rows) == 16 and all(r["tokens"] == 50 for r in rows)


def test_versus_ratios_and_the_ceiling_take_each_phase_best() -> None:
    plan = build_plan(HELDOUT, PHASES)
    greedy: frozenset[str] = frozenset()
    ref = _run("off", plan, 100.0, {})

    def fig(name: str, rates: tuple[float, float]) -> ConfigFigures:
        run = _run(name, plan, 1.0, {})
        for phase, rate in zip(run.phases, rates, strict=True):
            phase["output_throughput"] = rate
            phase["duration"] = phase["total_output_tokens"] / rate
        return figures(name, [run], plan, ref, PHASES, greedy, None, None)

    fast_light, fast_peak = fig("a", (200.0, 100.0)), fig("b", (100.0, 200.0))
    ours = fig("ours", (200.0, 200.0))
    v = versus(ours, [fast_light, fast_peak], ref)
    assert v.ratio_per_phase == pytest.approx((1.0, 1.0))
    assert v.best_per_phase == ("a", "b")
    assert v.ceiling_share == pytest.approx(1.0)
    # The best single static: tokens 200 (light) + 600 (peak) -> b runs 2 + 3 = 5 s.
    assert v.best_static == "b"
    assert v.ratio_best_static == pytest.approx((800 / 4) / (800 / 5))
    assert not math.isnan(v.tpot_p99_ratio)


def test_the_nocut_configurations_differ_from_specpilot_only_in_the_controllers_cut() -> None:
    # Run only when named: the default line-up is unchanged.
    assert [c.name for c in select_configs(())] == [c.name for c in real_configs()]
    assert not any(c.controller for c in real_configs())
    by_name = {c.name: c for c in real_optional_configs(max_k=3)}
    assert list(by_name) == ["specpilot-eagle-nocut", "specpilot-nocut"]
    for ours in (specpilot_config(3, "eagle"), specpilot_config(3)):
        nocut = by_name[f"{ours.name}-nocut"]
        # Everything else equal, the engine in batch_max (where it cuts each request's drafts).
        assert replace(nocut, name=ours.name, controller={}) == ours
        assert nocut.plugin_env["K_MODE"] == "batch_max"
        # What the benchmark hands its sidecar is a setting the controller reads as the cut
        # off; specpilot's own configurations run the default, the cut on.
        assert not core_config(load_settings(**nocut.controller)).policy.token_cut
        assert core_config(load_settings(**ours.controller)).policy.token_cut
    named = select_configs(["specpilot-eagle-nocut", "off", "specpilot-eagle"])
    assert [c.name for c in named] == ["off", "specpilot-eagle", "specpilot-eagle-nocut"]
    with pytest.raises(ValueError, match=r"unknown configurations.*specpilot-eagle-cut"):
        select_configs(["specpilot-eagle-cut"])


def test_the_cut_needs_a_model_drafter() -> None:
    with pytest.raises(ValueError, match="model drafter"):
        without_token_cut(specpilot_config(drafter="suffix"))
    with pytest.raises(ValueError, match="model drafter"):
        without_token_cut(EngineConfig("eagle:2p", "eagle", 2))
