"""The demo's pure parts: the request plan, and the benchmark's medians, ratios and identity
check on hand-made runs."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from benchmarks.demo.bench import BENCH_WORKLOAD, markdown, report_json, rotated, summarize
from benchmarks.demo.calibration import calibration_rows, share_within
from benchmarks.demo.configs import (
    OFF,
    SPECPILOT,
    SPECPILOT_EAGLE,
    EngineConfig,
    bench_configs,
    optional_configs,
    specpilot_config,
    static_rivals,
)
from benchmarks.demo.driver import PhaseResult, RequestResult, RunResult
from benchmarks.demo.summary import class_figures, median, output_mismatches
from benchmarks.demo.workload import (
    DEFAULT_WORKLOAD,
    EDIT_SEPARATOR,
    ClassSpec,
    Phase,
    Workload,
    build_plan,
)
from specpilot.contract.buckets import batch_range, parse_batch

TEXTS = {"code": [" ".join(f"def f{i}(x): return x + {i}" for i in range(400))],
         "prose": [" ".join(f"word{i % 97}" for i in range(3000))]}


def encode(text: str) -> list[int]:
    # One token per character: deterministic and reversible.
    return [ord(c) for c in text]


def test_plan_is_deterministic_and_follows_the_workload() -> None:
    a = build_plan(DEFAULT_WORKLOAD, TEXTS, encode)
    b = build_plan(DEFAULT_WORKLOAD, TEXTS, encode)
    assert a.requests == b.requests
    assert [len(p) for p in a.by_phase] == [p.requests for p in DEFAULT_WORKLOAD.phases]
    assert len({r.request_id for r in a.requests}) == len(a.requests)
    burst = a.by_phase[1]
    counts = {c.name: sum(r.traffic_class == c.name for r in burst)
              for c in DEFAULT_WORKLOAD.classes}
    for spec in DEFAULT_WORKLOAD.classes:  # shares rounded by largest remainder
        assert abs(counts[spec.name] - spec.share * len(burst)) < 1
    for r in a.requests:
        spec = next(c for c in DEFAULT_WORKLOAD.classes if c.name == r.traffic_class)
        assert r.max_tokens == spec.max_tokens
        if spec.shape == "plain":
            assert len(r.prompt_token_ids) == spec.prompt_tokens
    other = build_plan(Workload(DEFAULT_WORKLOAD.classes, DEFAULT_WORKLOAD.phases, seed=9),
                       TEXTS, encode)
    assert other.requests != a.requests


def test_edit_prompts_restart_their_passage_after_the_separator() -> None:
    plan = build_plan(DEFAULT_WORKLOAD, TEXTS, encode)
    edits = [r for r in plan.requests if r.traffic_class == "edit"]
    assert edits
    for r in edits:
        text = "".join(map(chr, r.prompt_token_ids))
        passage, restart = text.split(EDIT_SEPARATOR)
        assert restart and passage.startswith(restart)


def test_plan_rejects_text_that_is_too_short() -> None:
    workload = Workload((ClassSpec("c", "code", 1.0, prompt_tokens=10**6, max_tokens=4),),
                        (Phase("p", 1, 1),))
    with pytest.raises(ValueError, match="no text has"):
        build_plan(workload, TEXTS, encode)
    with pytest.raises(ValueError, match="no texts of kind"):
        build_plan(Workload((ClassSpec("c", "poetry", 1.0, 4, 4),), (Phase("p", 1, 1),)),
                   TEXTS, encode)


# A three-phase workload of one greedy class ("code") and one sampled class ("chat").
WORKLOAD = Workload((ClassSpec("code", "code", 1.0, 8, 8),
                     ClassSpec("chat", "prose", 1.0, 8, 8, temperature=0.8)),
                    (Phase("light", 1, 1), Phase("burst", 16, 1), Phase("light-again", 1, 1)))


def _run(config: str, phase_rates: list[float], tokens: tuple[int, ...] = (1, 2, 3),
         drafted: int = 8, accepted: int = 4, chat_tokens: tuple[int, ...] = (7, 8, 9),
         step_seconds: float = 0.01) -> RunResult:
    # Every phase: 10 s, rate x 10 tokens; its decode steps: 100 steps of ``step_seconds`` at
    # batch 2, generating the same tokens.
    phases = tuple(PhaseResult(p.name, p.concurrency, 10.0, int(rate * 10), 100,
                               100 * step_seconds, int(rate * 10), 200)
                   for p, rate in zip(WORKLOAD.phases, phase_rates, strict=True))
    requests = (RequestResult("r0", 0, "code", tokens, 0.0, 1.0, drafted, accepted, (1, 1, 1)),
                RequestResult("r1", 0, "chat", chat_tokens, 0.0, 1.0, drafted, accepted,
                              (1, 1, 1)))
    return RunResult(config, phases, requests)


# Hand-made configurations for the summaries: names as the runs below.
CONFIGS = [EngineConfig(OFF), EngineConfig("draft:4", "draft", 4),
           EngineConfig("eagle:4", "eagle", 4), EngineConfig("x", "ngram", 4),
           specpilot_config(), specpilot_config(drafter="eagle")]


def test_summary_takes_medians_and_ratios_against_static_configs() -> None:
    runs = {
        "off": [_run("off", [10, 100, 10], drafted=0, accepted=0)] * 3,
        "draft:4": [_run("draft:4", [30, 60, 30]), _run("draft:4", [20, 60, 20]),
                    _run("draft:4", [25, 60, 25])],
        SPECPILOT: [_run(SPECPILOT, [20, 95, 20]), _run(SPECPILOT, [28, 99, 28]),
                    _run(SPECPILOT, [29, 99, 29])],
    }
    report = summarize(WORKLOAD, CONFIGS, runs, runs["off"][0], seconds=60.0)
    ours = report.figures(SPECPILOT)
    assert ours is not None and ours.phase_tokens_per_second == (28.0, 99.0, 28.0)
    # Whole-run medians: off 40, draft:4 (25+60+25)/3 = 36.7, specpilot (28+99+28)/3 = 51.7.
    [versus] = report.versus
    assert versus.name == SPECPILOT and versus.rivals == ("off", "draft:4")
    assert versus.best_static == "off"
    assert versus.ratio_best_static == pytest.approx((155 / 3) / 40)
    assert versus.best_per_phase == ("draft:4", "off", "draft:4")
    assert versus.ratio_per_phase == pytest.approx((28 / 25, 0.99, 28 / 25))
    assert versus.first_run_tokens_per_second == pytest.approx(135 / 3)
    # Decode: the same tokens in 1 s of decode steps per phase.
    assert ours.phase_decode_tokens_per_second == (280.0, 990.0, 280.0)
    assert ours.phase_step_seconds_per_sequence == pytest.approx((0.005,) * 3)
    assert report.identical_outputs
    assert math.isnan(report.figures("off").acceptance["code"])  # type: ignore[union-attr]
    assert ours.acceptance["code"] == pytest.approx(0.5)
    assert ours.tokens_per_verify_step["code"] == pytest.approx(1 + 4 / 3)
    text = markdown(report)
    assert f"best single static rival (off): **{(155 / 3) / 40:.3f}**" in text
    assert "goal" not in text and "identical to no speculation in every run: yes" in text
    assert f"**ceiling of {SPECPILOT}**" in text
    saved = report_json(report)
    assert saved["configs"][0]["acceptance"]["code"] is None
    assert [v["name"] for v in saved["versus"]] == [SPECPILOT]
    assert saved["versus"][0]["ratio_best_static"] == pytest.approx((155 / 3) / 40, abs=1e-4)


def test_each_specpilot_configuration_is_measured_against_its_own_drafts() -> None:
    # The EAGLE head beats everything statically; specpilot on the draft model is measured
    # against off and draft:4 only, specpilot on the head against off, n-gram and the head.
    runs = {"off": [_run("off", [10, 10, 10])], "draft:4": [_run("draft:4", [20, 20, 20])],
            "eagle:4": [_run("eagle:4", [40, 40, 40])], "x": [_run("x", [15, 50, 15])],
            SPECPILOT: [_run(SPECPILOT, [22, 22, 22])],
            SPECPILOT_EAGLE: [_run(SPECPILOT_EAGLE, [44, 44, 44])]}
    report = summarize(WORKLOAD, CONFIGS, runs, runs["off"][0], seconds=1.0,
                       calibration={SPECPILOT_EAGLE: calibration_rows(
                           {(0, 2): 10.0}, {(0, 2): 0.1}, {(0, 2): 0.1}, [1, 16])})
    ours, eagle = report.comparison(SPECPILOT), report.comparison(SPECPILOT_EAGLE)
    assert ours is not None and eagle is not None
    assert ours.rivals == ("off", "draft:4", "x") and eagle.rivals == ("off", "eagle:4", "x")
    assert ours.best_static == "x" and ours.ratio_best_static == pytest.approx(22 / (80 / 3))
    assert eagle.best_static == "eagle:4" and eagle.ratio_best_static == pytest.approx(1.1)
    assert ours.best_per_phase == ("draft:4", "x", "draft:4")
    assert eagle.best_per_phase == ("eagle:4", "x", "eagle:4")
    # Each ceiling is built from its own rivals: the head's is the draft model's out of reach.
    assert ours.ceiling is not None and eagle.ceiling is not None
    assert {s for p in ours.ceiling.phases for s in p.best.values()} <= set(ours.rivals)
    assert {s for p in eagle.ceiling.phases for s in p.best.values()} <= set(eagle.rivals)
    assert ours.calibration == () and len(eagle.calibration) == 1
    text = markdown(report)
    for v in report.versus:
        assert f"**ceiling of {v.name}**" in text
        assert f"- {v.name} / best single static rival ({v.best_static})" in text
    assert "predicted ms" in text
    assert [v["name"] for v in report_json(report)["versus"]] == [SPECPILOT, SPECPILOT_EAGLE]


def test_the_ceiling_gives_each_class_its_best_configuration() -> None:
    from benchmarks.demo.ceiling import ceiling

    # code gains 3 tokens per step with the draft (at twice the step cost), chat nothing.
    tau = [{"off": 0.01, "draft": 0.02}]
    expected = {"code": {"off": 1.0, "draft": 3.0}, "chat": {"off": 1.0, "draft": 1.0}}
    c = ceiling(["p"], [{"code": 60.0, "chat": 40.0}], tau, [expected])
    [p] = c.phases
    assert p.best == {"code": "draft", "chat": "off"}
    # time = 60 * 0.02 / 3 + 40 * 0.01 = 0.8 s for 100 tokens; off alone 1.0 s, draft alone 1.2.
    assert p.tokens_per_second == pytest.approx(125.0)
    assert p.modeled == pytest.approx({"off": 100.0, "draft": 100 / 1.2})
    assert c.tokens_per_second == pytest.approx(125.0)


def test_a_changed_greedy_output_is_caught_and_sampled_ones_are_not_compared() -> None:
    ref = _run("off", [1, 1, 1])
    sampled_differs = _run("draft:4", [1, 1, 1], chat_tokens=(1, 1, 1))
    assert output_mismatches(ref, sampled_differs, WORKLOAD.greedy_classes()) == []
    assert output_mismatches(ref, sampled_differs) == ["r1"]
    bad = _run("draft:4", [1, 1, 1], tokens=(1, 2, 4))
    assert output_mismatches(ref, bad, WORKLOAD.greedy_classes()) == ["r0"]
    report = summarize(WORKLOAD, CONFIGS, {"off": [ref], "draft:4": [bad]}, ref, 1.0)
    assert not report.identical_outputs and report.versus == ()
    assert "NO" in markdown(report)


def test_a_shifted_sampled_distribution_is_caught() -> None:
    ref = _run("off", [1, 1, 1])
    same = {"chat": [[1, 2], [1, 3]] * 100}
    shifted = {"chat": [[1, 2]] * 200}
    ok = summarize(WORKLOAD, CONFIGS, {"off": [ref], "x": [ref]}, ref, 1.0,
                   {"off": same, "x": same})
    assert ok.distributions_match and ok.exact
    bad = summarize(WORKLOAD, CONFIGS, {"off": [ref], "x": [ref]}, ref, 1.0,
                    {"off": same, "x": shifted})
    figures = bad.figures("x")
    assert figures is not None and [c.same for c in figures.distribution["chat"]] == [True, False]
    assert not bad.distributions_match and "DIFFERS" in markdown(bad)


def test_helpers() -> None:
    assert median([3.0, 1.0, 2.0]) == 2.0 and median([1.0, 2.0]) == 1.5
    assert math.isnan(median([]))
    names = [c.name for c in bench_configs()]
    assert names == ["off", "draft:2p", "draft:4p", "ngram:4", "draft-table-p", "eagle:2p",
                     SPECPILOT, SPECPILOT_EAGLE]
    assert rotated(bench_configs(), 1)[0].name == "draft:2p"
    assert rotated(bench_configs(), 8)[0].name == "off"
    figures = class_figures(_run("x", [1, 1, 1]).requests)["code"]
    assert figures.tokens_per_verify_step == pytest.approx(1 + 4 / 3)
    spec = bench_configs()[4].speculative_config(draft_dir=Path("/d"))
    assert spec is not None and spec["num_speculative_tokens_per_batch_size"][0] == [1, 2, 4]
    assert spec["draft_sample_method"] == "probabilistic"
    assert BENCH_WORKLOAD.max_concurrency == 32
    assert [c.name for c in optional_configs()] == ["eagle:4p", "specpilot-decisions"]
    eagle, decisions = optional_configs()
    assert decisions.specpilot and decisions.plugin_env["STEP_COMPOSITION"] == "false"
    assert decisions.plugin_env["K_MODE"] == "batch_max"
    spec = eagle.speculative_config(draft_dir=Path("/d"), eagle_dir=Path("/e"))
    assert spec == {"method": "eagle", "model": "/e", "num_speculative_tokens": 4,
                    "draft_sample_method": "probabilistic"}
    with pytest.raises(ValueError, match="EAGLE head"):
        eagle.speculative_config(draft_dir=Path("/d"))


def test_the_eagle_configurations_of_the_line_up() -> None:
    by_name = {c.name: c for c in bench_configs(max_k=3)}
    static = by_name["eagle:2p"]
    assert not static.specpilot and static.plugin_env == {}
    assert static.speculative_config(Path("/d"), Path("/e")) == {
        "method": "eagle", "model": "/e", "num_speculative_tokens": 2,
        "draft_sample_method": "probabilistic"}
    # specpilot on the head: the head up to max_k, the specpilot scheduler in batch_max mode,
    # as specpilot on the draft model, whose speculative config names the draft instead.
    ours, theirs = by_name[SPECPILOT_EAGLE], by_name[SPECPILOT]
    assert ours.specpilot and ours.plugin_env == {"K_MODE": "batch_max", "SUFFIX_DRAFTS": "true"}
    assert ours.plugin_env == theirs.plugin_env
    assert ours.speculative_config(Path("/d"), Path("/e")) == {
        "method": "eagle", "model": "/e", "num_speculative_tokens": 3,
        "draft_sample_method": "probabilistic"}
    assert theirs.speculative_config(Path("/d"), Path("/e")) == {
        "model": "/d", "num_speculative_tokens": 3, "draft_sample_method": "probabilistic"}
    with pytest.raises(ValueError, match="EAGLE head"):
        ours.speculative_config(Path("/d"))
    with pytest.raises(ValueError, match="model drafter"):
        specpilot_config(drafter="medusa")
    # On suffix decoding: K cut per request, its rivals the drafts it can run (no model draft).
    on_suffix = specpilot_config(drafter="suffix")
    assert on_suffix.plugin_env == {"K_MODE": "per_request"}
    assert on_suffix.speculative_config(Path("/d")) == {"method": "suffix",
                                                        "num_speculative_tokens": 4}
    assert [c.name for c in static_rivals(on_suffix, bench_configs())] == ["off", "ngram:4"]
    # Rivals: the static configurations on the drafts each can choose.
    line_up = bench_configs() + optional_configs()
    assert [c.name for c in static_rivals(theirs, line_up)] == [
        "off", "draft:2p", "draft:4p", "ngram:4", "draft-table-p"]
    assert [c.name for c in static_rivals(ours, line_up)] == [
        "off", "ngram:4", "eagle:2p", "eagle:4p"]


def test_calibration_rows_are_per_step_means_with_their_bucket_ranges() -> None:
    bounds = (1, 2, 4, 16)
    assert [batch_range(bounds, b) for b in range(5)] == ["1", "2", "3-4", "5-16", "17+"]
    # Either a batch size or a range names a bucket; anything else is refused with the ranges.
    assert [parse_batch(bounds, t) for t in ("1", "3", "3-4", "16", "17", "17+", "500")] == [
        0, 2, 2, 3, 4, 4, 4]
    with pytest.raises(ValueError, match="1, 2, 3-4, 5-16, 17"):
        parse_batch(bounds, "5-8")
    steps = {(0, 2): 100.0, (3, 1): 50.0, (4, 0): 0.0}
    measured = {(0, 2): 1.2, (3, 1): 1.0, (4, 0): 0.0}
    predicted = {(0, 2): 1.26, (3, 1): 1.5}
    rows = calibration_rows(steps, predicted, measured, [1, 2, 4, 16])
    assert [(r.batch_sizes, r.k) for r in rows] == [("1", 2), ("5-16", 1)]  # no empty cells
    assert rows[0].measured_seconds == pytest.approx(0.012)
    assert rows[0].error == pytest.approx(0.05)
    assert rows[1].error == pytest.approx(0.5)
    assert share_within(rows) == pytest.approx(100 / 150)  # weighted by steps
    assert math.isnan(share_within(()))  # no timed steps: no share


def test_the_demo_command_runs_the_real_model_unless_told_tiny() -> None:
    from benchmarks.demo.cli import demo_options
    from benchmarks.real.demo_plan import real_workload
    from specpilot.controller.cli import build_parser

    parser = build_parser("demo")
    default = demo_options(parser.parse_args(["demo"]))
    assert default.models == "real" and default.drafter is None  # the head, on the real model
    assert default.workload == real_workload()
    options = demo_options(parser.parse_args(["demo", "--models", "tiny", "--drafter", "eagle",
                                              "--scale", "0.5"]))
    assert options.models == "tiny" and options.drafter == "eagle"
    assert options.workload is not None and options.workload.phases[0].requests == 6
    with pytest.raises(SystemExit):
        parser.parse_args(["demo", "--drafter", "ngram"])
    bench = build_parser("bench").parse_args(["bench", "engine", "--config", SPECPILOT_EAGLE])
    assert bench.configs == [SPECPILOT_EAGLE]


def test_bench_real_reads_its_drafter_options() -> None:
    from benchmarks.demo.cli import real_bench_options
    from specpilot.controller.cli import build_parser

    parser = build_parser("bench")
    default = real_bench_options(parser.parse_args(["bench", "real", "--no-plots"]))
    assert not default.quick_drafters and default.drafter_tables and default.configs == ()
    options = real_bench_options(parser.parse_args(
        ["bench", "real", "--no-plots", "--quick-drafters", "--no-drafter-tables",
         "--config", "specpilot-eagle-nocut", "--scale", "0.5"]))
    assert options.quick_drafters and not options.drafter_tables
    assert options.configs == ("specpilot-eagle-nocut",) and options.phases[1].seconds == 30
