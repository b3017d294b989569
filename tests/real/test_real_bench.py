"""The real benchmark's pure parts: the demo's counted plan, the per-request figures from
vLLM's result, the exactness count on the requests both runs reached, and the ratios and ceiling
against the static configurations."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from benchmarks.demo.configs import EngineConfig, specpilot_config, without_token_cut
from benchmarks.real.bench import (
    ConfigFigures,
    Run,
    compare_greedy,
    figures,
    paired_decode,
    real_configs,
    real_optional_configs,
    request_rows,
    select_configs,
    versus,
)
from benchmarks.real.plan import LoadPhase, TimedPhase, build_plan, class_counts
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


TIMED = (TimedPhase("light", 1, 10.0), TimedPhase("peak", 8, 10.0))


def _run(name: str, plan: list[list[TrafficRequest]], rate: float, texts: dict[str, str],
         tpot: float = 0.01, seconds: float = 10.0) -> Run:
    """A run that sent ``plan``'s requests per phase, 50 tokens each, ``rate`` tokens/s within
    each phase's ``seconds`` (the rest in its drain)."""
    phases = []
    for requests in plan:
        n = len(requests)
        tokens = [50] * n
        within = rate * seconds
        phases.append({"duration": seconds + 1, "total_output_tokens": sum(tokens),
                       "output_throughput": sum(tokens) / (seconds + 1), "output_lens": tokens,
                       "ttfts": [0.1] * n, "latencies": [0.1 + 49 * tpot] * n,
                       "generated_texts": [texts.get(r.id, "same") for r in requests],
                       "request_ids": [r.id for r in requests],
                       "classes": [r.class_name for r in requests],
                       "window_output_tokens": [within / n] * n, "phase_seconds": seconds,
                       "window_tokens_per_second": within / seconds,
                       "spec_decode_draft_tokens": 100, "spec_decode_accepted_tokens": 40})
    return Run(name, 0, phases)


def test_figures_count_greedy_mismatches_only_and_read_tpot() -> None:
    plan = build_plan(HELDOUT, PHASES)
    reference = _run("off", plan, 100.0, {})
    greedy = frozenset(c.name for c in CLASSES if c.temperature == 0)
    a_chat = next(r for p in plan for r in p if r.class_name == "chat")
    a_code = next(r for p in plan for r in p if r.class_name == "code")
    other = _run("x", plan, 100.0, {a_chat.id: "sampled differs", a_code.id: "greedy differs"})
    f = figures("x", [other], reference, TIMED, greedy, None, None)
    assert f.mismatched == 1  # the sampled class may differ; the greedy one may not
    assert f.compared == sum(r.class_name in greedy for p in plan for r in p)
    assert f.latency.tpot_p50 == pytest.approx(0.01)
    assert f.acceptance[0] == pytest.approx(0.4)
    assert f.requests == (4, 12)
    # The reference's own first run is not compared with itself.
    again = _run("off", plan, 100.0, {a_code.id: "noise"})
    off = figures("off", [reference, again], reference, TIMED, greedy, None, None)
    assert (off.mismatched, off.compared) == (1, f.compared)
    rows = request_rows(other)
    assert len(rows) == 16 and all(r["tokens"] == 50 for r in rows)
    assert [r["position"] for r in rows if r["phase"] == 1] == list(range(12))


def test_a_run_counts_the_phases_time_not_the_drain() -> None:
    plan = build_plan(HELDOUT, PHASES)
    run = _run("x", plan, 30.0, {}, seconds=10.0)
    # 300 tokens within each 10 s phase; the drain's tokens and second are in neither.
    assert run.seconds == pytest.approx(20.0)
    assert run.output_tokens == pytest.approx(600.0)
    assert run.tokens_per_second == pytest.approx(30.0)
    assert run.phase_rate(1) == pytest.approx(30.0)
    assert run.phases[1]["output_throughput"] != pytest.approx(30.0)  # vLLM's, with the drain


def test_greedy_outputs_compare_on_the_prefix_both_runs_reached() -> None:
    plan = build_plan(HELDOUT, PHASES)
    greedy = frozenset(c.name for c in CLASSES if c.temperature == 0)
    last_greedy = next(r for r in reversed(plan[1]) if r.class_name in greedy)
    cut = plan[1].index(last_greedy)
    # The reference reached fewer of the peak's requests; the faster run's text differs only on
    # one the reference did not reach, so nothing it can be compared on differs.
    reference = _run("off", [plan[0], plan[1][:cut]], 10.0, {})
    faster = _run("x", plan, 20.0, {last_greedy.id: "unreached"})
    common = [*plan[0], *plan[1][:cut]]
    assert compare_greedy(faster, reference, greedy) == (
        0, sum(r.class_name in greedy for r in common))
    # Reached by both: counted.
    reference = _run("off", plan, 10.0, {})
    assert compare_greedy(faster, reference, greedy)[0] == 1
    # A run that did not replay the same sequence is an error, not a comparison.
    shuffled = _run("y", [plan[0], list(reversed(plan[1]))], 10.0, {})
    with pytest.raises(ValueError, match="same plan"):
        compare_greedy(shuffled, reference, greedy)


