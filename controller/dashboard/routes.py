"""The dashboard's HTTP side, on the controller's own server: the page at ``/`` (static files in
``static/``, no library, nothing fetched from the internet), one JSON state the page renders,
live events, and the write controls.

    GET  /                        the page
    GET  /static/<file>           its script and style sheet
    GET  /api/dashboard           the state the page draws: GetPolicy's JSON (the same message
                                  the policy API returns, so the page shows exactly its K), the
                                  controller, the fleet (with a shared store) and the audit log
    GET  /api/events              server-sent events: "hello" (the controller instance: a new
                                  one means a restart), "decision" (each new decision with its
                                  plain-language line), "audit" (each policy write attempt),
                                  "tick" (every HEARTBEAT_SECONDS, with the policy version)
    GET  /api/history?class=      the class's acceptance estimates over the last hour (a sample
                                  every HISTORY_INTERVAL_SECONDS: dashboard.history)
    GET  /api/fleet/decisions     the fleet's decision log (newest ``limit``), each with its
                                  plain-language line, with a shared store
    POST /api/overrides           body: SetOverrideRequest in the protobuf JSON mapping
    POST /api/overrides/clear     body: ClearOverrideRequest in the protobuf JSON mapping

Reads need nothing, or ``dashboard_read_token`` where it is set (``http_guard``); event streams
are capped (``max_event_streams``, ``event_streams_per_client``), each event is rendered once
for all of them, and a stream with ``event_stream_buffer_bytes`` unsent is dropped (the page
reconnects and reloads). Writes need ``Authorization: Bearer <token>`` (the policy API's
token) and go through ``specpilot.controller.server.policy_writes`` like the gRPC ones: 401
without it, 403 with a wrong one, 400 for a bad request, 503 when the state store did not take
a fleet override; each attempt lands in the audit log. The token rides in a header, never a
cookie, so another site cannot make the browser write (no CSRF).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import secrets
import socket
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from aiohttp import web
from google.protobuf import json_format

from specpilot.contract.records import DecisionEvent
from specpilot.controller.core.acceptance import CREDIBLE_LEVEL
from specpilot.controller.core.controller import ControllerCore
from specpilot.controller.dashboard.history import EstimateHistory
from specpilot.controller.metrics import Metrics
from specpilot.controller.server.explain import decision_text
from specpilot.controller.server.fleet import FleetSync
from specpilot.controller.server.hub import Hub
from specpilot.controller.server.policy_writes import AuditEntry, PolicyWriter, WriteRefused
from specpilot.controller.server.views import (
    json_dumps,
    json_response,
    policy_json,
    to_json_dict,
)
from specpilot.controller.store.base import StoreUnavailable
from specpilot.controller.wire import event_to_proto, recommendations_to_proto
from specpilot.v1 import policy_pb2

log = logging.getLogger(__name__)
STATIC_DIR = Path(__file__).with_name("static")
_ASSETS = {"dashboard.js": "text/javascript", "dashboard.css": "text/css"}
HEARTBEAT_SECONDS = 5.0
SWEEP_SECONDS = 1.0  # how soon a stream whose client left frees its slot
FLUSH_SECONDS = 0.1  # how long new frames wait to be sent with those after them
FLUSH_SLICE = 32  # stream writers woken per loop turn
RENDER_SLICE = 8  # decisions rendered per loop turn (2-3 ms each)
HISTORY_INTERVAL_SECONDS = 15.0
HISTORY_SAMPLES = 240  # an hour of samples per class
AUDIT_SHOWN = 50
_STATUS = {"unauthenticated": 401, "permission_denied": 403, "invalid": 400, "unavailable": 503}


@dataclasses.dataclass(frozen=True)
class EventStreamLimits:
    """What the event streams may hold (the settings of the same names)."""

    max_streams: int  # max_event_streams
    per_client: int  # event_streams_per_client
    buffer_bytes: int  # event_stream_buffer_bytes


def _frame(event: str, data: Any) -> bytes:
    return f"event: {event}\ndata: {json_dumps(data)}\n\n".encode()


class EventStream:
    """One /api/events client: the frames waiting for it, at most ``limit`` bytes with what its
    socket has not sent yet. Producers never wait on it: a frame that does not fit drops the
    stream (its connection is aborted, so the writer waiting on the socket ends too)."""

    def __init__(self, remote: str, transport: asyncio.BaseTransport | None, limit: int) -> None:
        self.remote, self._limit = remote, limit
        self._transport = transport if isinstance(transport, asyncio.WriteTransport) else None
        self._chunks: list[bytes] = []
        self._queued = 0
        self._wake = asyncio.Event()
        self.closed = False
        sock = transport.get_extra_info("socket") if transport is not None else None
        if sock is not None:  # the kernel's share bounded too (it would hold megabytes)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, limit)

    def offer(self, frame: bytes) -> bool:
        """Queue ``frame``; False (and the stream aborted) when it does not fit."""
        if self.closed:
            return False
        unsent = self._transport.get_write_buffer_size() if self._transport else 0
        if self._queued + len(frame) + unsent > self._limit:
            self.close()
            if self._transport is not None:
                self._transport.abort()
            return False
        self._chunks.append(frame)
        self._queued += len(frame)
        return True  # its writer is woken by the dashboard's flusher (``wake``)

    def wake(self) -> None:
        """Let its writer send what is queued."""
        if self._chunks:
            self._wake.set()

    def close(self) -> None:
        self.closed = True
        self._wake.set()

    @property
    def gone(self) -> bool:
        """Whether its connection has ended (aiohttp does not end a handler for that)."""
        return self._transport is None or self._transport.is_closing()

    async def next(self) -> bytes | None:
        """Every frame waiting, as one write; None once closed."""
        if not self._chunks and not self.closed:
            await self._wake.wait()
        self._wake.clear()
        if self.closed:
            return None
        data = b"".join(self._chunks)
        self._chunks.clear()
        self._queued = 0
        return data


def _finite_number(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:40]} is out of range")
    return value


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not JSON")


def _strict_json(text: str) -> Any:
    """JSON as RFC 8259 has it: no NaN or Infinity, no number beyond a double (Python's parser
    takes both, and ParseDict then raised OverflowError, a 500, on {"scope": Infinity})."""
    return json.loads(text, parse_float=_finite_number, parse_constant=_no_constant)


class Dashboard:
    # The reads that dashboard_read_token guards.
    READ_PATHS = frozenset({"/api/dashboard", "/api/events", "/api/history",
                            "/api/fleet/decisions"})

    def __init__(self, core: ControllerCore, hub: Hub, writer: PolicyWriter,
                 clock: Callable[[], float], fleet: FleetSync | None, metrics: Metrics,
                 limits: EventStreamLimits) -> None:
        self._core, self._hub, self._writer, self._clock, self._fleet = (
            core, hub, writer, clock, fleet)
        self._metrics, self._limits = metrics, limits
        # A new value per process: the page tells a restart from a reconnect by it.
        self.instance = secrets.token_hex(8)
        self.started_at = clock()
        self._streams: set[EventStream] = set()
        self._pending: list[DecisionEvent | bytes] = []  # for the flusher
        self._queued = asyncio.Event()  # set when something is pending
        self.history = EstimateHistory(HISTORY_SAMPLES, CREDIBLE_LEVEL)

    # --- reads ----------------------------------------------------------------------------------
    @staticmethod
    def event_json(e: DecisionEvent) -> dict[str, Any]:
        """An event in the protobuf JSON mapping plus its plain-language ``text`` (from the
        figures kept with it)."""
        return {**to_json_dict(event_to_proto(e)), "text": decision_text(e)}

    def state(self) -> dict[str, Any]:
        now = self._clock()
        snap = self._core.snapshot(now)
        fleet: dict[str, Any] | None = None
        if self._fleet is not None:
            f = self._fleet
            fleet = {
                "sidecar": f.sidecar, "model": f.model(), "store_up": f.up,
                "peers": [{"sidecar": s, "age_seconds": now - at} for s, at in f.peers],
                "recommendations": to_json_dict(recommendations_to_proto(
                    f.recommendations, "", f.recommended_at)),
            }
        return {
            "controller": {"instance": self.instance, "started_at": self.started_at,
                           "now": now, "credible_level": CREDIBLE_LEVEL},
            "policy": policy_json(snap),
            "fleet": fleet,
            "audit": [dataclasses.asdict(a) for a in self._writer.audit.entries()[-AUDIT_SHOWN:]],
        }

    async def dashboard_state(self, _: web.Request) -> web.Response:
        return json_response(self.state())

    async def estimate_history(self, request: web.Request) -> web.Response:
        return json_response({"samples": [
            {"at": s.at, "draft": s.draft, "positions": s.positions}
            for s in self.history.of(request.query.get("class", ""))]})

    async def _sample_history(self, _: web.Application) -> AsyncIterator[None]:
        """Samples the estimates while the server runs (aiohttp cleanup context)."""
        async def sample() -> None:
            while True:
                try:
                    self.history.record(self._core.snapshot(self._clock()))
                except Exception:  # a failed sample must not stop the next ones
                    log.exception("dashboard history sample failed")
                await asyncio.sleep(HISTORY_INTERVAL_SECONDS)
        task = asyncio.create_task(sample())
        yield
        task.cancel()

    # --- live events ----------------------------------------------------------------------------
    def _post(self, item: DecisionEvent | bytes) -> None:
        """Queue an event (a decision, rendered by the flusher) or a rendered frame for every
        stream; nothing when none is open. Never renders nor writes here: a decide round or
        a policy write hands it over and goes on."""
        if self._streams:
            self._pending.append(item)
            self._queued.set()

    def _on_decisions(self, events: list[DecisionEvent]) -> None:
        for e in events:
            self._post(e)

    def _on_audit(self, entry: AuditEntry) -> None:
        self._post(_frame("audit", dataclasses.asdict(entry)))

    def _offer(self, frame: bytes) -> None:
        """Hand one rendered frame to every stream (a stream that cannot take it is
        dropped)."""
        for stream in list(self._streams):
            if not stream.offer(frame):
                self._streams.discard(stream)
                self._metrics.event_stream_dropped()

    def _render(self, item: DecisionEvent | bytes) -> bytes:
        return item if isinstance(item, bytes) else _frame("decision", self.event_json(item))

    async def _flush(self) -> None:
        """Every FLUSH_SECONDS at most: render what was queued, once for all streams,
        RENDER_SLICE events per loop turn, and wake the writers of the streams, FLUSH_SLICE
        per loop turn. A burst of decisions costs each stream one write, and neither the
        rendering nor a thousand streams hold the loop in one piece: health checks and
        engine reports run between the slices."""
        while True:
            await self._queued.wait()
            await asyncio.sleep(FLUSH_SECONDS)  # what else comes meanwhile goes in one write
            self._queued.clear()
            pending, self._pending = self._pending, []
            for start in range(0, len(pending), RENDER_SLICE):
                self._offer(b"".join(map(self._render, pending[start:start + RENDER_SLICE])))
                await asyncio.sleep(0)
            streams = list(self._streams)
            for start in range(0, len(streams), FLUSH_SLICE):
                for stream in streams[start:start + FLUSH_SLICE]:
                    stream.wake()
                await asyncio.sleep(0)

    def _admit(self, remote: str) -> web.Response | None:
        """None when a new stream from ``remote`` may open; else the refusal."""
        limits = self._limits
        if len(self._streams) >= limits.max_streams:
            self._metrics.http_refused("event_streams")
            return json_response({"error": f"{len(self._streams)} event streams are open, the "
                                           "most at once (max_event_streams); retry later"},
                                 status=503, headers={"Retry-After": "5"})
        if sum(s.remote == remote for s in self._streams) >= limits.per_client:
            self._metrics.http_refused("per_client")
            return json_response({"error": f"this client holds {limits.per_client} event "
                                           "streams, the most one may (event_streams_per_client)"},
                                 status=429, headers={"Retry-After": "5"})
        return None

    async def events(self, request: web.Request) -> web.StreamResponse:
        remote = request.remote or "?"
        refused = self._admit(remote)
        if refused is not None:
            return refused
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache",
                                           "X-Accel-Buffering": "no"})
        await resp.prepare(request)
        stream = EventStream(remote, request.transport, self._limits.buffer_bytes)
        self._streams.add(stream)
        try:
            await resp.write(b"retry: 1000\n\n"  # the browser's reconnect delay, ms
                             + _frame("hello", {"instance": self.instance,
                                                "version": self._core.version}))
            while (data := await stream.next()) is not None:
                await resp.write(data)
        except ConnectionError:
            pass  # the page went away, or the stream was dropped
        finally:
            self._streams.discard(stream)
        return resp

    async def _stream_upkeep(self, _: web.Application) -> AsyncIterator[None]:
        """While the server runs (aiohttp cleanup context): the flusher, and every
        SWEEP_SECONDS free the streams whose client left; every HEARTBEAT_SECONDS send them
        all one tick."""
        async def upkeep() -> None:
            since_tick = 0.0
            while True:
                await asyncio.sleep(SWEEP_SECONDS)
                for stream in [s for s in self._streams if s.gone]:
                    stream.close()
                    self._streams.discard(stream)
                since_tick += SWEEP_SECONDS
                if since_tick >= HEARTBEAT_SECONDS and self._streams:
                    since_tick = 0.0
                    self._post(_frame("tick", {"version": self._core.version,
                                               "at": self._clock()}))
        tasks = (asyncio.create_task(upkeep()), asyncio.create_task(self._flush()))
        yield
        for task in tasks:
            task.cancel()

    @property
    def open_streams(self) -> int:
        return len(self._streams)

    async def close_streams(self, _: web.Application) -> None:
        """End every event stream (server shutdown: the pages reconnect to the next one)."""
        for stream in list(self._streams):
            stream.close()
        self._streams.clear()

    # --- writes ---------------------------------------------------------------------------------
    async def _write(self, request: web.Request, message: type[Any],
                     write: Callable[..., Any]) -> web.Response:
        try:
            body = await request.json(loads=_strict_json)
            if not isinstance(body, dict):  # ParseDict raised TypeError (a 500) on null or [1]
                raise ValueError(f"expected a JSON object ({message.DESCRIPTOR.name}), got "
                                 f"{type(body).__name__}")
            msg = json_format.ParseDict(body, message())
        except (ValueError, LookupError, RecursionError, json_format.ParseError) as exc:
            # LookupError: a charset Python does not know (Content-Type: ...; charset=bogus);
            # RecursionError: JSON nested deeper than the parser goes ("[" * 100000).
            return json_response({"error": f"body: {exc}", "kind": "invalid"}, status=400)
        try:
            resp = await write(msg, request.headers.get("Authorization"),
                               f"http {request.remote or '?'}")
        except WriteRefused as exc:
            headers = {"WWW-Authenticate": "Bearer"} if exc.kind == "unauthenticated" else None
            return json_response({"error": exc.reason, "kind": exc.kind},
                                     status=_STATUS[exc.kind], headers=headers)
        return json_response(to_json_dict(resp))

    async def set_override(self, request: web.Request) -> web.Response:
        return await self._write(request, policy_pb2.SetOverrideRequest,
                                 self._writer.set_override)

    async def clear_override(self, request: web.Request) -> web.Response:
        return await self._write(request, policy_pb2.ClearOverrideRequest,
                                 self._writer.clear_override)

    async def fleet_decisions(self, request: web.Request) -> web.Response:
        if self._fleet is None:
            return json_response({"error": "the fleet's log needs a shared state store "
                                               "(state_store)"}, status=404)
        try:
            limit = min(max(int(request.query.get("limit", "100")), 0), 10_000)
        except ValueError:
            return json_response({"error": "limit: must be an integer"}, status=400)
        try:
            entries = await self._fleet.fleet_decisions(limit)
        except StoreUnavailable as exc:
            return json_response({"error": f"state store: {exc}"}, status=503)
        return json_response({"events": [
            {"sidecar": s, **self.event_json(e)} for s, e in entries]})

    # --- the page -------------------------------------------------------------------------------
    async def page(self, _: web.Request) -> web.FileResponse:
        return web.FileResponse(STATIC_DIR / "index.html",
                                headers={"Cache-Control": "no-cache"})

    async def asset(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if name not in _ASSETS:  # a fixed list: no path from the request reaches the disk
            raise web.HTTPNotFound()
        return web.Response(body=(STATIC_DIR / name).read_bytes(), content_type=_ASSETS[name],
                            headers={"Cache-Control": "no-cache"})

    def install(self, app: web.Application) -> None:
        self._hub.on_decisions(self._on_decisions)
        self._writer.audit.on_entry(self._on_audit)
        app.on_shutdown.append(self.close_streams)
        app.cleanup_ctx.append(self._sample_history)
        app.cleanup_ctx.append(self._stream_upkeep)
        app.router.add_get("/", self.page)
        app.router.add_get("/static/{name}", self.asset)
        app.router.add_get("/api/dashboard", self.dashboard_state)
        app.router.add_get("/api/events", self.events)
        app.router.add_get("/api/history", self.estimate_history)
        app.router.add_get("/api/fleet/decisions", self.fleet_decisions)
        app.router.add_post("/api/overrides", self.set_override)
        app.router.add_post("/api/overrides/clear", self.clear_override)

