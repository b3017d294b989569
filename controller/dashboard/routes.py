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

Reads need nothing; writes need ``Authorization: Bearer <token>`` (the policy API's token) and
go through ``specpilot.controller.server.policy_writes`` like the gRPC ones: 401 without it, 403
with a wrong one, 400 for a bad request, 503 when the state store did not take a fleet override;
each attempt lands in the audit log. The token rides in a header, never a cookie, so another site
cannot make the browser write (no CSRF).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import secrets
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from aiohttp import web
from google.protobuf import json_format

from specpilot.contract.records import DecisionEvent
from specpilot.controller.core.acceptance import CREDIBLE_LEVEL
from specpilot.controller.core.controller import ControllerCore
from specpilot.controller.dashboard.history import EstimateHistory
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
HISTORY_INTERVAL_SECONDS = 15.0
HISTORY_SAMPLES = 240  # an hour of samples per class
# Events a page may fall behind before its stream is closed (it reconnects and reloads).
EVENT_QUEUE_LIMIT = 5000
AUDIT_SHOWN = 50
_STATUS = {"unauthenticated": 401, "permission_denied": 403, "invalid": 400, "unavailable": 503}
_Item = tuple[str, Any]  # (event name, payload); ("close", None) ends a stream


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
    def __init__(self, core: ControllerCore, hub: Hub, writer: PolicyWriter,
                 clock: Callable[[], float], fleet: FleetSync | None) -> None:
        self._core, self._hub, self._writer, self._clock, self._fleet = (
            core, hub, writer, clock, fleet)
        # A new value per process: the page tells a restart from a reconnect by it.
        self.instance = secrets.token_hex(8)
        self.started_at = clock()
        self._streams: set[asyncio.Queue[_Item]] = set()
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
    def _offer(self, item: _Item) -> None:
        for queue in list(self._streams):
            if queue.qsize() >= EVENT_QUEUE_LIMIT:
                self._streams.discard(queue)
                queue.put_nowait(("close", None))  # it reconnects and reloads
            else:
                queue.put_nowait(item)

    def _on_decisions(self, events: list[DecisionEvent]) -> None:
        self._offer(("decisions", events))

    def _on_audit(self, entry: AuditEntry) -> None:
        self._offer(("audit", dataclasses.asdict(entry)))

    async def events(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache",
                                           "X-Accel-Buffering": "no"})
        await resp.prepare(request)

        async def send(event: str, data: Any) -> None:
            await resp.write(f"event: {event}\ndata: {json_dumps(data)}\n\n".encode())

        queue: asyncio.Queue[_Item] = asyncio.Queue()
        self._streams.add(queue)
        try:
            await resp.write(b"retry: 1000\n\n")  # the browser's reconnect delay, ms
            await send("hello", {"instance": self.instance, "version": self._core.version})
            while True:
                try:
                    name, payload = await asyncio.wait_for(queue.get(), HEARTBEAT_SECONDS)
                except TimeoutError:
                    await send("tick", {"version": self._core.version, "at": self._clock()})
                    continue
                if name == "close":
                    break
                if name == "decisions":
                    for e in payload:
                        await send("decision", self.event_json(e))
                else:
                    await send(name, payload)
        except ConnectionError:
            pass  # the page went away
        finally:
            self._streams.discard(queue)
        return resp

    async def close_streams(self, _: web.Application) -> None:
        """End every event stream (server shutdown: the pages reconnect to the next one)."""
        for queue in list(self._streams):
            queue.put_nowait(("close", None))
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
        app.router.add_get("/", self.page)
        app.router.add_get("/static/{name}", self.asset)
        app.router.add_get("/api/dashboard", self.dashboard_state)
        app.router.add_get("/api/events", self.events)
        app.router.add_get("/api/history", self.estimate_history)
        app.router.add_get("/api/fleet/decisions", self.fleet_decisions)
        app.router.add_post("/api/overrides", self.set_override)
        app.router.add_post("/api/overrides/clear", self.clear_override)

