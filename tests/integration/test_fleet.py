"""Two real controllers sharing a real redis-server: evidence learnt through one is used by the
other without double counting; a controller killed and restarted resumes from its last flush;
an outage of Redis costs nothing but sharing."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from controller.server.app import RunningServer, start_server
from controller.settings import load_settings
from tests.integration.conftest import FAST_SETTINGS
from tests.integration.engine_client import DRAFT, EngineClient, acceptance, hello, report
from tests.redis_servers import RedisServer

FLUSH = 0.1
pytestmark = pytest.mark.integration


@pytest.fixture
def redis(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path)
    server.start()
    yield server
    server.stop()


async def _controller(redis: RedisServer, sidecar: str, **extra: Any) -> RunningServer:
    return await start_server(load_settings(**{
        **FAST_SETTINGS, "state_store": redis.url, "sidecar_id": sidecar,
        "fleet_model": "tiny-target", "fleet_flush_interval_seconds": FLUSH, **extra}))


@pytest.fixture
async def pair(redis: RedisServer) -> AsyncIterator[tuple[RunningServer, RunningServer]]:
    a = await _controller(redis, "sidecar-a")
    b = await _controller(redis, "sidecar-b")
    try:
        yield a, b
    finally:
        await a.stop(grace_seconds=0.1)
        await b.stop(grace_seconds=0.1)


async def _feed(server: RunningServer, engine_id: str, histogram: tuple[int, ...],
                reports: int) -> None:
    async with grpc.aio.insecure_channel(server.grpc_target) as ch:
        client = EngineClient(ch)
        await client.connect(hello(engine_id))
        for seq in range(1, reports + 1):
            await client.send(report(seq, acceptance("chat", histogram)))
        await client.close()


def _own_and_total(server: RunningServer) -> tuple[np.ndarray, np.ndarray]:
    """Position-1 accepts: this controller's own evidence and its posterior's (own + fleet),
    both as of now."""
    now = time.time()
    own = dict(((e.traffic_class, e.draft), e) for e in server.core.export_evidence(now))
    est = server.core.estimate("chat", DRAFT, now)
    mine = np.array(own[("chat", DRAFT)].accepts) if ("chat", DRAFT) in own else np.zeros(1)
    return mine, np.array(est.alpha) - est.prior_alpha


async def _until(predicate: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.05)


async def test_evidence_learnt_through_one_controller_is_used_by_the_other(
        pair: tuple[RunningServer, RunningServer]) -> None:
    a, b = pair
    await _feed(a, "engine-a", (10, 20, 70), reports=5)  # 100 steps, 90 accepted at position 1
    await _feed(b, "engine-b", (50, 30, 20), reports=2)  # 100 steps, 50 accepted
    # B's posterior = B's own + A's, and A's = A's own + B's: the merged counts are the sum of
    # the two sidecars' own (decay within a second is below the tolerance), never more.
    def merged() -> bool:
        a_own, a_all = _own_and_total(a)
        b_own, b_all = _own_and_total(b)
        total = a_own[0] + b_own[0]
        return bool(abs(a_all[0] - total) < 0.01 * total and abs(b_all[0] - total) < 0.01 * total)
    await _until(merged)
    a_own, _ = _own_and_total(a)
    assert a_own[0] == pytest.approx(450, rel=0.01)  # its own stays its own
    await asyncio.sleep(5 * FLUSH)  # more rounds re-read the same exports: still no double count
    assert merged()


async def test_a_killed_controller_resumes_from_its_last_flush(redis: RedisServer) -> None:
    a = await _controller(redis, "sidecar-a")
    try:
        await _feed(a, "engine-a", (10, 20, 70), reports=5)
        await asyncio.sleep(3 * FLUSH)  # flushed
        before, _ = _own_and_total(a)
    finally:
        await a.stop(grace_seconds=0.0)  # no final flush: what a SIGKILL leaves behind
    restarted = await _controller(redis, "sidecar-a")
    try:
        await _until(lambda: _own_and_total(restarted)[0][0] > 0)
        after, total = _own_and_total(restarted)
        assert after[0] == pytest.approx(before[0], rel=0.02)
        assert total[0] == pytest.approx(after[0], rel=0.02)  # not counted again as a peer's
    finally:
        await restarted.stop(grace_seconds=0.1)


async def test_a_redis_outage_keeps_the_controller_deciding_and_it_resyncs(
        pair: tuple[RunningServer, RunningServer], redis: RedisServer) -> None:
    a, b = pair
    redis.stop()
    await _feed(a, "engine-a", (10, 20, 70), reports=5)  # reports are accepted meanwhile
    assert _own_and_total(a)[0][0] == pytest.approx(450, rel=0.01)
    await _until(lambda: b"specpilot_state_store_up 0.0" in a.metrics.render())
    redis.start()  # back, empty: the next rounds publish again and B learns A's evidence
    await _until(lambda: _own_and_total(b)[1][0] > 400, timeout=15.0)
    assert b"specpilot_state_store_up 1.0" in a.metrics.render()