def test_versus_ratios_and_the_ceiling_take_each_phase_best() -> None:
    plan = build_plan(HELDOUT, PHASES)
    greedy: frozenset[str] = frozenset()
    ref = _run("off", plan, 100.0, {})

    def fig(name: str, rates: tuple[float, float]) -> ConfigFigures:
        run = _run(name, plan, 1.0, {})
        for phase, rate, seconds in zip(run.phases, rates, (10.0, 30.0), strict=True):
            n = len(phase["request_ids"])
            phase["phase_seconds"] = seconds
            phase["window_tokens_per_second"] = rate
            phase["window_output_tokens"] = [rate * seconds / n] * n
        return figures(name, [run], ref, TIMED, greedy, None, None)

    fast_light, fast_peak = fig("a", (200.0, 100.0)), fig("b", (100.0, 200.0))
    ours = fig("ours", (200.0, 200.0))
    v = versus(ours, [fast_light, fast_peak], (10.0, 30.0))
    assert v.ratio_per_phase == pytest.approx((1.0, 1.0))
    assert v.best_per_phase == ("a", "b")
    assert v.ceiling_share == pytest.approx(1.0)
    # Each phase on its best static for the plan's time: (10 s x 200 + 30 s x 200) / 40 s.
    assert v.ceiling_tokens_per_second == pytest.approx(200.0)
    # The best single static: a gives 2,000 + 3,000 tokens in 40 s, b 1,000 + 6,000.
    assert v.best_static == "b"
    assert v.ratio_best_static == pytest.approx(200 / (7000 / 40))
    assert not math.isnan(v.tpot_p99_ratio)


def test_decode_time_is_compared_on_the_same_requests_per_class() -> None:
    """A quiet phase's tokens/s mixes how far each configuration got into the sequence with how
    fast it decoded; the paired decode seconds count only the requests both runs sent. Ours
    decodes code twice as slowly in the first phase and reached two requests the other did
    not (counted in neither sum)."""
    plan = build_plan(HELDOUT, PHASES)
    theirs = _run("s", [plan[0][:2], plan[1]], 100.0, {})
    ours = _run("ours", plan, 100.0, {})
    light = ours.phases[0]
    light["latencies"] = [0.1 + 49 * (0.02 if c == "code" else 0.01) for c in light["classes"]]
    pairs = paired_decode([ours, ours], [theirs, theirs], 0)
    shared = plan[0][:2]
    for cls, (mine, other) in pairs.items():
        n = 2 * sum(r.class_name == cls for r in shared)
        assert other == pytest.approx(n * 0.49)
        assert mine == pytest.approx(n * (0.98 if cls == "code" else 0.49))
    assert set(pairs) == {r.class_name for r in shared} and "code" in pairs
    peak = paired_decode([ours], [theirs], 1)
    assert all(x == pytest.approx(y) for x, y in peak.values())
    # In the report: against each phase's best static configuration, from the runs.
    figs = {name: figures(name, [run], theirs, TIMED, frozenset(), None, None)
            for name, run in (("s", theirs), ("ours", ours))}
    v = versus(figs["ours"], [figs["s"]], (10.0, 10.0), runs={"s": [theirs], "ours": [ours]})
    assert v.decode_per_phase == (paired_decode([ours], [theirs], 0), peak)
    assert versus(figs["ours"], [figs["s"]], (10.0, 10.0)).decode_per_phase == ()


def test_the_nocut_configurations_differ_from_specpilot_only_in_the_controllers_cut() -> None:
    # Run only when named: the default line-up is unchanged.
    assert [c.name for c in select_configs(())] == [c.name for c in real_configs()]
    assert not any(c.controller for c in real_configs())
    by_name = {c.name: c for c in real_optional_configs(max_k=3)}
    assert list(by_name)[:2] == ["specpilot-eagle-nocut", "specpilot-nocut"]
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


def test_forced_off_configurations_pin_every_class_off_on_each_steered_engine() -> None:
    from benchmarks.demo.configs import forced_off
    from specpilot.contract.classes import DEFAULT_CLASS
    from specpilot.controller.core.policy import PolicyConfig

    by_name = {c.name: c for c in real_optional_configs(max_k=3)}
    classes = {c.name for c in CLASSES} | {DEFAULT_CLASS}
    for drafter in ("suffix", "ngram", "eagle", "draft"):
        ours = specpilot_config(3, drafter)
        off = by_name[f"{ours.name}-forced-off"]
        # The same engine (drafter, K, plugin), the controller told every class is offline,
        # which it pins off by default.
        assert replace(off, name=ours.name, controller={}) == ours
        settings = core_config(load_settings(**off.controller))
        assert set(settings.offline_classes) == classes
        assert PolicyConfig().offline_mode == "pin_off"
    with pytest.raises(ValueError, match="specpilot configuration"):
        forced_off(real_configs()[0], classes)
