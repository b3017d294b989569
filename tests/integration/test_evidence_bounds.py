"""Through the real gRPC server: a report beyond what its engine can verify in its interval is
refused with its reason and counted, the engine serving on; the names short-lived engines
bring age out of /metrics and the dashboard once ``name_grace_seconds`` passed."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import grpc
import pytest

from specpilot.controller.server.app import RunningServer, start_server
from specpilot.controller.settings import load_settings
from specpilot.v1 import common_pb2, engine_pb2
from tests.integration.conftest import FAST_SETTINGS
from tests.integration.engine_client import EngineClient, acceptance, hello, report

pytestmark = pytest.mark.integration
GRACE = 1.0


def _series(text: str) -> int:
    return sum(1 for line in text.splitlines() if line and not line.startswith("#"))


async def _get(server: RunningServer, path: str) -> str:
    async with aiohttp.ClientSession() as http, http.get(server.http_url + path) as resp:
        assert resp.status == 200
        return await resp.text()


async def test_a_report_beyond_its_interval_is_refused_with_its_reason_and_counted(
        server: RunningServer, channel: grpc.aio.Channel) -> None:
    engine = EngineClient(channel)
    await engine.connect()
    assert (await engine.send(report(1))).accepted
    result = await engine.send(report(2, acceptance(steps_by_accepted=(10**12, 0, 0, 0, 0))))
    assert not result.accepted
    assert result.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "verification steps" in result.reason and "interval_seconds" in result.reason
    rejected = server.metrics.registry.get_sample_value(
        "specpilot_reports_rejected_total", {"reason": "beyond_rate"})
    assert rejected == 1.0
    # Nothing of it applied; the engine serves on.
    assert server.core.estimate("chat", "draft-tiny", time.time()).posterior.mean[0] > 0.3
    assert (await engine.send(report(2))).accepted
    await engine.close()


async def test_churning_engines_leave_the_series_count_where_it_was() -> None:
    server = await start_server(load_settings(**FAST_SETTINGS, name_grace_seconds=GRACE,
                                          max_absent_drafts=1000))
    try:
        async with grpc.aio.insecure_channel(server.grpc_target) as channel:
            steady = EngineClient(channel)
            await steady.connect()
            assert (await steady.send(report(1))).accepted
            await asyncio.sleep(GRACE * 1.5)
            base_metrics = _series(await _get(server, "/metrics"))
            base_dashboard = len(await _get(server, "/api/dashboard"))
            for i in range(20):
                names = [f"ngram-{i}-{j}" for j in range(13)]  # beside hello()'s 3: MAX_DRAFTS
                msg = hello(f"brief-{i}")
                msg.drafts.extend(engine_pb2.DraftInfo(
                    name=n, kind=common_pb2.DRAFT_KIND_NGRAM, max_k=4) for n in names)
                brief = EngineClient(channel)
                await brief.connect(msg)
                result = await brief.send(report(1, *(acceptance(draft=n) for n in names)))
                assert result.accepted, result.reason
                await brief.close()
            grown = _series(await _get(server, "/metrics"))
            assert grown >= base_metrics + 20 * 13
            deadline = time.monotonic() + 10 * GRACE + 5
            while (now := _series(await _get(server, "/metrics"))) != base_metrics:
                assert time.monotonic() < deadline, (base_metrics, grown, now)
                await asyncio.sleep(0.1)
            assert len(await _get(server, "/api/dashboard")) <= base_dashboard * 1.1
            snap = server.core.snapshot(time.time())
            assert not [e for c in snap.classes for e in c.estimates
                        if e.draft.startswith("ngram-")]
            await steady.close()
    finally:
        await server.stop(grace_seconds=0.1)
