"""The sidecar server over real sockets: health, reflection, the engine stream and its bad-input
handling, policy push to every engine, the HTTP endpoints and a promtool check of /metrics."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from specpilot.contract.buckets import batch_range
from specpilot.contract.records import Override, Reason
from specpilot.controller.core.cost_model import StepShape
from specpilot.controller.server.app import RunningServer, start_server
from specpilot.controller.server.auth import engine_token
from specpilot.controller.server.stubs import async_policy_stub
from specpilot.controller.settings import load_settings
from specpilot.v1 import engine_pb2, policy_pb2
from tests.integration.conftest import FAST_SETTINGS, TOKEN, snapshot
from tests.integration.engine_client import (
    DRAFT,
    EngineClient,
    acceptance,
    hello,
    report,
)

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


def _metric(server: RunningServer, name: str, **labels: str) -> float:
    value = server.metrics.registry.get_sample_value(name, labels)
    assert value is not None, f"{name}{labels} not exported"
    return value


def _snapshot(server: RunningServer, at: float) -> tuple[Any, ...]:
    """Everything a report could change, seen at one instant ``at`` (posteriors decay with time,
    so only snapshots taken at the same instant compare). Decisions are left out: the periodic
    decide task may move them at any time."""
    snap = server.core.snapshot(at)
    estimates = [e for c in snap.classes for e in c.estimates if e.has_evidence]
    return (estimates, [c.name for c in snap.classes], snap.engines,
            server.core.cost_fit())


# --- health and reflection ---------------------------------------------------------------------
async def test_health_is_serving_for_the_server_and_both_services(
    channel: grpc.aio.Channel,
) -> None:
    check: Callable[..., Any] = health_pb2_grpc.HealthStub(channel).Check
    for service in ("", "specpilot.v1.EngineService", "specpilot.v1.PolicyService"):
        resp = await check(health_pb2.HealthCheckRequest(service=service))
        assert resp.status == health_pb2.HealthCheckResponse.SERVING, service
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await check(health_pb2.HealthCheckRequest(service="specpilot.v1.NoSuchService"))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


async def test_reflection_lists_both_services(channel: grpc.aio.Channel) -> None:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    info: Callable[..., Any] = stub.ServerReflectionInfo
    call = info(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
    resp = await call.read()
    names = {s.name for s in resp.list_services_response.service}
    assert {"specpilot.v1.EngineService", "specpilot.v1.PolicyService"} <= names


# --- engine stream -----------------------------------------------------------------------------
async def test_hello_gets_ack_then_policy(server: RunningServer, channel: grpc.aio.Channel) -> None:
    engine = EngineClient(channel)
    ack = await engine.connect()
    assert list(ack.accepted_drafts) == [DRAFT, "ngram"]
    rejected = {r.name: r.reason for r in ack.rejected_drafts}
    assert list(rejected) == ["draft-other-tokenizer"]
    assert "vocabulary hash" in rejected["draft-other-tokenizer"]
    assert ack.report_interval_seconds == FAST_SETTINGS["report_interval_seconds"]
    assert list(ack.batch_bucket_upper_bounds) == list(server.core.config.batch_bucket_upper_bounds)
    assert ack.max_classes == FAST_SETTINGS["max_classes"]
    assert ack.controller_version

    policy = engine.policies[-1]
    n_buckets = server.core.config.n_buckets
    assert policy.version == server.core.version >= 1
    assert len(policy.default_decisions) == n_buckets
    default = [d for d in policy.decisions if d.traffic_class == "default"]
    assert sorted(d.batch_bucket for d in default) == list(range(n_buckets))
    # The warm-up K with a draft the engine offered and the controller accepted.
    assert all(d.k == 2 and d.draft == DRAFT for d in default)
    assert policy.fail_static_timeout_seconds == 30.0
    assert [e.engine_id for e in snapshot(server).engines] == ["engine-1"]

    msg = report(1)
    msg.records_dropped = 5
    # 40 steps of batch 4 at K=2, 25 ms each: counted with what the cost model predicted.
    msg.step_timings.append(engine_pb2.StepTiming(
        batch_bucket=2, draft=DRAFT, k=2, steps=40, sum_batch_size=160, sum_verified_tokens=480,
        sum_draft_tokens=320, sum_step_seconds=1.0))
    predicted = server.core.predicted_seconds(StepShape(4, 12, DRAFT, 2, 8))
    result = await engine.send(msg)
    assert (result.accepted, result.code, result.sequence) == (True, 0, 1)
    assert _metric(server, "specpilot_reports_received_total") == 1
    assert _metric(server, "specpilot_engine_records_dropped_total") == 5
    cell = {"batch": "3-4", "k": "2"}  # bucket 2: batch sizes 3-4
    assert _metric(server, "specpilot_cost_model_steps_total", **cell) == 40
    assert _metric(server, "specpilot_cost_model_measured_seconds_total", **cell) == (
        pytest.approx(1.0))
    assert _metric(server, "specpilot_cost_model_predicted_seconds_total", **cell) == (
        pytest.approx(40 * predicted))
    assert _metric(server, "specpilot_engine_hellos_total", outcome="accepted") == 1
    await engine.close()
    for _ in range(100):  # the disconnect is processed on the server's loop
        if not snapshot(server).engines:
            break
        await asyncio.sleep(0.01)
    assert snapshot(server).engines == ()


async def test_a_change_of_the_engines_step_costs_is_counted_and_logged(
        server: RunningServer, channel: grpc.aio.Channel, caplog: pytest.LogCaptureFixture
        ) -> None:
    engine = EngineClient(channel)
    await engine.connect()

    def timed(sequence: int, seconds_per_step: float) -> engine_pb2.EngineReport:
        msg = report(sequence)  # 400 steps of batch 4 at K=2
        msg.step_timings.append(engine_pb2.StepTiming(
            batch_bucket=2, draft=DRAFT, k=2, steps=400, sum_batch_size=1600,
            sum_verified_tokens=4800, sum_draft_tokens=3200,
            sum_step_seconds=400 * seconds_per_step))
        return msg

    for seq in range(1, 16):  # 6,000 steps at 25 ms: the model knows this shape
        assert (await engine.send(timed(seq, 0.025))).accepted
    assert _metric(server, "specpilot_cost_model_changes_detected_total") == 0  # the control
    for seq in range(16, 19):  # the same steps ten times as dear: another tenant on the host
        assert (await engine.send(timed(seq, 0.25))).accepted
    assert _metric(server, "specpilot_cost_model_changes_detected_total") == 1
    assert "step times left the cost model's predictions" in caplog.text
    assert server.core.predicted_seconds(StepShape(4, 12, DRAFT, 2, 8)) > 0.1
    await engine.close()


async def test_report_before_hello_fails_the_stream(
    server: RunningServer, channel: grpc.aio.Channel
) -> None:
    engine = EngineClient(channel)
    await engine.call.write(engine_pb2.ConnectRequest(report=report(1)))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await engine.read()
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "hello" in (err.value.details() or "")
    assert _metric(server, "specpilot_reports_rejected_total", reason="before_hello") == 1
    assert snapshot(server).engines == ()


def _summary_accepted_above_drafted() -> engine_pb2.EngineReport:
    return report(2, acceptance(), finished=[engine_pb2.RequestSummary(
        traffic_class="chat", draft=DRAFT, prompt_tokens=10, output_tokens=20,
        drafted_tokens=5, accepted_tokens=9, latency_seconds=0.5)])


def _oversized() -> engine_pb2.EngineReport:
    summary = engine_pb2.RequestSummary(traffic_class="chat", draft=DRAFT, prompt_tokens=100,
                                        output_tokens=100, drafted_tokens=40, accepted_tokens=30,
                                        latency_seconds=1.0)
    msg = report(2, acceptance(), finished=[summary] * 400)
    assert msg.ByteSize() > FAST_SETTINGS["max_report_bytes"]
    return msg


# Each bad report also carries a good record: if any of it were applied, the state would move.
BAD_REPORTS: dict[str, tuple[Callable[[], engine_pb2.EngineReport], str, str]] = {
    "accepted_above_drafted": (_summary_accepted_above_drafted, "validation",
                               "finished[0].accepted_tokens"),
    "negative_count": (lambda: report(2, acceptance(), acceptance(steps_by_accepted=(5, -1, 3))),
                       "validation", "acceptance[1].steps_by_accepted[1]"),
    "k_above_engine_max": (lambda: report(2, acceptance(),
                                          acceptance(steps_by_accepted=(1, 1, 1, 1, 1, 1))),
                           "validation", "acceptance[1].k"),
    "unknown_draft": (lambda: report(2, acceptance(), acceptance(draft="no-such-draft")),
                      "validation", "acceptance[1].draft"),
    "refused_draft": (lambda: report(2, acceptance(), acceptance(draft="draft-other-tokenizer")),
                      "validation", "acceptance[1].draft"),
    "oversized": (_oversized, "oversized", "max_report_bytes"),
    # A rogue's step of 1e308 s once turned the cost model to NaN for good.
    "step_of_1e308_seconds": (lambda: _timed(2, 1e308), "implausible",
                              "step_timings[0].sum_step_seconds"),
    "sequence_2_pow_64_minus_1": (lambda: report(2**64 - 1), "implausible", "sequence"),
}


def _timed(seq: int, sum_step_seconds: float) -> engine_pb2.EngineReport:
    msg = report(seq)
    msg.step_timings.append(engine_pb2.StepTiming(
        batch_bucket=0, draft=DRAFT, k=2, steps=10, sum_batch_size=10, sum_verified_tokens=30,
        sum_draft_tokens=20, sum_step_seconds=sum_step_seconds))
    return msg


@pytest.mark.parametrize("kind", list(BAD_REPORTS))
async def test_bad_report_is_rejected_and_changes_nothing(
    kind: str, server: RunningServer, channel: grpc.aio.Channel
) -> None:
    build, category, field = BAD_REPORTS[kind]
    engine = EngineClient(channel)
    await engine.connect()
    assert (await engine.send(report(1))).accepted
    at = time.time() + 60.0
    before = _snapshot(server, at)
    rejected_before = _metric(server, "specpilot_reports_rejected_total", reason=category)

    result = await engine.send(build())
    assert not result.accepted
    assert result.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] == 3
    assert field in result.reason
    assert _metric(server, "specpilot_reports_rejected_total",
                   reason=category) == rejected_before + 1
    assert _snapshot(server, at) == before

    # The stream is still up and the next good report is applied.
    after = await engine.send(report(2))
    assert after.accepted
    assert _snapshot(server, at)[0] != before[0]  # so the equality above could have failed
    await engine.close()


async def test_classes_beyond_the_limit_fold_into_other(
    server: RunningServer, channel: grpc.aio.Channel
) -> None:
    engine = EngineClient(channel)
    await engine.connect()
    # max_classes=4 counts "default": three new names fit, the next two fold.
    names = ["c1", "c2", "c3", "c4", "c5"]
    result = await engine.send(report(1, *(acceptance(n) for n in names)))
    assert result.accepted
    assert list(result.folded_classes) == ["c4", "c5"]
    tracked = {c.name for c in snapshot(server).classes}
    assert {"c1", "c2", "c3", "other"} <= tracked
    assert "c4" not in tracked and "c5" not in tracked
    # Both folded histograms (10, 20, 70) landed on "other": 2 x 100 tries at position 1.
    post = server.core.estimate("other", DRAFT, time.time())
    assert post.effective_tries[0] == pytest.approx(200, rel=1e-3)
    assert _metric(server, "specpilot_report_classes_folded_total") == 2
    await engine.close()


async def test_a_rogue_engine_cannot_keep_the_real_engines_classes_out() -> None:
    """The issue's case: a second stream filling 21 junk classes took every slot, the real
    engine's next class folded into "other", and the slots stayed taken after it left."""
    from specpilot.controller.server.app import start_server
    from specpilot.controller.settings import load_settings

    server = await start_server(load_settings(**{**FAST_SETTINGS, "max_classes": 16,
                                                 "class_idle_seconds": 0.5}))
    try:
        async with grpc.aio.insecure_channel(server.grpc_target) as ch:
            real, rogue = EngineClient(ch), EngineClient(ch)
            await real.connect(hello("real"))
            assert (await real.send(report(1, acceptance("chat")))).accepted
            await rogue.connect(hello("rogue"))
            junk = [acceptance(f"junk-{i}") for i in range(21)]
            folded = (await rogue.send(report(1, *junk))).folded_classes
            assert len(folded) == 14  # it holds its share, 7 of the 14 slots
            # While it is connected the real engine still brings new classes...
            assert not (await real.send(report(2, acceptance("code")))).folded_classes
            await rogue.close()
            # ...and after it left, its classes free their slots: at once for a new class
            # when the table is full, and by age (class_idle_seconds) otherwise.
            for seq in range(3, 30):
                assert (await real.send(report(seq, acceptance("chat"),
                                               acceptance("code")))).accepted
                if not {c.name for c in snapshot(server).classes} & {f"junk-{i}"
                                                                    for i in range(21)}:
                    break
                await asyncio.sleep(0.1)
            assert {c.name for c in snapshot(server).classes} == {"default", "chat", "code",
                                                                  "other"}
            await real.close()
    finally:
        await server.stop(grace_seconds=0.1)


