"""specpilot.v1.PolicyService: read the policy and its estimates, override it, watch and explain.

Writes need metadata ``authorization: Bearer <token>``: missing -> UNAUTHENTICATED, wrong ->
PERMISSION_DENIED. The token is compared in constant time.

An override's scope is the pod (this controller) or the fleet (every controller of the model,
through the state store); unspecified means the fleet where a shared store is configured.
"""

from __future__ import annotations

import dataclasses
import hmac
from collections.abc import AsyncIterator, Callable
from typing import Any, NoReturn

import grpc

from controller.core.controller import ControllerCore
from controller.core.types import DecisionEvent, OverrideScope
from controller.metrics import Metrics
from controller.server.explain import explanation_text
from controller.server.fleet import FleetSync
from controller.server.hub import Hub
from controller.server.views import policy_response
from controller.store.base import StoreUnavailable
from controller.wire import (
    event_to_proto,
    explanation_to_proto,
    override_from_proto,
    recommendations_to_proto,
    scope_from_proto,
)
from specpilot.v1 import policy_pb2

Context = grpc.aio.ServicerContext[Any, Any]


class PolicyService:
    def __init__(self, core: ControllerCore, hub: Hub, metrics: Metrics, token: str,
                 clock: Callable[[], float], sidecar: str,
                 fleet: FleetSync | None = None) -> None:
        """``sidecar``: this controller's name, kept with the overrides it takes; ``fleet``:
        the state-store edge, None where no shared store is configured."""
        self._core = core
        self._hub = hub
        self._metrics = metrics
        self._token = token.encode()
        self._clock = clock
        self._sidecar = sidecar
        self._fleet = fleet

    async def _scope(self, value: int, context: Context) -> OverrideScope:
        try:
            scope = scope_from_proto(value)
        except ValueError as exc:
            await self._invalid(context, str(exc))
        if scope is None:
            return OverrideScope.FLEET if self._fleet is not None else OverrideScope.POD
        if scope is OverrideScope.FLEET and self._fleet is None:
            await self._invalid(context, "scope: fleet overrides need a shared state store "
                                         "(state_store is 'memory'); use scope pod")
        return scope

    async def _unavailable(self, context: Context, exc: StoreUnavailable) -> NoReturn:
        self._metrics.policy_write("unavailable")
        await context.abort(grpc.StatusCode.UNAVAILABLE,
                            f"the state store did not take the fleet override ({exc}); nothing "
                            "changed: retry, or use scope pod")

    async def _authorize(self, context: Context) -> None:
        values = [v for k, v in context.invocation_metadata() or () if k == "authorization"]
        if not values:
            self._metrics.policy_write("unauthenticated")
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                "policy writes need metadata 'authorization: Bearer <token>'")
        value = values[0]
        scheme, _, token = (value.decode() if isinstance(value, bytes) else value).partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(),
                                                                 self._token):
            self._metrics.policy_write("permission_denied")
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, "bearer token does not match")

    async def _invalid(self, context: Context, reason: str) -> NoReturn:
        self._metrics.policy_write("invalid")
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, reason)

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
        await self._authorize(context)
        now = self._clock()
        if not request.HasField("override"):
            await self._invalid(context, "override: must be set")
        scope = await self._scope(request.override.scope, context)
        try:
            override = dataclasses.replace(override_from_proto(request.override), set_at=now,
                                           scope=scope, set_by=self._sidecar)
            if self._fleet is not None and scope is OverrideScope.FLEET:
                await self._fleet.set_override(override)
            else:
                self._core.set_override(override)
        except ValueError as exc:  # ReportRejected (bad class name) is a ValueError too
            await self._invalid(context, str(exc))
        except StoreUnavailable as exc:
            await self._unavailable(context, exc)
        self._metrics.policy_write("ok")
        self._hub.decide(now)
        return policy_pb2.SetOverrideResponse(policy_version=self._core.version)

    async def ClearOverride(
        self, request: policy_pb2.ClearOverrideRequest, context: Context
    ) -> policy_pb2.ClearOverrideResponse:
        await self._authorize(context)
        if not request.traffic_class:
            await self._invalid(context, "traffic_class: must not be empty (use '*' for all)")
        scope = await self._scope(request.scope, context)
        try:
            if self._fleet is not None and scope is OverrideScope.FLEET:
                cleared = await self._fleet.clear_override(request.traffic_class)
            else:
                cleared = self._core.clear_override(request.traffic_class, scope)
        except ValueError as exc:
            await self._invalid(context, str(exc))
        except StoreUnavailable as exc:
            await self._unavailable(context, exc)
        self._metrics.policy_write("ok")
        if cleared:
            self._hub.decide(self._clock())
        return policy_pb2.ClearOverrideResponse(policy_version=self._core.version, cleared=cleared)

    async def WatchDecisions(
        self, request: policy_pb2.WatchDecisionsRequest, context: Context
    ) -> AsyncIterator[policy_pb2.WatchDecisionsResponse]:
        replay, watcher = self._hub.watch(request.traffic_class)
        try:
            for e in replay:
                yield _watch_response(e)
            async for e in watcher.outbox.drain(context):
                yield _watch_response(e)
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


def _watch_response(e: DecisionEvent) -> policy_pb2.WatchDecisionsResponse:
    return policy_pb2.WatchDecisionsResponse(event=event_to_proto(e))
