"""Wiring: one core, the gRPC services, the HTTP endpoints and the periodic decide task, all on the
caller's asyncio loop. The core is only ever touched from that loop, so it needs no locks.

``start_server`` is what ``specpilot serve`` and the integration tests run.
"""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import logging
import os
import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
from aiohttp import web
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio  # type: ignore[attr-defined]
from grpc_reflection.v1alpha import reflection

from specpilot.contract.tls import ServerTLS, TLSError, server_tls
from specpilot.contract.version import package_version
from specpilot.controller.core.controller import ControllerCore
from specpilot.controller.core.published import epoch_at
from specpilot.controller.dashboard.routes import Dashboard, EventStreamLimits
from specpilot.controller.logsafe import safe_name
from specpilot.controller.metrics import Metrics
from specpilot.controller.server.engine_service import ClientCertificates, EngineService
from specpilot.controller.server.fleet import FleetIdentity, FleetSync
from specpilot.controller.server.http import make_app
from specpilot.controller.server.http_guard import CappedSite, ClientErrorLog
from specpilot.controller.server.hub import Hub
from specpilot.controller.server.overload import LoopLag, ReportBudget
from specpilot.controller.server.policy_service import PolicyService
from specpilot.controller.server.policy_writes import AuditLog, PolicyWriter
from specpilot.controller.server.ports import in_use_message, port_in_use, taken_by
from specpilot.controller.server.stubs import add_engine_service, add_policy_service
from specpilot.controller.settings import (
    FleetConfig,
    ServerConfig,
    Settings,
    core_config,
    fleet_config,
    server_config,
)
from specpilot.controller.store.base import StateStore
from specpilot.v1 import engine_pb2, policy_pb2

log = logging.getLogger(__name__)

SERVICE_NAMES = (
    engine_pb2.DESCRIPTOR.services_by_name["EngineService"].full_name,
    policy_pb2.DESCRIPTOR.services_by_name["PolicyService"].full_name,
)

# Keepalive. The server pings an idle connection every 30 s and drops it when the ack does not come
# within 10 s, so an engine that vanished (node gone, partition) is disconnected, and its streams'
# state freed, within about 40 s. Engines may ping as often as every 10 s even without calls in
# flight; the engine plugin sets keepalive_time_ms=20000, keepalive_timeout_ms=10000 and
# keepalive_permit_without_calls=1 (faster client pings would be answered with GOAWAY
# "too_many_pings"). max_pings_without_data=0 lets pings continue on a quiet stream.
KEEPALIVE_OPTIONS = [
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ("grpc.http2.max_pings_without_data", 0),
]
# grpcio sets SO_REUSEPORT by default: a second controller on the same port would start
# without error and the kernel would split the connections between the two.
EXCLUSIVE_PORT_OPTIONS = [("grpc.so_reuseport", 0)]
# The flag that picks each listener's port, for a message about a port in use.
PORT_FLAGS = {"grpc_port": "--grpc-port N", "http_port": "--http-port N",
              "engine_grpc_port": "--set engine_grpc_port=N"}
# Oversized reports must reach the handler, which answers with a reason and keeps the stream;
# gRPC's own limit (which would kill the stream) sits well above settings.max_report_bytes.
RECEIVE_LIMIT_FACTOR = 4
# Per-stream queue length before a stream that does not read is cut off.
STREAM_QUEUE_LIMIT = 1024
# Joint-search buckets refreshed per periodic round (9 buckets, joint_interval_seconds 5 s at
# one round a second: every bucket within 4.5 s).
JOINT_BUCKETS_PER_ROUND = 2


# The shortest engine_secret accepted, characters.
MIN_ENGINE_SECRET_CHARS = 32


class ServeError(RuntimeError):
    """A listener could not be started; the message says which and why."""


@dataclass
class RunningServer:
    core: ControllerCore
    metrics: Metrics
    token: str
    token_generated: bool
    grpc_host: str
    grpc_port: int
    http_host: str
    http_port: int
    _grpc: grpc.aio.Server
    _http: web.AppRunner
    _health: health_aio.HealthServicer
    _hub: Hub
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _store: StateStore | None = None
    fleet: FleetSync | None = None
    tls: bool = False  # both listeners serve TLS (tls_cert_file)
    engine_grpc_port: int | None = None  # the engines' mTLS listener, if any

    @property
    def grpc_target(self) -> str:
        return f"{_host_for_url(self.grpc_host)}:{self.grpc_port}"

    @property
    def engine_grpc_target(self) -> str:
        """Where engines connect: the mTLS listener where there is one, else the gRPC port."""
        port = self.grpc_port if self.engine_grpc_port is None else self.engine_grpc_port
        return f"{_host_for_url(self.grpc_host)}:{port}"

    @property
    def http_url(self) -> str:
        scheme = "https" if self.tls else "http"
        return f"{scheme}://{_host_for_url(self.http_host)}:{self.http_port}"

    async def stop(self, grace_seconds: float = 1.0) -> None:
        """Report NOT_SERVING, flush to the shared store (within the grace; none with 0, as
        after a SIGKILL), end every stream with OK, then close the listeners."""
        await self._health.enter_graceful_shutdown()
        for task in self._tasks:
            task.cancel()
        if self.fleet is not None and grace_seconds > 0:
            await self.fleet.final_flush(grace_seconds)
        self._hub.close_all()
        await self._grpc.stop(grace_seconds)
        await self._http.cleanup()
        if self._store is not None:
            await self._store.close()