async def test_a_second_hello_on_a_stream_is_rejected_and_the_stream_stays(
    channel: grpc.aio.Channel,
) -> None:
    engine = EngineClient(channel)
    await engine.connect()
    await engine.call.write(engine_pb2.ConnectRequest(hello=hello()))
    while not (resp := await engine.read()).HasField("report_result"):
        pass
    assert not resp.report_result.accepted
    assert "second hello" in resp.report_result.reason
    assert (await engine.send(report(1))).accepted
    await engine.close()


async def test_an_override_reaches_every_engine_within_one_report_interval(
    server: RunningServer, channel: grpc.aio.Channel
) -> None:
    engines = [EngineClient(channel) for _ in range(3)]
    for i, engine in enumerate(engines):
        await engine.connect(hello(engine_id=f"engine-{i}"))
    policy = async_policy_stub(channel)
    started = time.monotonic()
    await policy.SetOverride(
        policy_pb2.SetOverrideRequest(override=policy_pb2.Override(traffic_class="default",
                                                                   pin_k=1)),
        metadata=(("authorization", f"Bearer {TOKEN}"),))
    latencies = []
    for engine in engines:
        while True:
            update = await engine.next_policy()
            default = [d for d in update.decisions if d.traffic_class == "default"]
            if default and all(d.k == 1 for d in default):
                break
        latencies.append(time.monotonic() - started)
    # The push is immediate; the bound that matters is one report interval (0.05 s here), with
    # slack for a loaded CI machine.
    assert max(latencies) < 1.0
    for engine in engines:
        await engine.close()


