"""The HTTP listener against hostile and careless clients: a real controller on loopback, raw
sockets and real HTTP clients. Each test names what the controller did before (the control)."""

from __future__ import annotations

import asyncio
import inspect
import logging
import socket
import time
from collections.abc import AsyncIterator
from typing import Any, get_args

import aiohttp
import grpc
import pytest
from aiohttp import http_exceptions
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specpilot.controller.metrics import HttpClientError
from specpilot.controller.server.app import RunningServer, start_server
from specpilot.controller.server.http_guard import SECURITY_HEADERS, client_error_kind, host_allowed
from specpilot.controller.settings import load_settings
from tests.integration.conftest import FAST_SETTINGS, TOKEN
from tests.integration.engine_client import EngineClient, acceptance, hello, report

AUTH = {"Authorization": f"Bearer {TOKEN}"}


async def _serve(**extra: Any) -> RunningServer:
    return await start_server(load_settings(**{**FAST_SETTINGS, **extra}))


@pytest.fixture
async def make_server() -> AsyncIterator[Any]:
    running: list[RunningServer] = []

    async def make(**extra: Any) -> RunningServer:
        running.append(await _serve(**extra))
        return running[-1]

    yield make
    for server in running:
        await server.stop(grace_seconds=0.1)


async def _raw(server: RunningServer, request: bytes) -> tuple[asyncio.StreamReader,
                                                                asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", server.http_port)
    writer.write(request)
    await writer.drain()
    return reader, writer


def _get(path: str, host: str = "127.0.0.1", extra: str = "") -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: {host}\r\n{extra}\r\n".encode()


async def _head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    raw = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    lines = raw.decode().split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:] if ": " in line)
    return int(lines[0].split()[1]), headers


async def _status(server: RunningServer, path: str, host: str = "127.0.0.1",
                  extra: str = "") -> tuple[int, dict[str, str]]:
    reader, writer = await _raw(server, _get(path, host, extra))
    try:
        return await _head(reader)
    finally:
        writer.close()


def _metric(server: RunningServer, name: str) -> float:
    for line in server.metrics.render().decode().splitlines():
        series, _, value = line.rpartition(" ")
        if series == name:
            return float(value)
    raise AssertionError(f"{name} not exported")


async def _engine(server: RunningServer, channel: grpc.aio.Channel,
                  engine_id: str = "engine-1") -> EngineClient:
    engine = EngineClient(channel)
    await engine.connect(hello(engine_id))
    await engine.send(report(1, acceptance("chat"), acceptance("docs", (5, 5, 90))))
    return engine


async def _churn(server: RunningServer, writes: int) -> None:
    """Decision churn: overrides set and cleared on two classes (each a round of events)."""
    async with aiohttp.ClientSession() as http:
        for i in range(writes):
            cls = ("chat", "docs")[i % 2]
            body: dict[str, Any] = {"override": {"traffic_class": cls, "pin_k": 1 + i % 3}}
            async with http.post(server.http_url + "/api/overrides", json=body,
                                 headers=AUTH) as r:
                assert r.status == 200, await r.text()
            async with http.post(server.http_url + "/api/overrides/clear",
                                 json={"traffic_class": cls}, headers=AUTH) as r:
                assert r.status == 200


async def _probe_latencies(server: RunningServer, stop: asyncio.Event) -> list[float]:
    """/healthz and gRPC health round trips, seconds, until ``stop``."""
    out: list[float] = []
    async with aiohttp.ClientSession() as http, \
            grpc.aio.insecure_channel(server.grpc_target) as ch:
        health = health_pb2_grpc.HealthStub(ch)
        while not stop.is_set():
            start = time.perf_counter()
            async with http.get(server.http_url + "/healthz") as r:
                assert r.status == 200
            out.append(time.perf_counter() - start)
            start = time.perf_counter()
            await health.Check(health_pb2.HealthCheckRequest(), timeout=10)
            out.append(time.perf_counter() - start)
            await asyncio.sleep(0.02)
    return out


async def _reader(server: RunningServer, path: str = "/api/events") -> tuple[
        asyncio.Task[int], asyncio.StreamWriter]:
    """An event stream read (and thrown away) as fast as it comes: bytes read, when it ends."""
    reader, writer = await _raw(server, _get(path))

    async def read() -> int:
        total = 0
        while chunk := await reader.read(1 << 16):
            total += len(chunk)
        return total

    return asyncio.create_task(read()), writer


# --- event streams ---------------------------------------------------------------------------
async def test_many_event_streams_and_churn_leave_health_probes_fast(make_server: Any) -> None:
    """Control: every stream rendered every decision's text itself, so 300 streams and a few
    overrides kept the loop busy for seconds (probes took over a second)."""
    server = await make_server(max_event_streams=300, event_streams_per_client=300)
    async with grpc.aio.insecure_channel(server.grpc_target) as channel:
        await _engine(server, channel)
        streams = [await _reader(server) for _ in range(300)]
        await asyncio.sleep(0.2)
        stop = asyncio.Event()
        probes = asyncio.create_task(_probe_latencies(server, stop))
        await _churn(server, 12)
        await asyncio.sleep(0.3)
        stop.set()
        latencies = await probes
        for task, writer in streams:
            writer.close()
            task.cancel()
    assert len(latencies) >= 4
    assert max(latencies) < 0.4, sorted(latencies)[-5:]


