"""A real controller on loopback for each test: free ports, fast report interval, known token;
and a real redis-server for the tests that share state through one."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from benchmarks.redis_servers import RedisServer
from specpilot.controller.core.snapshot import CoreSnapshot
from specpilot.controller.server.app import RunningServer, start_server
from specpilot.controller.settings import load_settings

TOKEN = "test-token-0123456789"
# Small limits so tests reach them cheaply: the class limit counts "default", and 4 KiB of report
# is a few hundred records.
FAST_SETTINGS: dict[str, Any] = {
    "grpc_port": 0, "http_port": 0, "report_interval_seconds": 0.05, "policy_token": TOKEN,
    "seed": 1, "max_classes": 4, "max_report_bytes": 4096,
}


def snapshot(server: RunningServer) -> CoreSnapshot:
    """The server's core as of now (call it on the server's loop, as the tests here do)."""
    return server.core.snapshot(time.time())


@pytest.fixture
async def server() -> AsyncIterator[RunningServer]:
    running = await start_server(load_settings(**FAST_SETTINGS))
    try:
        yield running
    finally:
        await running.stop(grace_seconds=0.1)


@pytest.fixture
async def channel(server: RunningServer) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(server.grpc_target) as ch:
        yield ch


@pytest.fixture
def redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A real redis-server on a free loopback port, for one test (SIGKILLed after it)."""
    server = RedisServer(tmp_path)
    server.start()
    yield server
    server.stop()
