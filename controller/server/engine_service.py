"""specpilot.v1.EngineService: one long-lived bidirectional stream per engine.

The engine opens with a hello and gets a HelloAck and the current policy. Each report then gets a
ReportResult. A bad report is answered with code INVALID_ARGUMENT and a reason, and nothing of it
is applied; the stream stays up, because one bad record from a plugin bug must not cut the engine
off its policy. Policy updates are pushed whenever the policy version moves (see ``Hub``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc

from specpilot.contract.engine_stream import REPORT_SHED_CODE, hello_from_proto, report_from_proto
from specpilot.contract.records import BeyondRate, ImplausibleInput, ReportRejected
from specpilot.controller.core.controller import ControllerCore
from specpilot.controller.logsafe import safe_name
from specpilot.controller.metrics import Metrics, RejectReason
from specpilot.controller.server.auth import (
    bearer_verdict,
    certificate_names,
    engine_token,
    metadata_authorization,
)
from specpilot.controller.server.hub import EngineSession, Hub
from specpilot.controller.server.overload import ReportBudget
from specpilot.controller.server.stubs import parse
from specpilot.controller.wire import hello_ack_to_proto
from specpilot.v1 import engine_pb2

log = logging.getLogger(__name__)

# Requests arrive as bytes (``stubs.add_engine_service``) and are parsed by ``_messages``.
Context = grpc.aio.ServicerContext[bytes, engine_pb2.ConnectResponse]
Parsed = engine_pb2.ConnectRequest | str  # a message, or why the bytes were not one


async def _messages(raw: AsyncIterator[bytes]) -> AsyncIterator[Parsed]:
    """The stream's messages parsed; one that does not parse as why, named by its place."""
    n = 0
    async for data in raw:
        n += 1
        msg = parse(engine_pb2.ConnectRequest, data)
        yield f"message {n}: {msg}" if isinstance(msg, str) else msg


