"""The HTTP side: /metrics (Prometheus), /healthz, JSON views under /api (the fleet's
recommendations, for a gateway to poll, at /api/recommendations) and the dashboard
(``specpilot.controller.dashboard.routes``: the page at / and its API).

The JSON is the protobuf JSON mapping of the same messages the policy API returns (field names as
in the .proto; 64-bit integers as strings, as that mapping prescribes), so the dashboard and gRPC
clients read one schema.
"""

from __future__ import annotations

from collections.abc import Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from specpilot.controller.core.controller import ControllerCore
from specpilot.controller.dashboard.routes import Dashboard
from specpilot.controller.metrics import Metrics
from specpilot.controller.server.fleet import FleetSync
from specpilot.controller.server.http_guard import (
    host_middleware,
    read_token_middleware,
    security_headers,
)
from specpilot.controller.server.views import json_response, policy_json, to_json_dict
from specpilot.controller.settings import ServerConfig
from specpilot.controller.wire import event_to_proto, recommendations_to_proto

# Most decision-log events one /api/decisions answer holds, and with ?text=1 (each rendered
# line costs the loop 2-3 ms): past these a reader pages with ?offset=. The dashboard asks for
# 2,000 events for its timeline and 100 lines per log page.
DECISIONS_PAGE_MAX = 2000
DECISIONS_TEXT_PAGE_MAX = 200


def make_app(core: ControllerCore, metrics: Metrics, clock: Callable[[], float],
             fleet: FleetSync | None, dashboard: Dashboard, settings: ServerConfig,
             policy_token: str) -> web.Application:
    """The HTTP side, behind ``http_guard``'s checks (Host header, read token, security
    headers)."""
    async def metrics_handler(_: web.Request) -> web.Response:
        return web.Response(body=metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def healthz(_: web.Request) -> web.Response:
        # No snapshot: at 256 classes x 16 drafts one costs ~50 ms, and kubelets ask often.
        return json_response({"status": "ok", "engines_connected": core.engines_connected,
                              "policy_version": core.version})

    async def policy(request: web.Request) -> web.Response:
        try:
            policy_state = policy_json(core.snapshot(clock()), request.query.get("class", ""))
        except KeyError as exc:
            return json_response({"error": exc.args[0]}, status=404)
        return json_response(policy_state)

    async def decisions(request: web.Request) -> web.Response:
        """The recent decision log, oldest first: ?class= filters, ?limit= keeps the newest N
        after skipping the newest ?offset= (pages back through the log), ?text=1 adds each
        event's plain-language line. ``total``: the events that match; ``limit``: the page
        size applied (at most DECISIONS_PAGE_MAX, DECISIONS_TEXT_PAGE_MAX with text)."""
        snap = core.snapshot(clock())
        text = request.query.get("text") == "1"
        most = DECISIONS_TEXT_PAGE_MAX if text else DECISIONS_PAGE_MAX
        try:
            limit = min(int(request.query.get("limit", most)), most)
            offset = max(int(request.query.get("offset", 0)), 0)
        except ValueError:
            return json_response({"error": "limit, offset: must be integers"}, status=400)
        events = snap.events(request.query.get("class", ""))
        end = len(events) - offset
        kept = events[max(end - limit, 0):max(end, 0)] if limit > 0 else ()
        if text:
            rendered = [dashboard.event_json(e) for e in kept]
        else:
            rendered = [to_json_dict(event_to_proto(e)) for e in kept]
        return json_response({"events": rendered, "total": len(events),
                              "limit": max(limit, 0)})

    async def recommendations(request: web.Request) -> web.Response:
        """The fleet's recommendations per class (?class= for one); 404 without a shared
        store."""
        if fleet is None:
            return json_response({"error": "recommendations need a shared state store "
                                               "(state_store)"}, status=404)
        return json_response(to_json_dict(recommendations_to_proto(
            fleet.recommendations, request.query.get("class", ""), fleet.recommended_at)))

    middlewares = [host_middleware(settings.http_allowed_hosts, metrics)]
    if settings.dashboard_read_token is not None:
        middlewares.append(read_token_middleware(
            Dashboard.READ_PATHS | {"/api/decisions"},
            (settings.dashboard_read_token.get_secret_value(), policy_token), metrics))
    app = web.Application(middlewares=middlewares)
    app.on_response_prepare.append(security_headers)
    app.router.add_get("/metrics", metrics_handler)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/api/policy", policy)
    app.router.add_get("/api/decisions", decisions)
    app.router.add_get("/api/recommendations", recommendations)
    dashboard.install(app)
    return app