async def test_periodic_decisions_reach_engines_without_reports(
    server: RunningServer, channel: grpc.aio.Channel
) -> None:
    """A change made outside any RPC (here: straight on the core, as a policy timer would) is
    pushed by the periodic decide task within about one report interval."""
    engine = EngineClient(channel)
    await engine.connect()
    version = engine.policies[-1].version
    server.core.set_override(Override("default", force_off=True))
    update = await engine.next_policy()
    assert update.version > version
    assert all(d.k == 0 for d in update.decisions if d.traffic_class == "default")
    await engine.close()


# --- HTTP --------------------------------------------------------------------------------------
async def _get(server: RunningServer, path: str) -> tuple[int, str, Any]:
    async with aiohttp.ClientSession() as http, http.get(server.http_url + path) as resp:
        text = await resp.text()
        body = await resp.json() if resp.content_type == "application/json" else None
        return resp.status, text, body


async def test_http_endpoints(server: RunningServer, channel: grpc.aio.Channel) -> None:
    engine = EngineClient(channel)
    await engine.connect()
    assert (await engine.send(report(1))).accepted

    status, _, body = await _get(server, "/healthz")
    assert status == 200
    assert body == {"status": "ok", "engines_connected": 1, "policy_version": server.core.version}

    status, _, body = await _get(server, "/api/policy")
    assert status == 200
    assert body["engines"] == ["engine-1"]
    assert body["batch_bucket_upper_bounds"] == list(server.core.config.batch_bucket_upper_bounds)
    chat = next(c for c in body["classes"] if c["traffic_class"] == "chat")
    estimate = next(e for e in chat["estimates"] if e["draft"] == DRAFT)
    # Histogram (10, 20, 70): position 1 tried 100 times, accepted 90; prior Beta(1, 1).
    p1 = estimate["positions"][0]
    assert p1["mean"] == pytest.approx(91 / 102, rel=1e-3)
    assert p1["lower"] < p1["mean"] < p1["upper"]
    assert len(chat["decisions"]) == server.core.config.n_buckets

    status, _, body = await _get(server, "/api/policy?class=nope")
    assert status == 404 and "nope" in body["error"]

    status, _, body = await _get(server, "/api/decisions?class=chat&limit=2")
    assert status == 200
    events = body["events"]
    assert 0 < len(events) <= 2
    assert all(e["decision"]["traffic_class"] == "chat" for e in events)

    status, text, _ = await _get(server, "/metrics")
    assert status == 200
    assert 'specpilot_engines_connected 1.0' in text
    # The engine's report said it ran policy version 0 (its static configuration): behind by
    # every version of this epoch, the epoch's start included.
    behind = re.search(r"^specpilot_engine_policy_versions_behind (\S+)$", text, re.M)
    versions = server.core.version - (server.core.epoch << 16) + 1
    assert behind is not None and float(behind.group(1)) == versions > 1
    assert re.search(r"^specpilot_engine_report_age_seconds \d", text, re.M)
    # Per-class series carry the model as vLLM labels its own (model_name, the engine's hello),
    # and batch ranges by their sizes (labels print sorted); no _created series.
    model = 'model_name="tiny-target"'
    assert (f'specpilot_acceptance_first_position_ratio{{class="chat",draft="{DRAFT}",{model}}}'
            in text)
    assert f'specpilot_decision_speculative_tokens{{batch="1",class="chat",{model}}}' in text
    assert f'specpilot_decision_speculative_tokens{{batch="129+",class="chat",{model}}}' in text
    # The class's served speculative steps give a measured speedup beside the expected one.
    assert re.search(rf'^specpilot_class_measured_speedup_ratio{{class="chat",{model}}} '
                     r'[0-9.]+$', text, re.M)
    assert "_created" not in text
    await engine.close()


