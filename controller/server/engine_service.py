"""specpilot.v1.EngineService: one long-lived bidirectional stream per engine.

The engine opens with a hello and gets a HelloAck and the current policy. Each report then gets a
ReportResult. A bad report is answered with code INVALID_ARGUMENT and a reason, and nothing of it
is applied; the stream stays up, because one bad record from a plugin bug must not cut the engine
off its policy. Policy updates are pushed whenever the policy version moves (see ``Hub``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

import grpc

from controller.core.controller import ControllerCore
from controller.core.types import ImplausibleInput, ReportRejected
from controller.metrics import Metrics, RejectReason
from controller.server.auth import bearer_verdict, metadata_authorization
from controller.server.hub import EngineSession, Hub
from controller.wire import hello_ack_to_proto, hello_from_proto, report_from_proto
from specpilot.v1 import engine_pb2

log = logging.getLogger(__name__)

Context = grpc.aio.ServicerContext[engine_pb2.ConnectRequest, engine_pb2.ConnectResponse]


class EngineService:
    def __init__(
        self,
        core: ControllerCore,
        hub: Hub,
        metrics: Metrics,
        *,
        controller_version: str,
        report_interval_seconds: float,
        max_report_bytes: int,
        clock: Callable[[], float],
        engine_token: str = "",
    ) -> None:
        """``engine_token``: the bearer token a stream must present (empty: none needed)."""
        self._token = engine_token.encode()
        self._core = core
        self._hub = hub
        self._metrics = metrics
        self._version = controller_version
        self._interval = report_interval_seconds
        self._max_bytes = max_report_bytes
        self._clock = clock

    async def Connect(
        self, request_iterator: AsyncIterator[engine_pb2.ConnectRequest], context: Context
    ) -> AsyncIterator[engine_pb2.ConnectResponse]:
        if self._token:
            await self._authenticate(context)
        requests = aiter(request_iterator)
        first = await anext(requests, None)
        if first is None:
            return
        session = await self._hello(first, context)
        reader = asyncio.create_task(self._read(requests, session))
        try:
            async for msg in session.responses(context, self._hub.policy_message):
                yield msg
        finally:
            reader.cancel()
            self._hub.close_session(session)

    async def _authenticate(self, context: Context) -> None:
        """Before anything of the stream is read: missing token -> UNAUTHENTICATED, wrong ->
        PERMISSION_DENIED (compared in constant time), so no one without it can register an
        engine, take over an engine id or move an estimate."""
        verdict = bearer_verdict(metadata_authorization(context.invocation_metadata()),
                                 self._token)
        if verdict == "unauthenticated":
            self._metrics.hello(verdict)
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                "engine streams need metadata 'authorization: Bearer <token>' "
                                "(the plugin's SPECPILOT_PLUGIN_TOKEN)")
        if verdict == "permission_denied":
            self._metrics.hello(verdict)
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, "engine token does not match")

    async def _hello(self, msg: engine_pb2.ConnectRequest, context: Context) -> EngineSession:
        """Register the engine and queue its HelloAck and policy; abort the stream if the first
        message is not a valid hello."""
        kind = msg.WhichOneof("message")
        if kind != "hello":
            self._metrics.report_received()
            self._metrics.report_rejected("before_hello")
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"the first message on a stream must be a hello, got {kind or 'an empty message'}")
        now = self._clock()
        try:
            hello = hello_from_proto(msg.hello)
            outcome = self._core.connect_engine(hello, now)
        except ReportRejected as exc:
            self._metrics.hello("rejected")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        self._metrics.hello("accepted")
        for name, why in outcome.rejected_drafts:
            log.warning("engine %s: draft %s refused: %s", hello.engine_id, name, why)
        session = self._hub.open_session(hello.engine_id)
        cfg = self._core.config
        session.send(engine_pb2.ConnectResponse(hello_ack=hello_ack_to_proto(
            outcome,
            controller_version=self._version,
            report_interval_seconds=self._interval,
            batch_bucket_upper_bounds=cfg.batch_bucket_upper_bounds,
            max_classes=cfg.max_classes,
        )))
        # The new engine's drafts may change decisions; either way it gets the policy once.
        self._hub.decide(now)
        session.push_policy()
        return session

    async def _read(
        self, requests: AsyncIterator[engine_pb2.ConnectRequest], session: EngineSession
    ) -> None:
        try:
            async for msg in requests:
                if session.outbox.closed:
                    return
                self._handle(msg, session)
        except asyncio.CancelledError:
            raise
        except Exception:
            if session.outbox.closed:  # ended on purpose (replaced, or dropped as silent)
                return
            # A bug must end the stream visibly (the engine reconnects) rather than leave the
            # engine waiting for results that never come.
            log.exception("engine %s: stream failed", session.engine_id)
            session.outbox.close(grpc.StatusCode.INTERNAL, "controller error; see its log")
            return
        session.outbox.close()  # the engine half-closed: end the stream with OK

    def _handle(self, msg: engine_pb2.ConnectRequest, session: EngineSession) -> None:
        self._metrics.report_received()
        kind = msg.WhichOneof("message")
        if kind != "report":
            what = "a second hello" if kind == "hello" else "an empty message"
            self._reject(session, 0, "validation", f"message: expected a report, got {what}")
            return
        report = msg.report
        size = report.ByteSize()
        if size > self._max_bytes:
            self._reject(session, report.sequence, "oversized",
                         f"report: {size} bytes exceeds max_report_bytes {self._max_bytes}")
            return
        now = self._clock()
        try:
            result = self._core.ingest(session.engine_id, report_from_proto(report), now)
        except ReportRejected as exc:
            category: RejectReason = ("implausible" if isinstance(exc, ImplausibleInput)
                                      else "validation")
            self._reject(session, report.sequence, category, str(exc))
            return
        self._metrics.report_accepted(report.records_dropped, len(result.folded_classes),
                                      result.step_predictions)
        session.send(engine_pb2.ConnectResponse(report_result=engine_pb2.ReportResult(
            sequence=report.sequence, accepted=True, code=grpc.StatusCode.OK.value[0],
            folded_classes=result.folded_classes)))
        self._hub.decide_soon()

    def _reject(self, session: EngineSession, sequence: int, category: RejectReason,
                reason: str) -> None:
        self._metrics.report_rejected(category)
        session.send(engine_pb2.ConnectResponse(report_result=engine_pb2.ReportResult(
            sequence=sequence, accepted=False, code=grpc.StatusCode.INVALID_ARGUMENT.value[0],
            reason=reason)))
