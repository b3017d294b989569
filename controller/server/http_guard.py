"""What the HTTP listener refuses before a handler runs, and how little a hostile client costs.

- Host header: only names in ``http_allowed_hosts`` (and IP literals, which a browser sends only
  when the page itself was opened by address) are answered; another is 421. A DNS-rebinding
  page (a site whose name the attacker points at this address) sends its own name, so it cannot
  read the dashboard through a browser inside the cluster.
- Security headers on every answer: a content security policy allowing only this origin's
  script and style, no framing, no MIME sniffing, no referrer.
- Connections: at most ``http_max_connections`` at once (one more is closed when accepted), and
  a connection that has not sent a whole request head for ``http_idle_timeout_seconds`` (new,
  trickling, or idle between requests) is closed by aiohttp's keep-alive timer, which runs from
  the connection's start.
- Malformed requests (an over-long request line, a bad header) are the client's error: counted
  by kind and logged at WARNING at most once per ``CLIENT_ERROR_LOG_SECONDS`` per kind, with no
  traceback, so unauthenticated clients cannot flood the log.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any, get_args

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.log import server_logger

from specpilot.controller.logsafe import safe_name
from specpilot.controller.metrics import HttpClientError, Metrics
from specpilot.controller.server.auth import bearer_verdict

log = logging.getLogger(__name__)
CLIENT_ERROR_LOG_SECONDS = 60.0
SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'none'; "
        "frame-ancestors 'none'"),
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}
_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def host_name(host: str) -> str:
    """The name of a Host header value: the port dropped, IPv6 brackets kept off, lower case,
    no trailing dot."""
    if host.startswith("["):
        return host[1:].partition("]")[0].lower()
    name, colon, port = host.rpartition(":")
    if not colon or not port.isdigit() or ":" in name:
        name = host
    return name.lower().rstrip(".")


def host_allowed(host: str | None, allowed: frozenset[str]) -> bool:
    """Whether a request with this Host header is answered: no header (no browser omits it),
    an IP literal, or a name in ``allowed`` ("*": every name)."""
    if host is None or "*" in allowed:
        return True
    name = host_name(host)
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return name in allowed


def host_middleware(allowed: frozenset[str], metrics: Metrics) -> Any:
    names = frozenset(host_name(h) for h in allowed)

    @web.middleware
    async def check_host(request: web.Request, handler: _Handler) -> web.StreamResponse:
        if not host_allowed(request.headers.get("Host"), names):
            metrics.http_refused("host")
            return web.Response(status=421, text=(
                "Host not served here: add it to http_allowed_hosts, or use the address\n"))
        return await handler(request)

    return check_host


async def security_headers(_: web.Request, response: web.StreamResponse) -> None:
    """``on_response_prepare``: every answer, streams and errors included."""
    response.headers.update(SECURITY_HEADERS)


def client_error_kind(exc: HttpProcessingError) -> HttpClientError:
    """The metric label of a malformed request's parser error."""
    # CamelCase to snake_case, an acronym kept whole: InvalidURLError -> invalid_url_error.
    name = re.sub(r"(?<=[a-z])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_",
                  type(exc).__name__).lower()
    kinds: tuple[str, ...] = get_args(HttpClientError)
    return name if name in kinds else "other"  # type: ignore[return-value]


class ClientErrorLog:
    """aiohttp's server logger (``RequestHandler(logger=...)``): a malformed request (an
    ``HttpProcessingError``) is counted and logged as one WARNING line per kind per
    ``interval`` with how many there were, never a traceback; anything else (a handler's bug)
    goes to aiohttp's logger unchanged."""

    def __init__(self, metrics: Metrics, interval: float = CLIENT_ERROR_LOG_SECONDS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._metrics, self._interval, self._clock = metrics, interval, clock
        self._last: dict[str, float] = {}
        self._unlogged: dict[str, int] = {}

    def exception(self, msg: str, *args: Any, exc_info: Any = None, **kw: Any) -> None:
        if not isinstance(exc_info, HttpProcessingError):
            server_logger.exception(msg, *args, exc_info=exc_info, **kw)
            return
        kind = client_error_kind(exc_info)
        self._metrics.http_client_error(kind)
        self._unlogged[kind] = self._unlogged.get(kind, 0) + 1
        now = self._clock()
        if now - self._last.get(kind, -float("inf")) < self._interval:
            return
        self._last[kind] = now
        count = self._unlogged.pop(kind)
        log.warning("malformed HTTP request (%s, %d since the last such line, counted in "
                    "specpilot_http_client_errors_total): %s", kind, count,
                    safe_name(exc_info.message, 200))

    def debug(self, msg: str, *args: Any, exc_info: Any = None, **kw: Any) -> None:
        # A client's garbage (BadHttpMethod on a first request) is logged at debug: no
        # traceback there either.
        if isinstance(exc_info, HttpProcessingError):
            exc_info = None
        server_logger.debug(msg, *args, exc_info=exc_info, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(server_logger, name)


class _Refused(asyncio.Protocol):
    """A connection beyond the cap: closed as soon as it is accepted."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.close()


class CappedSite(web.TCPSite):
    """``web.TCPSite`` that accepts at most ``max_connections`` connections at once, on a port
    it holds alone."""

    def __init__(self, runner: web.BaseRunner, host: str, port: int, *,
                 ssl_context: Any, max_connections: int, metrics: Metrics) -> None:
        # No SO_REUSEPORT: a second controller on the port must fail to start, not share the
        # connections (SO_REUSEADDR, asyncio's default, only allows a restart past TIME_WAIT).
        super().__init__(runner, host, port, ssl_context=ssl_context, reuse_port=False)
        self._max_connections, self._metrics = max_connections, metrics

    async def start(self) -> None:
        await web.BaseSite.start(self)
        server = self._runner.server
        assert server is not None

        def accept() -> asyncio.BaseProtocol:
            # (A TLS connection counts from the end of its handshake, which asyncio bounds.)
            if len(server.connections) >= self._max_connections:
                self._metrics.http_refused("connections")
                return _Refused()
            return server()

        self._server = await asyncio.get_running_loop().create_server(
            accept, self._host, self._port, ssl=self._ssl_context, backlog=self._backlog,
            reuse_address=self._reuse_address, reuse_port=self._reuse_port)


def read_token_middleware(paths: frozenset[str], tokens: tuple[str, ...],
                          metrics: Metrics) -> Any:
    """GETs of ``paths`` need one of ``tokens`` as ``Authorization: Bearer`` or ``?token=``
    (an EventSource cannot send headers): 401 without one, 403 with a wrong one."""
    secrets = tuple(t.encode() for t in tokens)

    @web.middleware
    async def check_token(request: web.Request, handler: _Handler) -> web.StreamResponse:
        if request.path not in paths:
            return await handler(request)
        given = request.headers.get("Authorization")
        if given is None and "token" in request.query:
            given = f"Bearer {request.query['token']}"
        verdicts = {bearer_verdict(given, s) for s in secrets}
        if "ok" in verdicts:
            return await handler(request)
        metrics.http_refused("read_token")
        if "unauthenticated" in verdicts:
            return web.json_response({"error": "this read needs the dashboard's read token "
                                               "(Authorization: Bearer, or ?token=)",
                                      "kind": "unauthenticated"}, status=401)
        return web.json_response({"error": "wrong read token", "kind": "permission_denied"},
                                 status=403)

    return check_token
