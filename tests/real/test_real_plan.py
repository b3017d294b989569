"""The real benchmark's plan by time (pure): parsing and validating a plan, each phase's request
sequence, the closed loop that holds a phase's concurrency for its time, and the tokens counted
within it."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest

from benchmarks.real.client import Loop, closed_loop, phase_result, window_tokens
from benchmarks.real.plan import (
    DEFAULT_PLAN,
    ROUND,
    TimedPhase,
    class_counts,
    parse_plan,
    phase_pools,
    phase_requests,
    plan_spec,
    read_plan,
    scaled_plan,
)
from benchmarks.real.sharegpt import CLASSES, TrafficRequest


def _request(cls: str, i: int) -> TrafficRequest:
    temperature = next(c.temperature for c in CLASSES if c.name == cls)
    return TrafficRequest(f"{cls}-{i}", cls, [{"role": "user", "content": f"q{i}"}], 10,
                          "a", 128, temperature)


HELDOUT = {c.name: [_request(c.name, i) for i in range(40)] for c in CLASSES}


def test_the_default_plan_is_the_rhythm_with_equal_phases_of_a_minute_or_more() -> None:
    assert [(p.name, p.concurrency) for p in DEFAULT_PLAN] == [
        ("light", 1), ("burst", 16), ("peak", 32), ("light-again", 1)]
    assert len({p.seconds for p in DEFAULT_PLAN}) == 1
    assert DEFAULT_PLAN[0].seconds >= 60


def test_an_inline_plan_parses_and_replays() -> None:
    plan = parse_plan("light:1:90, burst:16:90s,peak:32:1.5m,light:1:45.5")
    assert plan == (TimedPhase("light", 1, 90.0), TimedPhase("burst", 16, 90.0),
                    TimedPhase("peak", 32, 90.0), TimedPhase("light", 1, 45.5))
    assert plan_spec(plan) == "light:1:90,burst:16:90,peak:32:90,light:1:45.5"
    assert parse_plan(plan_spec(plan)) == plan
    assert parse_plan(plan_spec(DEFAULT_PLAN)) == DEFAULT_PLAN


def test_a_plan_file_in_yaml_or_json_reads_like_the_inline_one(tmp_path: Path) -> None:
    phases = [{"name": "quiet", "concurrency": 1, "seconds": 120},
              {"name": "rush", "concurrency": 24, "seconds": "2m"}]
    want = (TimedPhase("quiet", 1, 120.0), TimedPhase("rush", 24, 120.0))
    as_json = tmp_path / "plan.json"
    as_json.write_text(json.dumps(phases))
    as_yaml = tmp_path / "plan.yaml"
    as_yaml.write_text("phases:\n  - {name: quiet, concurrency: 1, seconds: 120}\n"
                       "  - {name: rush, concurrency: 24, seconds: 2m}\n")
    assert read_plan(str(as_json)) == want
    assert read_plan(str(as_yaml)) == want
    assert read_plan("quiet:1:120,rush:24:120") == want


@pytest.mark.parametrize(("spec", "message"), [
    ("", "no phases"),
    (" , ", "no phases"),
    ("light:0:60", "concurrency must be .* at least 1, got 0"),
    ("light:-4:60", "concurrency must be .* at least 1, got -4"),
    ("light:1.5:60", "whole number"),
    ("light:one:60", "'one' is not a number"),
    ("light:1:0", "seconds must be a positive duration, got 0"),
    ("light:1:-30", "seconds must be a positive duration"),
    ("light:1:nan", "seconds must be a positive duration"),
    ("light:1:soon", "not a duration"),
    ("light:1", "must be name:concurrency:seconds"),
    (":1:60", "name must be non-empty"),
])
def test_a_bad_inline_plan_says_what_to_write(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as info:
        parse_plan(spec)
    assert "e.g." in str(info.value)  # what to write instead


def test_a_bad_plan_file_says_what_to_write(tmp_path: Path) -> None:
    cases = {"empty.yaml": ("", "no phases"),
             "scalar.json": ("3", "holds a list of phases"),
             "keys.json": ('[{"name": "a", "secs": 3}]', "write exactly name, concurrency"),
             "zero.yaml": ("- {name: a, concurrency: 0, seconds: 60}", "at least 1, got 0"),
             "bool.yaml": ("- {name: a, concurrency: true, seconds: 60}", "at least 1, got True"),
             "late.yaml": ("- {name: a, concurrency: 2, seconds: soon}", "not a duration")}
    for name, (text, message) in cases.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(ValueError, match=message) as info:
            read_plan(str(tmp_path / name))
        assert "e.g." in str(info.value) or "list of phases" in str(info.value)
    with pytest.raises(ValueError, match="no plan file"):
        read_plan(str(tmp_path / "missing.yaml"))


def test_scale_multiplies_the_durations_and_must_be_positive() -> None:
    half = scaled_plan(DEFAULT_PLAN, 0.5)
    assert [p.seconds for p in half] == [p.seconds / 2 for p in DEFAULT_PLAN]
    assert [p.concurrency for p in half] == [p.concurrency for p in DEFAULT_PLAN]
    for factor in (0.0, -1.0, float("inf")):
        with pytest.raises(ValueError, match="--scale must be a positive"):
            scaled_plan(DEFAULT_PLAN, factor)


def _ids(index: int, n: int, *, seed: int = 0, phases: int = 4) -> list[str]:
    return [r.id for r in itertools.islice(phase_requests(HELDOUT, index, phases, seed), n)]


def test_a_phase_sequence_is_deterministic_and_prefix_stable() -> None:
    assert _ids(1, 50) == _ids(1, 50)
    assert _ids(1, 50) != _ids(1, 50, seed=1)
    # However far a run gets, the requests it got are the same: a prefix.
    assert _ids(1, 200)[:37] == _ids(1, 37)
    # Phases draw from disjoint pools.
    assert not set(_ids(0, 40)) & set(_ids(3, 40))


def test_a_phase_sequence_holds_the_shares_every_round_and_starts_its_pool_over() -> None:
    sequence = list(itertools.islice(phase_requests(HELDOUT, 2, 4), 3 * ROUND))
    for k in range(3):
        counts = Counter(r.class_name for r in sequence[k * ROUND:(k + 1) * ROUND])
        assert counts == class_counts(CLASSES, ROUND)
    # The phase's own code requests: 40 dealt round 4 phases = 10; 3 rounds take 15.
    pool = phase_pools(HELDOUT, 4)[2]["code"]
    codes = [r.id for r in sequence if r.class_name == "code"]
    assert codes == [r.id for r in (pool + pool)[:15]]


def test_a_class_too_small_for_the_plan_is_refused() -> None:
    small = {**HELDOUT, "code": HELDOUT["code"][:2]}
    with pytest.raises(ValueError, match=r"'code' has 2 held-out requests.*3 phases"):
        phase_requests(small, 0, 3)


def test_the_closed_loop_keeps_its_concurrency_until_the_time_then_drains() -> None:
    in_flight = 0
    most = 0
    starts: list[float] = []
    ends: list[float] = []

    async def send(position: int, item: int) -> int:
        nonlocal in_flight, most
        in_flight += 1
        most = max(most, in_flight)
        starts.append(time.perf_counter())
        await asyncio.sleep(0.02)
        in_flight -= 1
        ends.append(time.perf_counter())
        return item * 10

    loop = asyncio.run(closed_loop(send, iter(range(10_000)), 3, 0.2))
    n = len(loop.sent)
    assert loop.sent == list(range(n))  # a prefix of the sequence, in order
    assert loop.outputs == [i * 10 for i in range(n)]  # every one sent finished
    assert most == 3
    assert max(starts) < loop.deadline  # none started after the phase's time
    assert max(ends) <= loop.end and loop.end >= loop.deadline  # the ones in flight drained
    assert loop.deadline - loop.start == pytest.approx(0.2)
    # Closed loop: about c x time / latency, each client sending again as its last one ends.
    assert 2 * 3 < n <= 3 * 0.2 / 0.02 + 3


def test_tokens_count_within_the_phase_time_only() -> None:
    # First chunk at 1 s, then one every second: chunks at 1, 2, 3, 4 (4 chunks, 8 tokens).
    itl = [1.0, 1.0, 1.0]
    assert window_tokens(0.0, 1.0, itl, 8, deadline=10.0) == 8  # done in time: all
    assert window_tokens(0.0, 1.0, itl, 8, deadline=2.5) == 4  # 2 of 4 chunks by then
    assert window_tokens(0.0, 1.0, itl, 8, deadline=0.5) == 0  # no token by then
    assert window_tokens(5.0, 1.0, [], 1, deadline=5.5) == 0
    assert window_tokens(5.0, 1.0, [], 1, deadline=6.0) == 1


def test_a_phase_result_counts_its_seconds_and_keeps_vllms_figures() -> None:
    sent = [_request("code", i) for i in range(3)]
    # Chunks at 1-4 s (done by the 10 s deadline), 9-12 s (half by then), 11-14 s (none).
    outputs = [SimpleNamespace(prompt_len=10, ttft=1.0, itl=[1.0] * 3, latency=4.0,
                               start_time=start, generated_text="t", error="")
               for start in (0.0, 8.0, 10.0)]
    metrics = SimpleNamespace(
        completed=3, failed=0, total_input=30, total_output=24, request_throughput=0.2,
        output_throughput=24 / 14, total_token_throughput=54 / 14, max_output_tokens_per_s=4.0,
        max_concurrent_requests=2,
        **{f"{stat}_{m}_ms": 1.0 for stat in ("mean", "median", "std")
           for m in ("ttft", "tpot", "itl", "e2el")},
        **{f"percentiles_{m}_ms": [(50.0, 2.0), (99.0, 3.0)]
           for m in ("ttft", "tpot", "itl", "e2el")})
    result = phase_result(Loop(sent, outputs, 0.0, 10.0, 14.0), metrics, [8, 8, 8], {})
    assert result["phase_seconds"] == 10.0 and result["drain_seconds"] == 4.0
    assert result["window_output_tokens"] == [8.0, 4.0, 0.0]
    assert result["window_tokens_per_second"] == pytest.approx(1.2)  # 12 tokens in 10 s
    assert result["output_throughput"] == pytest.approx(24 / 14)  # vLLM's, with the drain
    assert result["p99_ttft_ms"] == 3.0 and result["p50_tpot_ms"] == 2.0
    assert result["request_ids"] == [r.id for r in sent]


def test_bench_real_takes_a_plan_and_scales_its_durations(
        capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks.demo.cli import real_bench_main, real_bench_options
    from specpilot.controller.cli import build_parser

    parser = build_parser("bench")
    default = real_bench_options(parser.parse_args(["bench", "real", "--no-plots"]))
    assert default.phases == DEFAULT_PLAN
    options = real_bench_options(parser.parse_args(
        ["bench", "real", "--no-plots", "--plan", "light:1:90,peak:32:120", "--scale", "0.5"]))
    assert options.phases == (TimedPhase("light", 1, 45.0), TimedPhase("peak", 32, 60.0))
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "real", "--plan", "light:0:90"])
    assert "concurrency must be" in capsys.readouterr().err
    assert real_bench_main(parser.parse_args(["bench", "real", "--scale", "0"])) == 2
    assert "--scale must be a positive" in capsys.readouterr().err