async def test_event_streams_are_capped_overall_and_per_client(make_server: Any) -> None:
    """Control: the settings did not exist and every /api/events request was served."""
    server = await make_server(max_event_streams=2, event_streams_per_client=10)
    first = [await _reader(server) for _ in range(2)]
    await asyncio.sleep(0.1)
    status, headers = await _status(server, "/api/events")
    assert status == 503 and headers["Retry-After"]
    assert _metric(server, "specpilot_http_refused_total{reason=\"event_streams\"}") == 1
    for task, writer in first:
        writer.close()
        task.cancel()
    await asyncio.sleep(1.5)
    assert _metric(server, "specpilot_event_streams") == 0  # ended streams free their slots
    assert (await _status(server, "/api/events"))[0] == 200

    one_each = await make_server(event_streams_per_client=1)
    task, writer = await _reader(one_each)
    await asyncio.sleep(0.1)
    status, headers = await _status(one_each, "/api/events")
    assert status == 429 and headers["Retry-After"]
    assert _metric(one_each, "specpilot_http_refused_total{reason=\"per_client\"}") == 1
    writer.close()
    task.cancel()


async def test_an_unread_event_stream_is_dropped_not_waited_for(make_server: Any) -> None:
    """Control: a stream that never read kept its queue (up to 5,000 events, each rendered by
    it) and its writer waited on the socket for ever."""
    server = await make_server(event_stream_buffer_bytes=4096)
    async with grpc.aio.insecure_channel(server.grpc_target) as channel:
        await _engine(server, channel)
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", server.http_port))
        sock.sendall(_get("/api/events"))  # and never read
        await asyncio.sleep(0.2)
        assert _metric(server, "specpilot_event_streams") == 1
        deadline = time.monotonic() + 20
        while _metric(server, "specpilot_event_streams_dropped_total") == 0:
            assert time.monotonic() < deadline, "the unread stream was never dropped"
            await _churn(server, 2)
        assert _metric(server, "specpilot_event_streams") == 0
        sock.close()


async def test_the_event_stream_needs_the_read_token_when_one_is_set(make_server: Any) -> None:
    """Control: dashboard reads needed nothing whatever the settings."""
    server = await make_server(dashboard_read_token="read-0123456789")
    assert (await _status(server, "/api/events"))[0] == 401
    assert (await _status(server, "/api/dashboard"))[0] == 401
    assert (await _status(server, "/api/events?token=wrong"))[0] == 403
    assert (await _status(server, "/api/decisions", extra="Authorization: Bearer no\r\n"))[0] \
        == 403
    assert (await _status(server, "/api/events?token=read-0123456789"))[0] == 200
    assert (await _status(server, "/api/dashboard",
                          extra="Authorization: Bearer read-0123456789\r\n"))[0] == 200
    assert (await _status(server, "/api/dashboard", extra=f"Authorization: Bearer {TOKEN}\r\n")
            )[0] == 200  # the policy token reads too
    for path in ("/healthz", "/metrics", "/", "/api/policy"):  # probes, scrapes, the page
        assert (await _status(server, path))[0] == 200, path


# --- logs ------------------------------------------------------------------------------------
@pytest.mark.parametrize("engine_id", ["e1\nspecpilot: CRITICAL root: forged",
                                       "e1\x1b[2J\x1b[Hcleared", "e1\x00cut", "e1\u2028sep",
                                       "e" * 256])
async def test_an_engine_id_cannot_forge_or_flood_a_log_line(
        make_server: Any, caplog: pytest.LogCaptureFixture, engine_id: str) -> None:
    """Control: the id reached the log raw (a line break started a forged CRITICAL line, an
    escape or NUL passed) and at any length."""
    server = await make_server()
    with caplog.at_level(logging.INFO):
        async with grpc.aio.insecure_channel(server.grpc_target) as channel:
            engine = EngineClient(channel)
            await engine.connect(hello(engine_id))  # one draft refused: a WARNING naming it
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("specpilot")]
    assert any("draft-other-tokenizer" in line for line in lines)
    for line in lines:
        assert not any(c in line for c in "\n\r\x1b\x00\u2028"), repr(line)
        assert len(line) < 1000


