"""specpilot.v1.PolicyService: read the policy and its estimates, override it, watch and explain.

Writes need metadata ``authorization: Bearer <token>``: missing -> UNAUTHENTICATED, wrong ->
PERMISSION_DENIED; the checks, the scopes and the audit log are
``specpilot.controller.server.policy_writes`` (the dashboard's controls share them).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any, NoReturn

import grpc

from specpilot.controller.core.controller import ControllerCore
from specpilot.controller.server.auth import metadata_authorization
from specpilot.controller.server.explain import explanation_text
from specpilot.controller.server.fleet import FleetSync
from specpilot.controller.server.hub import Hub, WatchersFull
from specpilot.controller.server.policy_writes import PolicyWriter, WriteRefused
from specpilot.controller.server.views import policy_response
from specpilot.controller.wire import explanation_to_proto, recommendations_to_proto
from specpilot.v1 import policy_pb2

Context = grpc.aio.ServicerContext[Any, Any]
_STATUS = {
    "unauthenticated": grpc.StatusCode.UNAUTHENTICATED,
    "permission_denied": grpc.StatusCode.PERMISSION_DENIED,
    "invalid": grpc.StatusCode.INVALID_ARGUMENT,
    "unavailable": grpc.StatusCode.UNAVAILABLE,
}


class PolicyService:
    def __init__(self, core: ControllerCore, hub: Hub, writer: PolicyWriter,
                 clock: Callable[[], float], fleet: FleetSync | None = None) -> None:
        """``fleet``: the state-store edge, None where no shared store is configured."""
        self._core = core
        self._hub = hub
        self._writer = writer
        self._clock = clock
        self._fleet = fleet

    async def _refused(self, context: Context, exc: WriteRefused) -> NoReturn:
        await context.abort(_STATUS[exc.kind], exc.reason)

    async def GetPolicy(
        self, request: policy_pb2.GetPolicyRequest, context: Context
    ) -> policy_pb2.GetPolicyResponse:
        try:
            return policy_response(self._core.snapshot(self._clock()), request.traffic_class)
        except KeyError as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(exc.args[0]))

    async def SetOverride(
        self, request: policy_pb2.SetOverrideRequest, context: Context
    ) -> policy_pb2.SetOverrideResponse:
        try:
            auth = metadata_authorization(context.invocation_metadata())
            return await self._writer.set_override(request, auth, f"grpc {context.peer()}")
        except WriteRefused as exc:
            await self._refused(context, exc)

    async def ClearOverride(
        self, request: policy_pb2.ClearOverrideRequest, context: Context
    ) -> policy_pb2.ClearOverrideResponse:
        try:
            auth = metadata_authorization(context.invocation_metadata())
            return await self._writer.clear_override(request, auth, f"grpc {context.peer()}")
        except WriteRefused as exc:
            await self._refused(context, exc)

    async def WatchDecisions(
        self, request: policy_pb2.WatchDecisionsRequest, context: Context
    ) -> AsyncIterator[bytes]:
        """Serialized WatchDecisionsResponse messages (``Hub.watch_message``)."""
        try:
            # The peer's address without its port ("ipv4:10.0.0.7:53412" -> "ipv4:10.0.0.7").
            client = context.peer().rpartition(":")[0]
            replay, watcher = self._hub.watch(request.traffic_class, client)
        except WatchersFull as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        try:
            for e in replay:
                yield self._hub.watch_message(e)
            async for data in watcher.outbox.drain(context):
                yield data
        finally:
            self._hub.unwatch(watcher)

    async def ExplainDecision(
        self, request: policy_pb2.ExplainDecisionRequest, context: Context
    ) -> policy_pb2.ExplainDecisionResponse:
        name, bucket, now = request.traffic_class, request.batch_bucket, self._clock()
        snap = self._core.snapshot(now)
        try:
            snap.class_view(name)
        except KeyError as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(exc.args[0]))
        if bucket >= snap.n_buckets:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"batch_bucket: {bucket} outside 0..{snap.n_buckets - 1}")
        ex = self._core.explain(name, bucket, now)
        return explanation_to_proto(ex, explanation_text(ex))

    async def GetRecommendations(
        self, request: policy_pb2.GetRecommendationsRequest, context: Context
    ) -> policy_pb2.GetRecommendationsResponse:
        if self._fleet is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "recommendations compare the sidecars of a fleet: configure a "
                                "shared state store (state_store)")
        return recommendations_to_proto(self._fleet.recommendations, request.traffic_class,
                                        self._fleet.recommended_at)