def _policy_token(server: ServerConfig) -> tuple[str, bool]:
    """The policy token and whether it was generated now: ``policy_token``, else the content of
    ``policy_token_file``, else a new one (written to that file when one is named, so a
    restart keeps it). ServeError when the file cannot be read or written."""
    if server.policy_token:
        return server.policy_token.get_secret_value(), False
    path = Path(server.policy_token_file) if server.policy_token_file else None
    try:
        if path is not None and path.exists():
            token = path.read_text().strip()
            if not token:
                raise ServeError(f"policy_token_file {str(path)!r} is empty")
            return token, False
        token = secrets.token_urlsafe(24)
        if path is not None:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(token + "\n")
    except OSError as exc:
        raise ServeError(f"policy_token_file {str(path)!r}: {exc}") from exc
    return token, True


def engine_credentials(server: ServerConfig) -> tuple[str, str]:
    """(engine_secret, engine_token), "" for each unset; ServeError for both set or a short
    secret (a token and its id would let a short one be guessed offline)."""
    secret = server.engine_secret.get_secret_value() if server.engine_secret else ""
    token = server.engine_token.get_secret_value() if server.engine_token else ""
    if secret and token:
        raise ServeError("engine_secret and engine_token are both set: keep engine_secret "
                         "(each engine its own token) and unset engine_token")
    if secret and len(secret) < MIN_ENGINE_SECRET_CHARS:
        raise ServeError(f"engine_secret has {len(secret)} characters, fewer than "
                         f"{MIN_ENGINE_SECRET_CHARS}: use a random one, e.g. "
                         "`openssl rand -hex 32`")
    return secret, token


def _open_engine_streams(server: ServerConfig) -> str:
    """Engine streams without any credential: ServeError beyond loopback unless allowed; else
    the line that says so at start-up."""
    loopback = _is_loopback(server.grpc_host)
    if not loopback and not server.allow_unauthenticated_engines:
        raise ServeError(
            f"grpc_host {server.grpc_host!r} is reachable beyond this host, and engine streams "
            "would need no credential: set engine_secret (each engine presents its own token, "
            "`specpilot engine-token`) or tls_client_ca_file (mTLS), or "
            "allow_unauthenticated_engines=true on a trusted network")
    who = "every local process" if loopback else "every client that reaches it"
    return (f"engine streams need no credential: {who} can open one to grpc_host "
            f"{server.grpc_host}, register an engine and report as it; set engine_secret "
            "(per-engine tokens, `specpilot engine-token`) or tls_client_ca_file to require one")


def _is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or "localhost") only listens on this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _host_for_url(host: str) -> str:
    return f"[{host}]" if ":" in host else host


async def _decide_periodically(hub: Hub, clock: Callable[[], float], interval: float,
                               silence_timeout: float) -> None:
    """Re-decide without waiting for reports, so overrides and the decaying probe share reach
    the engines within one report interval even when none is reporting; refresh the joint
    search, a bucket per loop turn (each costs up to ~25 ms with 8 classes: one at a time, a
    report waits behind one at most); drop engines silent for ``silence_timeout``, and free
    the slots of classes no engine reports any more."""
    while True:
        await asyncio.sleep(interval)
        try:
            for engine_id in hub.drop_silent(clock(), silence_timeout):
                log.warning("engine %s: no report for %g s, stream ended",
                            safe_name(engine_id), silence_timeout)
            if idle := hub.forget_idle_classes(clock()):
                log.info("classes no engine reported for class_idle_seconds gave their slots "
                         "back: %s", ", ".join(map(safe_name, idle)))
            if gone := hub.forget_departed(clock()):
                log.info("drafts no engine announced for name_grace_seconds forgotten: %s",
                         ", ".join(map(safe_name, gone)))
            for _ in range(JOINT_BUCKETS_PER_ROUND):
                hub.refresh_joint(clock())
                await asyncio.sleep(0)
            hub.decide(clock(), joint=False)
        except Exception:  # one failed round must not stop all later ones
            log.exception("periodic decide failed")