@dataclass(frozen=True)
class ClientCertificates:
    """mTLS for engine streams: each must come with a client certificate that gRPC verified
    against the client CA at the handshake. ``bind_engine_id``: the hello's engine_id must be
    one of the certificate's names (common name or a subject alternative name). ``where``: how
    an engine gets one checked, said in the refusal."""

    bind_engine_id: bool = False
    where: str = ""


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
        engine_secret: str = "",
        engine_token: str = "",
        client_certificates: ClientCertificates | None = None,
        budget: ReportBudget | None = None,
    ) -> None:
        """``engine_secret``: a stream must present the token of the engine id its hello names
        (``auth.engine_token``); ``engine_token``: the one token every stream must present
        (empty: none needed). ``client_certificates``: streams need a verified client
        certificate (None: not). ``budget``: the loop time reports may take; beyond it they are
        shed (None: never)."""
        self._budget = budget
        self._secret = engine_secret
        self._token = engine_token.encode()
        self._certificates = client_certificates
        self._core = core
        self._hub = hub
        self._metrics = metrics
        self._version = controller_version
        self._interval = report_interval_seconds
        self._max_bytes = max_report_bytes
        self._clock = clock

    async def Connect(
        self, request_iterator: AsyncIterator[bytes], context: Context
    ) -> AsyncIterator[engine_pb2.ConnectResponse]:
        names = await self._check_certificate(context) if self._certificates else None
        authorization = metadata_authorization(context.invocation_metadata())
        if self._token or self._secret:
            await self._authenticate(authorization, context)
        requests = _messages(request_iterator)
        first = await anext(requests, None)
        if first is None:
            return
        if isinstance(first, str):
            self._metrics.hello("rejected")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, first)
        identified = await self._identify(first, authorization, names, context)
        session = await self._hello(first, identified, context)
        del first  # the hello is learnt: not held for the stream's life (its profile weighs)
        reader = asyncio.create_task(self._read(requests, session))
        try:
            async for msg in session.responses(context, self._hub.policy_message):
                yield msg
        finally:
            reader.cancel()
            self._hub.close_session(session)

    async def _authenticate(self, authorization: str | None, context: Context) -> None:
        """Before anything of the stream is read: missing token -> UNAUTHENTICATED; with the
        shared engine_token, a wrong one -> PERMISSION_DENIED (compared in constant time). An
        engine's own token is checked against the id its hello names (``_identify``)."""
        verdict = bearer_verdict(authorization, self._token) if self._token else (
            "unauthenticated" if not authorization else "ok")
        if verdict == "unauthenticated":
            self._metrics.hello(verdict)
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                "engine streams need metadata 'authorization: Bearer <token>' "
                                "(the plugin's SPECPILOT_PLUGIN_TOKEN or _TOKEN_FILE)")
        if verdict == "permission_denied":
            self._metrics.hello(verdict)
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, "engine token does not match")

    async def _check_certificate(self, context: Context) -> frozenset[str]:
        """Before anything of the stream is read: no verified client certificate ->
        UNAUTHENTICATED. The certificate's names, for ``_identify``."""
        names = certificate_names(context.auth_context())
        if names is None:
            self._metrics.hello("unauthenticated")
            where = self._certificates.where if self._certificates else ""
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                "engine streams need a client certificate signed by the "
                                "controller's tls_client_ca_file (the plugin's "
                                "SPECPILOT_PLUGIN_TLS_CERT_FILE and _KEY_FILE)"
                                + (f"; {where}" if where else ""))
        return names

    async def _identify(self, first: engine_pb2.ConnectRequest, authorization: str | None,
                        names: frozenset[str] | None, context: Context) -> bool:
        """Whether the stream proved it is the engine its hello names: with engine_secret, by
        that id's own token; with ``bind_engine_id``, by a client certificate naming the id.
        Either one failing -> PERMISSION_DENIED, so no engine's credential opens another's id.
        False when no credential names engines (or the first message is no hello, which
        ``_hello`` refuses)."""
        if first.WhichOneof("message") != "hello":
            return False
        engine_id = first.hello.engine_id
        shown = repr(engine_id[:200])
        if self._secret:
            own = engine_token(self._secret, engine_id).encode()
            if bearer_verdict(authorization, own) != "ok":
                self._metrics.hello("permission_denied")
                await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                    f"the stream's token is not engine_id {shown}'s: each "
                                    "engine presents its own (`specpilot engine-token --id "
                                    "ID` derives it from the controller's engine_secret)")
        bound = bool(self._certificates and self._certificates.bind_engine_id)
        if bound and names is not None and engine_id not in names:
            self._metrics.hello("permission_denied")
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                f"engine_id {shown} is not a name of the stream's client "
                                "certificate (tls_bind_engine_id: its common name or a subject "
                                "alternative name)")
        return bool(self._secret) or bound

    async def _hello(self, msg: engine_pb2.ConnectRequest, identified: bool,
                     context: Context) -> EngineSession:
        """Register the engine and queue its HelloAck and policy; abort the stream if the first
        message is not a valid hello, or names a connected engine's id without proving it is
        that engine (``identified``): a newer stream replaces a live one only with the id's own
        credential, so no other stream can take over a connected engine."""
        kind = msg.WhichOneof("message")
        if kind != "hello":
            self._metrics.report_received()
            self._metrics.report_rejected("before_hello")
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"the first message on a stream must be a hello, got {kind or 'an empty message'}")
        if not identified and self._hub.connected(msg.hello.engine_id):
            self._metrics.hello("already_connected")
            await context.abort(
                grpc.StatusCode.ALREADY_EXISTS,
                f"engine_id {msg.hello.engine_id[:200]!r} is connected on another stream, and "
                "this one carries no credential of that id (engine_secret's per-engine token, "
                "or a client certificate with tls_bind_engine_id), so it cannot replace it; "
                "retry once the old stream has ended (a silent one is ended after "
                "engine_silence_timeout_seconds)")
        now = self._clock()
        try:
            hello = hello_from_proto(msg.hello)
            outcome = self._core.connect_engine(hello, now)
        except ReportRejected as exc:
            self._metrics.hello("rejected")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        self._metrics.hello("accepted")
        for name, why in outcome.rejected_drafts:
            log.warning("engine %s: draft %s refused: %s", safe_name(hello.engine_id),
                        safe_name(name), safe_name(why, 300))
        session = self._hub.open_session(hello.engine_id)
        cfg = self._core.config
        session.send(engine_pb2.ConnectResponse(hello_ack=hello_ack_to_proto(
            outcome,
            controller_version=self._version,
            report_interval_seconds=self._interval,
            batch_bucket_upper_bounds=cfg.batch_bucket_upper_bounds,
            max_classes=cfg.max_classes,
            policy_epoch=self._core.epoch,
        )))
        # The new engine's drafts may change decisions; either way it gets the policy once.
        self._hub.decide(now)
        session.push_policy()
        return session

    async def _read(self, requests: AsyncIterator[Parsed], session: EngineSession) -> None:
        try:
            async for msg in requests:
                if session.outbox.closed:
                    return
                if isinstance(msg, str):  # not a message: a bad report like any other
                    self._metrics.report_received()
                    self._reject(session, 0, "validation", msg)
                    continue
                self._handle(msg, session)
        except asyncio.CancelledError:
            raise
        except Exception:
            if session.outbox.closed:  # ended on purpose (replaced, or dropped as silent)
                return
            # A bug must end the stream visibly (the engine reconnects) rather than leave the
            # engine waiting for results that never come.
            log.exception("engine %s: stream failed", safe_name(session.engine_id))
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
        budget = self._budget
        has_records = bool(report.acceptance or report.finished or report.step_timings)
        if budget is not None and has_records and not budget.admit():
            self._shed(session, report.sequence, budget.retry_after_seconds(), now)
            return
        started = time.perf_counter()
        try:
            result = self._core.ingest(session.engine_id, report_from_proto(report), now)
        except ReportRejected as exc:
            category: RejectReason = (
                "beyond_rate" if isinstance(exc, BeyondRate)
                else "implausible" if isinstance(exc, ImplausibleInput) else "validation")
            self._reject(session, report.sequence, category, str(exc))
            return
        finally:
            if budget is not None and has_records:  # heartbeats are taken free
                budget.spend(time.perf_counter() - started)
        self._metrics.report_accepted(report.records_dropped, len(result.folded_classes),
                                      result.step_predictions, result.step_costs_changed)
        if result.step_costs_changed:
            log.warning("engine %s: step times left the cost model's predictions; the step-cost "
                        "evidence was mostly forgotten and is relearnt from its next steps "
                        "(specpilot_cost_model_changes_detected_total)",
                        safe_name(session.engine_id))
        session.send(engine_pb2.ConnectResponse(report_result=engine_pb2.ReportResult(
            sequence=report.sequence, accepted=True, code=grpc.StatusCode.OK.value[0],
            folded_classes=result.folded_classes)))
        if has_records:  # a heartbeat brings nothing to decide on
            self._hub.decide_soon()

    def _shed(self, session: EngineSession, sequence: int, retry_after: float,
              now: float) -> None:
        """Over the report budget: answer at once, apply nothing. The engine keeps the payload
        and sends it again later, and it counts as heard from (not silent)."""
        self._metrics.report_shed()
        self._core.heard_from(session.engine_id, now)
        session.send(engine_pb2.ConnectResponse(report_result=engine_pb2.ReportResult(
            sequence=sequence, accepted=False,
            code=REPORT_SHED_CODE, retry_after_seconds=retry_after,
            reason=f"controller overloaded: report shed, nothing applied; send it again in "
                   f"{retry_after:.2f} s or later")))

    def _reject(self, session: EngineSession, sequence: int, category: RejectReason,
                reason: str) -> None:
        self._metrics.report_rejected(category)
        session.send(engine_pb2.ConnectResponse(report_result=engine_pb2.ReportResult(
            sequence=sequence, accepted=False, code=grpc.StatusCode.INVALID_ARGUMENT.value[0],
            reason=reason)))