async def test_malformed_requests_are_one_warning_per_interval_without_traceback(
        make_server: Any, caplog: pytest.LogCaptureFixture) -> None:
    """Control: each over-long request line was an ERROR with a traceback (100 requests,
    900 lines), without any credential."""
    server = await make_server()
    caplog.clear()  # what start-up said
    with caplog.at_level(logging.DEBUG):
        for _ in range(30):
            reader, writer = await _raw(server, b"GET /" + b"a" * 20_000 + b" HTTP/1.1\r\n\r\n")
            status, _ = await _head(reader)
            assert status == 400
            writer.close()
        reader, writer = await _raw(server, b"GET / HTTP/1.1\r\nHost: x\r\nBad\x01H: 1\r\n\r\n")
        assert (await _head(reader))[0] == 400
        writer.close()
    noisy = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert all(r.exc_info is None and r.levelno == logging.WARNING for r in noisy), noisy
    assert len(noisy) <= 2 and "line_too_long" in noisy[0].getMessage()  # one per kind
    assert _metric(server, "specpilot_http_client_errors_total{kind=\"line_too_long\"}") == 30
    assert (await _status(server, "/healthz"))[0] == 200


def test_every_kind_of_malformed_request_has_its_own_label() -> None:
    """aiohttp's parser errors map onto the metric's fixed label set (none falls into
    "other" but the base class), so a new kind cannot add a series."""
    kinds = {}
    for name, cls in inspect.getmembers(http_exceptions, inspect.isclass):
        if issubclass(cls, http_exceptions.HttpProcessingError):
            make: Any = cls
            try:
                exc = make(message="x")
            except TypeError:  # those that take the offending text instead
                exc = make("x")
            kinds[name] = client_error_kind(exc)
    assert kinds.pop("HttpProcessingError") == "other"
    assert set(kinds.values()) == set(get_args(HttpClientError)) - {"other"}, kinds


# --- HTTP ------------------------------------------------------------------------------------
@pytest.mark.parametrize(("host", "allowed"), [
    ("127.0.0.1", True), ("127.0.0.1:9464", True), ("[::1]:80", True), ("10.1.2.3", True),
    ("localhost", True), ("LOCALHOST.:9464", True), ("specpilot.ns.svc", True),
    ("evil.example", False), ("evil.example:9464", False), ("localhost.evil.example", False),
    ("127.0.0.1.nip.io", False)])
def test_the_host_allow_list(host: str, allowed: bool) -> None:
    assert host_allowed(host, frozenset({"localhost", "specpilot.ns.svc"})) is allowed


async def test_a_rebinding_host_is_refused_and_every_answer_has_the_security_headers(
        make_server: Any) -> None:
    """Control: any Host header read the dashboard (a DNS-rebinding page could), and no
    answer carried a CSP or frame protection."""
    server = await make_server(http_allowed_hosts=["localhost", "specpilot.ns.svc"])
    status, headers = await _status(server, "/api/dashboard", host="rebind.evil.example")
    assert status == 421
    assert _metric(server, "specpilot_http_refused_total{reason=\"host\"}") == 1
    for path, host in (("/api/dashboard", "specpilot.ns.svc:9464"), ("/", "localhost"),
                       ("/healthz", "10.0.0.7:9464"), ("/nothing-here", "127.0.0.1")):
        status, headers = await _status(server, path, host=host)
        assert status == (404 if path == "/nothing-here" else 200), path
        for name, value in SECURITY_HEADERS.items():
            assert headers.get(name) == value, (path, name)
    reader, writer = await _raw(server, _get("/api/events"))
    status, headers = await _head(reader)
    writer.close()
    assert status == 200 and headers["X-Frame-Options"] == "DENY"
    assert "frame-ancestors 'none'" in headers["Content-Security-Policy"]


async def test_idle_and_half_open_connections_are_closed(make_server: Any) -> None:
    """Control: a connection that sent nothing (or half a request head) was held for an hour
    (aiohttp's keep-alive default)."""
    server = await make_server(http_idle_timeout_seconds=0.5)
    silent = await asyncio.open_connection("127.0.0.1", server.http_port)
    trickle = await _raw(server, b"GET /healthz HTTP/1.1\r\nHost: x\r\n")  # never ends
    kept = await _raw(server, _get("/healthz"))
    assert (await _head(kept[0]))[0] == 200
    start = time.monotonic()
    for reader, _ in (silent, trickle, kept):
        await asyncio.wait_for(reader.read(), 5)  # returns at the server's close
    assert time.monotonic() - start < 3
    for _, writer in (silent, trickle, kept):
        writer.close()


async def test_connections_beyond_the_cap_are_closed_at_once(make_server: Any) -> None:
    """Control: every connection was accepted and held (8,000 held for 40 s)."""
    server = await make_server(http_max_connections=16)
    held = [await asyncio.open_connection("127.0.0.1", server.http_port) for _ in range(16)]
    await asyncio.sleep(0.1)
    reader, writer = await asyncio.open_connection("127.0.0.1", server.http_port)
    assert await asyncio.wait_for(reader.read(), 2) == b""  # closed when accepted
    writer.close()
    assert _metric(server, "specpilot_http_refused_total{reason=\"connections\"}") >= 1
    for _, w in held:
        w.close()
    await asyncio.sleep(0.2)
    assert (await _status(server, "/healthz"))[0] == 200
