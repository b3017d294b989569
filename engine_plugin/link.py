"""The engine's side of ``EngineService.Connect``: a daemon thread that owns the stream.

The scheduler calls ``submit(payload)`` once per report interval; it appends to a bounded queue
(dropping the oldest payload when full) and returns at once. The sender thread connects, sends the
hello, waits for the HelloAck, then turns queued payloads into reports (the contract's records,
made messages by ``specpilot.contract.engine_stream``, which makes every message from the
controller a record too). Every message from the controller counts as hearing from it
(``PolicyView.heard_from_controller``); policy updates go to the ``PolicyView``, and so do the
HelloAck's bucket bounds, the ones reports are bucketed with. When the stream fails, the thread
reconnects with exponential backoff and full jitter, sending the hello again; sequence numbers
restart at 1 on every stream (the controller tracks them per stream).

Why the synchronous gRPC API in a plain thread, not ``grpc.aio`` on an event loop inside the
thread: the plugin lives in vLLM's process, which may run its own asyncio loops (the OpenAI
server; in-process engines in tests, next to a controller on another loop), and grpc.aio binds
process-wide state to loops. The sync API has no loop at all, cancels a call from any thread
(``stop``), and its request iterator is a plain generator fed from our queue. gRPC runs that
generator on a thread of its own, so the generator only ever waits on a condition with a short
timeout and returns as soon as its stream ended.

Idle heartbeats: when no payload was sent for two report intervals (or a third of the fail-static
timeout, if shorter), the thread sends an empty report. An idle engine's scheduler does not run
and so does not submit, and without traffic on the stream the engine would fall back to its static
configuration after the fail-static timeout although the controller is healthy. The heartbeat
keeps the ReportResults (and so the policy) coming.

Records dropped: ``records_dropped`` in a report is the number of records (histograms, step sums,
finished summaries) in payloads this link dropped since the previous report, plus finished
summaries the aggregator dropped from the payload itself. ``dropped`` counts dropped payloads.

Nothing here raises into the caller or blocks it: ``submit`` takes a lock held only for a few
deque operations, and every callback from the stream is guarded.
"""

from __future__ import annotations

import logging
import math
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import grpc

from specpilot.contract import engine_stream
from specpilot.contract.records import EngineHello, HelloAck, PolicyUpdate, ReportResult
from specpilot.contract.tls import TLSError, channel_credentials, server_name_options
from specpilot.engine_plugin.config import PluginConfig, env_name
from specpilot.engine_plugin.policy.stats import ReportPayload
from specpilot.engine_plugin.policy.view import PolicyView
from specpilot.v1 import engine_pb2

log = logging.getLogger(__name__)

CONNECT_METHOD = (
    "/" + engine_pb2.DESCRIPTOR.services_by_name["EngineService"].full_name + "/Connect")

# Keepalive, matched to the controller's server options (controller/server/app.py): the server
# accepts pings no more often than every 10 s without data (min_ping_interval_without_data_ms) and
# answers faster ones with GOAWAY "too_many_pings". 20 s pings with a 10 s ack timeout find a dead
# controller (node gone, partition) within about 30 s even on a quiet stream; pings are allowed
# with no call in flight and keep going without data, like the server's.
KEEPALIVE_OPTIONS: list[tuple[str, int]] = [
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]
# A fresh channel per attempt: our backoff decides when to retry, not the channel's own
# (which grows to 120 s); these keep a single attempt's connect from idling.
CHANNEL_OPTIONS: list[tuple[str, int]] = [
    *KEEPALIVE_OPTIONS,
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1_000),
    ("grpc.enable_retries", 0),
]
# How often the request generator re-checks whether its stream ended or the link stops, seconds.
_POLL_SECONDS = 0.05
# What a failed TLS handshake is most likely about, and a connection the controller closed
# during one (it refused the client certificate, or it speaks TLS to a plaintext plugin).
_TLS_HINT = (f"TLS handshake failed: does {env_name('tls_ca_file')} sign the controller's "
             f"certificate, is that valid for the controller's address or "
             f"{env_name('tls_server_name')}, and does the controller serve TLS?")