def _listener_tls(settings: ServerConfig) -> ServerTLS | None:
    """The listeners' TLS (None: plaintext); ServeError naming the setting for a file that is
    missing, unreadable or does not fit, and for TLS settings that do not go together."""
    try:
        tls = server_tls(settings.tls_cert_file, settings.tls_key_file,
                         settings.tls_client_ca_file, settings.tls_client_auth)
    except TLSError as exc:
        raise ServeError(str(exc)) from exc
    mtls = tls is not None and tls.client_ca is not None
    if settings.tls_bind_engine_id and not mtls:
        raise ServeError("tls_bind_engine_id needs tls_client_ca_file (engine client "
                         "certificates to bind engine ids to)")
    engines_only = mtls and settings.tls_client_auth == "engines"
    if engines_only and settings.engine_grpc_port is None:
        raise ServeError("tls_client_auth \"engines\" needs engine_grpc_port, the engines' "
                         "mTLS listener (grpc_port then asks no client certificate)")
    if settings.engine_grpc_port is not None and not engines_only:
        raise ServeError("engine_grpc_port is the engines' mTLS listener: it needs "
                         "tls_client_ca_file and tls_client_auth \"engines\"")
    return tls


def _engine_certificates(settings: ServerConfig,
                         tls: ServerTLS | None) -> ClientCertificates | None:
    """What EngineService requires of a stream's client certificate (None: nothing)."""
    if tls is None or tls.client_ca is None:
        return None
    where = ("engines connect to engine_grpc_port, which checks it" if
             settings.tls_client_auth == "engines" else "")
    return ClientCertificates(bind_engine_id=settings.tls_bind_engine_id, where=where)


def _bind_grpc(server: grpc.aio.Server, settings: ServerConfig, tls: ServerTLS | None
               ) -> tuple[int, int | None]:
    """Add the gRPC port (plaintext, TLS, or TLS requiring client certificates) and, with
    tls_client_auth "engines", the engines' mTLS port; their numbers."""
    host = _host_for_url(settings.grpc_host)
    wanted = [(settings.grpc_port, tls is not None and tls.main_port_requires_client_certificates,
               "grpc_port")]
    if settings.engine_grpc_port is not None:
        wanted.append((settings.engine_grpc_port, True, "engine_grpc_port"))
    ports: list[int] = []
    for number, client_certificates, setting in wanted:
        address = f"{host}:{number}"
        # Tried first: gRPC's own failure is a bare "Failed to bind" plus a log line of its own.
        if port_in_use(settings.grpc_host, number):
            raise ServeError(_in_use("gRPC", address, number, setting))
        try:
            if tls is None:
                ports.append(server.add_insecure_port(address))
            else:
                ports.append(server.add_secure_port(address, tls.grpc_credentials(
                    client_certificates=client_certificates)))
        except RuntimeError as exc:
            if port_in_use(settings.grpc_host, number):  # taken since the trial
                raise ServeError(_in_use("gRPC", address, number, setting)) from exc
            raise ServeError(f"cannot listen for gRPC on {address}: {exc}") from exc
    return ports[0], ports[1] if len(ports) > 1 else None


def _in_use(listener: str, address: str, port: int, setting: str) -> str:
    return in_use_message(listener, address, port, setting, PORT_FLAGS[setting],
                          taken_by(port), os.getpid())


async def _start_grpc(settings: ServerConfig, engine: EngineService, policy: PolicyService,
                      health: health_aio.HealthServicer, tls: ServerTLS | None = None,
                      ) -> tuple[grpc.aio.Server, int, int | None]:
    limit = RECEIVE_LIMIT_FACTOR * settings.max_report_bytes
    server = grpc.aio.server(options=[*KEEPALIVE_OPTIONS, *EXCLUSIVE_PORT_OPTIONS,
                                      ("grpc.max_receive_message_length", limit)])
    add_engine_service(engine, server)
    add_policy_service(policy, server)
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection(
        (*SERVICE_NAMES, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
         reflection.SERVICE_NAME), server)
    port, engine_port = _bind_grpc(server, settings, tls)
    await server.start()
    for service in ("", *SERVICE_NAMES):
        await health.set(service, health_pb2.HealthCheckResponse.SERVING)
    return server, port, engine_port


async def _start_http(settings: ServerConfig, app: web.Application, metrics: Metrics,
                      tls: ServerTLS | None = None) -> tuple[web.AppRunner, int]:
    runner = web.AppRunner(app, access_log=None, logger=ClientErrorLog(metrics),
                           keepalive_timeout=settings.http_idle_timeout_seconds)
    await runner.setup()
    site = CappedSite(runner, settings.http_host, settings.http_port,
                      ssl_context=tls.http_context if tls is not None else None,
                      max_connections=settings.http_max_connections, metrics=metrics)
    try:
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        address = f"{_host_for_url(settings.http_host)}:{settings.http_port}"
        if exc.errno == errno.EADDRINUSE:
            raise ServeError(_in_use("HTTP", address, settings.http_port, "http_port")) from exc
        raise ServeError(f"cannot listen for HTTP on {address}: {exc}") from exc
    port = int(runner.addresses[0][1])
    return runner, port


