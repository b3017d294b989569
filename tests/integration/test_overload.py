"""Overload: reports beyond the loop's report budget are shed with RESOURCE_EXHAUSTED, counted,
and every report is still answered; heartbeats are never shed; health and the policy API keep
answering within their budget while engines flood the controller."""

from __future__ import annotations

import asyncio
import gc
import statistics
import time
from typing import cast

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from benchmarks.scale import busy_stream, hello_request
from specpilot.contract import engine_stream
from specpilot.controller.server.app import RunningServer, start_server
from specpilot.controller.server.stubs import async_policy_stub, engine_stub
from specpilot.controller.settings import ServerConfig, load_settings
from specpilot.v1 import engine_pb2, policy_pb2
from tests.integration.conftest import FAST_SETTINGS

pytestmark = pytest.mark.integration

ENGINES = 16
REPORTS_PER_ENGINE = 60
SHED = engine_stream.REPORT_SHED_CODE


async def _flood(target: str, engine_id: str, results: list[engine_pb2.ReportResult],
                 heartbeats: list[engine_pb2.ReportResult]) -> None:
    """One engine sending busy reports back to back (no wait for results), a heartbeat among
    them every tenth report."""
    _, report, outbox, requests = busy_stream(engine_id)
    async with grpc.aio.insecure_channel(target) as channel:
        call = engine_stub(channel).Connect(requests)
        await outbox.put(hello_request(engine_id))
        while not cast(engine_pb2.ConnectResponse, await call.read()).HasField("policy"):
            pass
        beats = set()
        for seq in range(1, REPORTS_PER_ENGINE + 1):
            if seq % 10 == 0:
                beats.add(seq)
                msg = engine_pb2.EngineReport(sequence=seq, interval_seconds=0.0)
            else:
                report.sequence = seq
                msg = engine_pb2.EngineReport()
                msg.CopyFrom(report)
            await outbox.put(engine_pb2.ConnectRequest(report=msg))
        answered = 0
        while answered < REPORTS_PER_ENGINE:
            resp = await asyncio.wait_for(call.read(), 60.0)
            assert isinstance(resp, engine_pb2.ConnectResponse)
            if resp.HasField("report_result"):
                answered += 1
                r = resp.report_result
                (heartbeats if r.sequence in beats else results).append(r)
        await outbox.put(None)
        call.cancel()


async def _probe(server: RunningServer, until: asyncio.Event, health: list[float],
                 policy: list[float]) -> None:
    async with grpc.aio.insecure_channel(server.grpc_target) as channel:
        check = health_pb2_grpc.HealthStub(channel).Check
        get = async_policy_stub(channel).GetPolicy
        while not until.is_set():
            t0 = time.perf_counter()
            reply = await check(health_pb2.HealthCheckRequest(service=""), timeout=10)
            health.append(time.perf_counter() - t0)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            t0 = time.perf_counter()
            await get(policy_pb2.GetPolicyRequest(), timeout=10)
            policy.append(time.perf_counter() - t0)
            await asyncio.sleep(0.02)


async def _flooded(share: float) -> tuple[RunningServer, list[engine_pb2.ReportResult],
                                          list[engine_pb2.ReportResult], list[float],
                                          list[float]]:
    server = await start_server(load_settings(**{
        **FAST_SETTINGS, "max_report_bytes": 1 << 20, "max_classes": 16,
        "report_budget_share": share}))
    results: list[engine_pb2.ReportResult] = []
    heartbeats: list[engine_pb2.ReportResult] = []
    health: list[float] = []
    policy: list[float] = []
    done = asyncio.Event()
    # The latencies are the server loop's, not this test process's garbage collector: after the
    # engine tests the process holds millions of objects, and a full collection among them can
    # pause the loop for seconds (one probe waited 2 s on a busy CI host; a sidecar's own
    # process holds none of them).
    gc.collect()
    gc.disable()
    prober = asyncio.create_task(_probe(server, done, health, policy))
    await asyncio.sleep(0.1)
    try:
        await asyncio.gather(*(_flood(server.grpc_target, f"engine-{i}", results, heartbeats)
                               for i in range(ENGINES)))
    finally:
        done.set()
        await prober
        gc.enable()
    return server, results, heartbeats, health, policy


async def test_reports_beyond_the_budget_are_shed_and_health_stays_prompt() -> None:
    server, results, heartbeats, health, policy = await _flooded(0.25)
    try:
        shed = [r for r in results if r.code == SHED]
        taken = [r for r in results if r.accepted]
        # Every report answered: taken or shed (none rejected: they are valid).
        assert len(taken) + len(shed) == len(results) == ENGINES * REPORTS_PER_ENGINE * 9 // 10
        assert shed and taken
        assert all(not r.accepted and "overloaded" in r.reason and "again" in r.reason
                   for r in shed)
        # Each carries its pause, never past a quarter of the silence timeout.
        cap = ServerConfig().engine_silence_timeout_seconds / 4.0
        assert all(0 < r.retry_after_seconds <= cap for r in shed)
        assert all(h.retry_after_seconds == 0 for h in taken)
        assert all(h.accepted for h in heartbeats)  # never shed
        value = server.metrics.registry.get_sample_value("specpilot_reports_shed_total")
        assert value == len(shed)
        p99 = float(np.quantile(health, 0.99))
        print(f"\nflood of {len(results)} busy reports from {ENGINES} engines: "
              f"{len(shed)} shed; health p50 {1e3 * statistics.median(health):.1f} ms, "
              f"p99 {1e3 * p99:.1f} ms; GetPolicy p50 {1e3 * statistics.median(policy):.1f} ms "
              f"over {len(health)} probes")
        assert len(health) >= 5
        assert p99 < 0.5
        assert float(np.quantile(policy, 0.99)) < 1.0
    finally:
        await server.stop(grace_seconds=0.1)


async def test_with_the_whole_loop_for_reports_nothing_is_shed_below_saturation() -> None:
    """The control: share 1 takes every report (and health waits behind the backlog)."""
    server, results, heartbeats, health, _ = await _flooded(1.0)
    try:
        assert all(r.accepted for r in results + heartbeats)
        print(f"\nshare 1: health p99 {1e3 * float(np.quantile(health, 0.99)):.1f} ms "
              f"over {len(health)} probes")
    finally:
        await server.stop(grace_seconds=0.1)