def _promtool() -> str | None:
    local = ROOT / ".tools" / "bin" / "promtool"
    return str(local) if local.exists() else shutil.which("promtool")


async def test_promtool_finds_nothing_to_complain_about_in_a_scrape(
    server: RunningServer, channel: grpc.aio.Channel
) -> None:
    promtool = _promtool()
    if promtool is None:
        msg = "promtool not found: install Debian package 'prometheus' (tools/install-tools.sh)"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"{msg}; CI=true, so a missing tool is a failure, not a skip")
        pytest.skip(msg)
    engine = EngineClient(channel)
    await engine.connect()
    # Put a series behind every metric: accepted, rejected and folded reports, decisions.
    assert (await engine.send(report(1, *(acceptance(n) for n in ("a", "b", "c", "d"))))).accepted
    assert not (await engine.send(report(2, acceptance(draft="nope")))).accepted
    _, text, _ = await _get(server, "/metrics")
    assert "specpilot_acceptance_per_token_ratio{" in text
    proc = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True,
                          text=True, timeout=30)
    assert proc.returncode == 0 and not proc.stdout.strip() and not proc.stderr.strip(), (
        proc.stdout + proc.stderr)
    await engine.close()


async def test_expected_speedup_and_k_metrics_follow_the_decisions(
    server: RunningServer, channel: grpc.aio.Channel
) -> None:
    engine = EngineClient(channel)
    await engine.connect()
    assert (await engine.send(report(1))).accepted
    model = {"model_name": "tiny-target"}

    def decisions_exported() -> None:
        snap = snapshot(server)
        chat = snap.class_view("chat")
        for d in chat.decisions:
            labels = {**model, "class": "chat",
                      "batch": batch_range(snap.batch_bucket_upper_bounds, d.bucket)}
            assert _metric(server, "specpilot_decision_speculative_tokens", **labels) == d.k
            assert _metric(server, "specpilot_decision_expected_speedup_ratio",
                           **labels) == d.expected_speedup
        on = any(d.k for d in chat.decisions)
        assert _metric(server, "specpilot_speculation_enabled",
                       **{**model, "class": "chat"}) == float(on)
        decisions = sum(_metric(server, "specpilot_decisions_total", reason=r.value)
                        for r in Reason)
        assert decisions == len(snapshot(server).log)
        assert np.isclose(_metric(server, "specpilot_policy_version"), server.core.version)

    # The periodic decide round may land between reading the core and reading the metrics:
    # the metrics follow the decisions once it has been published.
    for _ in range(40):
        try:
            decisions_exported()
            break
        except AssertionError:
            await asyncio.sleep(0.05)
    else:
        decisions_exported()
    post = server.core.estimate("chat", DRAFT, time.time())
    assert _metric(server, "specpilot_acceptance_first_position_ratio",
                   **{**model, "class": "chat", "draft": DRAFT}) == pytest.approx(post.mean[0],
                                                                                 rel=1e-6)
    # Pooled over positions: (90 + 70 accepted + 1) / (100 + 90 tries + 2), the counts decayed
    # on the half-life for the milliseconds between the report and the scrape (on a slow host
    # they move it by 1e-6; position 1's ratio alone would be 0.9).
    assert _metric(server, "specpilot_acceptance_per_token_ratio",
                   **{**model, "class": "chat", "draft": DRAFT}) == pytest.approx(161 / 192,
                                                                                 rel=1e-4)
    await engine.close()