async def start_server(settings: Settings) -> RunningServer:
    """Start everything on the running loop; raise ServeError if a port cannot be bound."""
    clock = time.time
    server = server_config(settings)
    # The start time as the policy epoch: versions never go backwards across a restart.
    core = ControllerCore(core_config(settings), np.random.default_rng(server.seed),
                          epoch=epoch_at(clock()))
    fleet_settings = fleet_config(settings)
    metrics = Metrics(core, clock, fleet_settings.fleet_model)
    budget = ReportBudget(server.report_budget_share,
                          max_retry_after=server.engine_silence_timeout_seconds / 4.0)
    lag = LoopLag()
    metrics.watch_loop_lag(lambda: lag.seconds)
    hub = Hub(core, metrics, clock, server.fail_static_timeout_seconds, STREAM_QUEUE_LIMIT,
              server.decide_min_interval_seconds, budget,
              max_watchers=server.max_watch_streams,
              max_watchers_per_client=server.event_streams_per_client)
    token, generated = _policy_token(server)
    engine_secret, engine_token = engine_credentials(server)
    tls = _listener_tls(server)
    certificates = _engine_certificates(server, tls)
    open_streams = "" if engine_secret or engine_token or certificates else \
        _open_engine_streams(server)
    engine = EngineService(core, hub, metrics, controller_version=package_version(),
                           engine_secret=engine_secret, engine_token=engine_token,
                           client_certificates=certificates,
                           report_interval_seconds=server.report_interval_seconds,
                           max_report_bytes=server.max_report_bytes, clock=clock,
                           budget=budget)
    sidecar = fleet_settings.sidecar_id or socket.gethostname()
    store, fleet = None, None
    if fleet_settings.state_store != "memory":
        store = _open_store(fleet_settings)
        fleet = FleetSync(
            core, store, FleetIdentity(sidecar, fleet_settings.fleet_model),
            fleet_settings.fleet_flush_interval_seconds, fleet_settings.fleet_max_age_seconds,
            clock, metrics, decide=hub.decide,
            decision_log_size=fleet_settings.fleet_decision_log_size,
            recommend_min_tries=fleet_settings.fleet_recommend_min_tries)
        hub.on_decisions(fleet.record_decisions)
        hub.on_engine_left(fleet.flush_soon)
    writer = PolicyWriter(core, hub, metrics, token, clock, sidecar, fleet, AuditLog())
    policy = PolicyService(core, hub, writer, clock, fleet)
    health = health_aio.HealthServicer()
    grpc_server, grpc_port, engine_port = await _start_grpc(server, engine, policy, health, tls)
    try:
        dashboard = Dashboard(core, hub, writer, clock, fleet, metrics, EventStreamLimits(
            server.max_event_streams, server.event_streams_per_client,
            server.event_stream_buffer_bytes))
        metrics.watch_event_streams(lambda: dashboard.open_streams)
        app = make_app(core, metrics, clock, fleet, dashboard, server, token)
        runner, http_port = await _start_http(server, app, metrics, tls)
    except ServeError:
        await grpc_server.stop(None)
        raise
    running = RunningServer(
        core=core, metrics=metrics, token=token, token_generated=generated,
        grpc_host=server.grpc_host, grpc_port=grpc_port,
        http_host=server.http_host, http_port=http_port,
        _grpc=grpc_server, _http=runner, _health=health, _hub=hub, _store=store, fleet=fleet,
        tls=tls is not None, engine_grpc_port=engine_port,
    )
    running._tasks.append(asyncio.create_task(lag.run()))
    running._tasks.append(asyncio.create_task(
        _decide_periodically(hub, clock, server.report_interval_seconds,
                             server.engine_silence_timeout_seconds)))
    if fleet is not None:
        running._tasks.append(asyncio.create_task(fleet.run()))
    if open_streams:
        log.warning("%s", open_streams)
    return running


def _open_store(fleet: FleetConfig) -> StateStore:
    """The configured shared store; ServeError for a URL it cannot use."""
    from specpilot.controller.store.redis_store import RedisStore  # redis-py only where configured

    if not fleet.state_store.startswith(("redis://", "rediss://", "redis+cluster://")):
        raise ServeError(f"state_store: expected \"memory\" or a redis://, rediss:// or "
                         f"redis+cluster:// URL, got {fleet.state_store!r}")
    try:
        return RedisStore.from_url(fleet.state_store)
    except ValueError as exc:
        raise ServeError(f"state_store: {exc}") from exc