_CLOSED_HINTS = {
    True: (f"if the controller requires client certificates, is {env_name('tls_cert_file')} "
           "signed by its tls_client_ca_file?"),
    False: f"if the controller serves TLS, set {env_name('tls_ca_file')}",
}
# Repeated warnings (rejected reports) are logged at most this often, seconds.
_WARN_EVERY_SECONDS = 10.0
# An idle stream gets an empty report after this many report intervals without one (or a third
# of the fail-static timeout, if that is shorter).
_HEARTBEAT_INTERVALS = 2.0
# Reports kept until answered, so a shed one can be sent again (answers come in order, within
# a few reports: more means the controller stopped answering).
_IN_FLIGHT_KEPT = 64
# Shedding stretches the report interval at most this many times, and each accepted report
# brings it back by this factor.
MAX_SHED_BACKOFF = 16.0
SHED_RECOVERY = 1.25


def backoff_delay(failures: int, initial: float, maximum: float, rng: random.Random) -> float:
    """Seconds to wait before the next attempt, after ``failures`` failed attempts in a row (0:
    the previous stream had been up): uniform in [0, min(maximum, initial * 2**failures)] ("full
    jitter", so a fleet of engines does not reconnect in lockstep when a controller returns)."""
    ceiling = min(maximum, initial * 2.0 ** min(failures, 60))
    return rng.uniform(0.0, ceiling)


def shed_backoff(backoff: float, shed: bool) -> float:
    """The report interval's stretch after an answer: doubled by a shed report (at most
    MAX_SHED_BACKOFF), back by SHED_RECOVERY by an accepted one (to 1)."""
    return min(backoff * 2.0, MAX_SHED_BACKOFF) if shed else max(1.0, backoff / SHED_RECOVERY)


def shed_pause(interval: float, backoff: float, retry_after: float) -> float:
    """Seconds before a shed report is sent again: the stretched interval, or the controller's
    ``retry_after_seconds`` where that is longer, at most MAX_SHED_BACKOFF intervals."""
    pause = interval * backoff
    if math.isfinite(retry_after) and retry_after > pause:
        pause = min(retry_after, interval * MAX_SHED_BACKOFF)
    return pause


@dataclass
class _Stream:
    """State of one Connect attempt."""

    ended: threading.Event = field(default_factory=threading.Event)
    acked: bool = False
    sequence: int = 0
    # Messages sent and not answered yet, oldest first: (sequence, the report sent, or None
    # for a heartbeat), so that a shed report can be sent again and a broken stream's losses
    # are all counted.
    in_flight: deque[tuple[int, tuple[ReportPayload, int] | None]] = field(
        default_factory=deque)