async def test_a_silent_engine_is_dropped_after_the_timeout_and_a_reporting_one_stays() -> None:
    from specpilot.controller.server.app import start_server
    from specpilot.controller.settings import load_settings

    server = await start_server(load_settings(**{**FAST_SETTINGS,
                                                 "engine_silence_timeout_seconds": 0.4}))
    try:
        async with grpc.aio.insecure_channel(server.grpc_target) as ch:
            silent, live = EngineClient(ch), EngineClient(ch)
            await silent.connect(hello("silent"))
            await live.connect(hello("live"))
            assert (await silent.send(report(1))).accepted
            started = time.monotonic()
            for seq in range(2, 12):  # a report every ~0.1 s for ~1 s: kept
                assert (await live.send(report(seq))).accepted
                await asyncio.sleep(0.1)
            with pytest.raises(grpc.aio.AioRpcError) as failure:
                while True:  # what the silent engine's stream still had, then its end
                    await asyncio.wait_for(silent.call.read(), 5.0)
            ended = failure.value
            assert ended is not None and ended.code() == grpc.StatusCode.UNAVAILABLE
            assert "no report for" in (ended.details() or "")
            assert time.monotonic() - started < 5.0
            assert [e.engine_id for e in snapshot(server).engines] == ["live"]
            await live.close()
    finally:
        await server.stop(grace_seconds=0.1)


async def test_a_reconnect_of_the_same_engine_replaces_its_old_stream_quietly(
        caplog: pytest.LogCaptureFixture) -> None:
    secret = "engine-secret-0123456789abcdef-0123456789"
    own = (("authorization", f"Bearer {engine_token(secret, 'engine-1')}"),)
    server = await start_server(load_settings(**FAST_SETTINGS, engine_secret=secret))
    try:
        async with grpc.aio.insecure_channel(server.grpc_target) as ch:
            old, new = EngineClient(ch, own), EngineClient(ch, own)
            await old.connect(hello("engine-1"))
            await new.connect(hello("engine-1"))  # with its own token: replaces the old
            with pytest.raises(grpc.aio.AioRpcError) as failure:
                while True:
                    await asyncio.wait_for(old.call.read(), 5.0)
            assert failure.value.code() == grpc.StatusCode.ABORTED
            assert (await new.send(report(1))).accepted
            await new.close()
        await asyncio.sleep(0.1)
    finally:
        await server.stop(grace_seconds=0.1)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