class _Throttled:
    """A warning logged at most once per period, with the count of those held back."""

    def __init__(self, period: float) -> None:
        self._period = period
        self._last = -math.inf
        self._held = 0

    def warn(self, msg: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._last < self._period:
            self._held += 1
            return
        if self._held:
            msg += " (%d similar messages suppressed)"
            args = (*args, self._held)
        self._last, self._held = now, 0
        log.warning(msg, *args)


class ControllerLink:
    """Owns the stream to the controller at ``target`` (host:port).

    ``hello``: what the engine announces on every stream. ``view``: gets the policy, the HelloAck's
    bucket bounds (reports are bucketed with the view's bounds) and the classes the controller
    folded. ``on_hello_ack``: called (on the sender thread) with every HelloAck, e.g. to
    adopt the controller's ``max_classes``. ``start``: start the thread now (else ``start()``).
    With an empty ``target`` no thread ever starts: ``submit`` just queues (dropping the oldest)
    and the view stays on the static configuration.
    """

    def __init__(
        self,
        target: str,
        hello: EngineHello,
        view: PolicyView,
        config: PluginConfig,
        *,
        on_hello_ack: Callable[[HelloAck], None] | None = None,
        rng: random.Random | None = None,
        start: bool = True,
    ) -> None:
        self.target = target
        self._hello = engine_pb2.ConnectRequest(hello=engine_stream.hello_to_proto(hello))
        self._engine_id = hello.engine_id
        self._view = view
        self._on_ack = on_hello_ack
        self._config = config
        self._rng = rng or random.Random()
        self._interval = config.report_interval_seconds

        self._cond = threading.Condition(threading.Lock())
        self._queue: deque[tuple[ReportPayload, int]] = deque()
        self._queue_size = config.queue_size
        self._records_dropped_unreported = 0
        self._last_running = 0
        self._stop = threading.Event()
        self._call: Any = None  # the current call (a grpc Rendezvous), for stop() to cancel
        self._connected = False
        self._outage_warned = False
        self._rejected_warning = _Throttled(_WARN_EVERY_SECONDS)
        self._shed_warning = _Throttled(_WARN_EVERY_SECONDS)
        # An overloaded controller sheds reports: the interval stretches by this factor (x2 per
        # shed report, back by 1/SHED_RECOVERY per accepted one) and nothing is sent before
        # _hold_until (monotonic seconds).
        self._backoff = 1.0
        self._hold_until = 0.0

        # Counters (read them from any thread; written by one thread each).
        self.dropped = 0  # payloads dropped because the queue was full
        self.records_dropped = 0  # records in those payloads
        self.reports_sent = 0
        self.heartbeats_sent = 0
        self.reports_accepted = 0
        self.reports_rejected = 0
        self.reports_shed = 0  # answered RESOURCE_EXHAUSTED, queued again
        self.unanswered = 0  # reports and heartbeats in flight on a stream that broke
        self.connects = 0  # HelloAcks received
        self.last_hello_ack: HelloAck | None = None
        self._stream: _Stream | None = None

        self._thread = threading.Thread(
            target=self._run, name=f"specpilot-link-{self._engine_id}", daemon=True)
        if start:
            self.start()

    # --- caller side ---------------------------------------------------------------------------
    def start(self) -> None:
        """Start the sender thread (idempotent; a no-op after ``stop`` or without a target)."""
        if not self.target:
            return
        with self._cond:
            if self._thread.ident is None and not self._stop.is_set():
                self._thread.start()

    @property
    def connected(self) -> bool:
        """True between a HelloAck and the end of its stream."""
        return self._connected

    @property
    def report_interval_seconds(self) -> float:
        """How often the scheduler should submit: the controller's HelloAck value once known,
        stretched while the controller sheds reports."""
        return self._interval * self._backoff

    @property
    def queued(self) -> int:
        return len(self._queue)

    @property
    def in_flight(self) -> int:
        """Messages on the live stream not answered yet (0 between streams)."""
        stream = self._stream
        return 0 if stream is None or stream.ended.is_set() else len(stream.in_flight)

    def submit(self, payload: ReportPayload) -> None:
        """Queue a payload for the controller; never blocks, never raises. When the queue is
        full the oldest payload is dropped and counted."""
        try:
            version = self._view.version
            with self._cond:
                if len(self._queue) >= self._queue_size:
                    old, _ = self._queue.popleft()
                    self.dropped += 1
                    self.records_dropped += old.record_count
                    self._records_dropped_unreported += old.record_count
                self._queue.append((payload, version))
                self._last_running = payload.running_requests
                self._cond.notify()
        except Exception:
            log.debug("submit failed", exc_info=True)

    def stop(self, timeout: float = 1.0) -> None:
        """End the stream and the thread (waits at most ``timeout`` seconds for it)."""
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        call = self._call
        if call is not None:
            call.cancel()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    # --- sender thread -------------------------------------------------------------------------
    def _run(self) -> None:
        failures = 0
        while not self._stop.is_set():
            stream = self._stream = _Stream()
            try:
                self._serve(stream)
            except Exception:  # a bug here must not end the thread: log, back off, retry
                log.exception("specpilot: controller link failed unexpectedly")
            finally:
                self._connected = False
                stream.ended.set()
                with self._cond:
                    self._cond.notify_all()
            if self._stop.is_set():
                break
            failures = 0 if stream.acked else failures + 1
            self._stop.wait(backoff_delay(failures, self._config.reconnect_initial_seconds,
                                          self._config.reconnect_max_seconds, self._rng))

    def _serve(self, stream: _Stream) -> None:
        """One Connect call, from the hello to the end of the stream."""
        token = self._token()
        channel = self._open_channel() if token is not None else None
        if channel is None:
            return
        try:
            connect = channel.stream_stream(
                CONNECT_METHOD,
                request_serializer=engine_pb2.ConnectRequest.SerializeToString,
                response_deserializer=engine_pb2.ConnectResponse.FromString,
            )
            metadata = (("authorization", f"Bearer {token}"),) if token else None
            responses = cast(Any, connect(self._requests(stream), metadata=metadata))
            self._call = responses
            if self._stop.is_set():
                responses.cancel()
            for msg in responses:
                self._handle(msg, stream)
            if not self._stop.is_set():
                log.warning("specpilot: controller %s ended the stream; reconnecting", self.target)
        except grpc.RpcError as exc:
            if not self._stop.is_set():
                self._log_failure(exc, stream)
        finally:
            self._call = None
            stream.ended.set()
            with self._cond:
                self._count_unanswered(stream)
                self._cond.notify_all()
            channel.close()

    def _count_unanswered(self, stream: _Stream) -> None:
        """Reports a broken stream never answered are not sent again (the controller may have
        applied them: sending them again could count them twice); they are counted, and their
        records reported as dropped to the next stream. Call with the lock held."""
        for _, item in stream.in_flight:
            self.unanswered += 1
            if item is not None:
                self.records_dropped += item[0].record_count
                self._records_dropped_unreported += item[0].record_count
        stream.in_flight.clear()

    def _token(self) -> str | None:
        """The stream's bearer token: SPECPILOT_PLUGIN_TOKEN, or the content of _TOKEN_FILE read
        now (so a re-issued one is picked up); "" for none. None, logged at ERROR once per
        outage, when the file cannot be read or is empty: the attempt counts as failed."""
        path = self._config.token_file
        if not path:
            return self._config.token
        try:
            token = Path(path).read_text().strip()
        except OSError as exc:
            self._unusable(env_name("token_file"), str(exc))
            return None
        if not token:
            self._unusable(env_name("token_file"), f"{path} is empty")
            return None
        return token

    def _unusable(self, what: str, why: str) -> None:
        """A connect attempt could not start because ``what`` cannot be used: at ERROR once per
        outage, then at debug level."""
        if not self._outage_warned:
            self._outage_warned = True
            log.error("specpilot: controller %s: cannot use %s: %s; retrying with backoff (the "
                      "engine keeps the last policy, then its static configuration)",
                      self.target, what, why)
        else:
            log.debug("specpilot: controller %s: %s still unusable: %s", self.target, what, why)

    def _open_channel(self) -> grpc.Channel | None:
        """A channel for one attempt: TLS with SPECPILOT_PLUGIN_TLS_CA_FILE (files read now, so
        a reconnect picks up a renewed certificate), else plaintext. None, logged at ERROR once
        per outage, when a TLS file cannot be used: the attempt counts as failed."""
        c = self._config
        if not c.tls_ca_file:
            return grpc.insecure_channel(self.target, options=CHANNEL_OPTIONS)
        try:
            credentials = channel_credentials(c.tls_ca_file, c.tls_cert_file, c.tls_key_file,
                                              names=(env_name("tls_ca_file"),
                                                     env_name("tls_cert_file"),
                                                     env_name("tls_key_file")))
        except TLSError as exc:
            self._unusable("the TLS files", str(exc))
            return None
        return grpc.secure_channel(self.target, credentials,
                                   options=[*CHANNEL_OPTIONS,
                                            *server_name_options(c.tls_server_name)])

    def _log_failure(self, exc: grpc.RpcError, stream: _Stream) -> None:
        """One warning per outage; the retries that follow log at debug level."""
        code = exc.code() if isinstance(exc, grpc.Call) else None
        details = exc.details() if isinstance(exc, grpc.Call) else str(exc)
        if stream.acked or not self._outage_warned:
            self._outage_warned = True
            # A refused hello is a configuration error, not an outage: say so louder.
            refused = code in (grpc.StatusCode.INVALID_ARGUMENT,
                               grpc.StatusCode.FAILED_PRECONDITION,
                               grpc.StatusCode.UNAUTHENTICATED,
                               grpc.StatusCode.PERMISSION_DENIED)
            lowered = (details or "").lower()
            if "handshake failed" in lowered:
                refused = True  # so is a failed TLS handshake: say where to look
                details = f"{details} ({_TLS_HINT})"
            elif "socket closed" in lowered:
                details = f"{details} ({_CLOSED_HINTS[bool(self._config.tls_ca_file)]})"
            log.log(logging.ERROR if refused else logging.WARNING,
                    "specpilot: controller %s: %s %s; reconnecting with backoff (the engine "
                    "keeps the last policy, then its static configuration)", self.target,
                    code.name if code else "", details)
        else:
            log.debug("specpilot: controller %s still unreachable: %s", self.target, details)

    def _requests(self, stream: _Stream) -> Iterator[engine_pb2.ConnectRequest]:
        """The stream's messages: the hello, then a report per payload (after the HelloAck), or
        an empty report when idle. Runs on a gRPC thread; returns when the stream ended."""
        yield self._hello
        last_sent = time.monotonic()
        while True:
            item: tuple[ReportPayload, int] | None = None
            with self._cond:
                while True:
                    if stream.ended.is_set() or self._stop.is_set():
                        return
                    if stream.acked:
                        if self._queue and time.monotonic() >= self._hold_until:
                            item = self._queue.popleft()
                            break
                        if time.monotonic() - last_sent >= self._heartbeat_seconds():
                            break
                    self._cond.wait(_POLL_SECONDS)
                dropped, self._records_dropped_unreported = self._records_dropped_unreported, 0
                running = self._last_running
            try:
                msg = self._report(stream, item, dropped, running)
            except Exception:
                log.exception("specpilot: could not build a report; payload dropped")
                continue
            last_sent = time.monotonic()
            yield msg

    def _on_shed(self, result: ReportResult, sent: tuple[ReportPayload, int] | None) -> None:
        """The controller is overloaded: send the payload again, first, after a pause (the
        longer of our own backoff and the controller's ``retry_after_seconds``, at most
        MAX_SHED_BACKOFF intervals), and stretch the interval so this engine's share of the
        load falls."""
        self.reports_shed += 1
        self._backoff = shed_backoff(self._backoff, shed=True)
        pause = shed_pause(self._interval, self._backoff, result.retry_after_seconds)
        with self._cond:
            self._hold_until = time.monotonic() + pause
            if sent is not None:
                if len(self._queue) >= self._queue_size:
                    old, _ = self._queue.pop()  # the newest goes: the shed one is older
                    self.dropped += 1
                    self.records_dropped += old.record_count
                    self._records_dropped_unreported += old.record_count
                self._queue.appendleft(sent)
            self._cond.notify_all()
        self._shed_warning.warn(
            "specpilot: controller %s is overloaded and shed report %d (%s); sending it again "
            "and reporting every %.3g s for now", self.target, result.sequence, result.reason,
            self.report_interval_seconds)

    def _heartbeat_seconds(self) -> float:
        return min(_HEARTBEAT_INTERVALS * self._interval,
                   self._view.fail_static_timeout_seconds / 3.0)

    def _report(self, stream: _Stream, item: tuple[ReportPayload, int] | None, dropped: int,
                running: int) -> engine_pb2.ConnectRequest:
        stream.sequence += 1
        if item is None:
            payload, version = ReportPayload.heartbeat(running), self._view.version
            self.heartbeats_sent += 1
        else:
            payload, version = item
            if payload.ignored_records:
                log.debug("specpilot: %d invalid records left out of report %d",
                          payload.ignored_records, stream.sequence)
            self.reports_sent += 1
        with self._cond:
            stream.in_flight.append((stream.sequence, item))
            if len(stream.in_flight) > _IN_FLIGHT_KEPT:
                stream.in_flight.popleft()
        # Bucketed now, under the bounds of the controller this stream reaches.
        report = payload.report(stream.sequence, version, dropped, self._view.bucket_bounds)
        return engine_pb2.ConnectRequest(report=engine_stream.report_to_proto(report))

    # --- messages from the controller ----------------------------------------------------------
    def _handle(self, msg: engine_pb2.ConnectResponse, stream: _Stream) -> None:
        try:
            self._view.heard_from_controller()
            record = engine_stream.controller_message_from_proto(msg)
            if isinstance(record, HelloAck):
                self._on_hello_ack(record, stream)
            elif isinstance(record, PolicyUpdate):
                self._view.apply(record)
            elif isinstance(record, ReportResult):
                self._on_result(record, stream)
        except Exception:  # one odd message must not cost the stream
            log.exception("specpilot: could not apply a controller message")

    def _on_hello_ack(self, ack: HelloAck, stream: _Stream) -> None:
        if math.isfinite(ack.report_interval_seconds) and ack.report_interval_seconds > 0:
            self._interval = ack.report_interval_seconds
        if ack.batch_bucket_upper_bounds:
            try:
                self._view.set_bucket_bounds(ack.batch_bucket_upper_bounds)
            except ValueError as exc:
                log.error("specpilot: controller %s sent bad bucket bounds (%s); keeping %s",
                          self.target, exc, self._view.bucket_bounds)
        for name, why in ack.rejected_drafts:
            log.error("specpilot: controller %s REFUSED draft %r: %s. The controller will not "
                      "choose it for this engine.", self.target, name, why)
        previous = self.last_hello_ack
        if previous is not None and ack.policy_epoch != previous.policy_epoch:
            # A restarted controller: its class table starts afresh, so names the old one
            # folded into "other" may be tracked now. Its versions continue above the old ones.
            log.info("specpilot: controller %s restarted (policy epoch %d -> %d); classes it "
                     "folded are forgotten", self.target, previous.policy_epoch,
                     ack.policy_epoch)
            self._view.forget_folded_classes()
        self.last_hello_ack = ack
        self.connects += 1
        self._outage_warned = False
        log.info("specpilot: engine %s connected to controller %s (version %s), drafts %s, "
                 "report interval %.3g s", self._engine_id, self.target, ack.controller_version,
                 list(ack.accepted_drafts), self._interval)
        if self._on_ack is not None:
            try:
                self._on_ack(ack)
            except Exception:
                log.exception("specpilot: on_hello_ack callback failed")
        with self._cond:
            stream.acked = True
            self._connected = True
            self._cond.notify_all()

    def _on_result(self, result: ReportResult, stream: _Stream) -> None:
        with self._cond:
            sent = None
            while stream.in_flight and stream.in_flight[0][0] <= result.sequence:
                seq, item = stream.in_flight.popleft()
                sent = item if seq == result.sequence else None
        if result.accepted:
            self.reports_accepted += 1
            self._backoff = shed_backoff(self._backoff, shed=False)
        elif result.code == engine_stream.REPORT_SHED_CODE:
            self._on_shed(result, sent)
        else:
            self.reports_rejected += 1
            self._rejected_warning.warn(
                "specpilot: controller %s rejected report %d (code %d): %s", self.target,
                result.sequence, result.code, result.reason)
        if result.folded_classes:
            self._view.set_folded_classes(result.folded_classes)
