"""Typed handles on the generated ``*_pb2_grpc`` modules.

grpcio-tools emits those modules without annotations, so under ``mypy --strict`` every call into
them is an untyped call and every stub method is ``Any``. The Protocols below state the real
request and response types once; servers, the CLI and the tests go through these functions.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, cast

import grpc

from specpilot.v1 import engine_pb2, engine_pb2_grpc, policy_pb2, policy_pb2_grpc

# Untyped generated callables, bound once to annotated names (assignment is not an untyped call).
_add_engine: Callable[[Any, grpc.aio.Server], None] = (
    engine_pb2_grpc.add_EngineServiceServicer_to_server)
_add_policy: Callable[[Any, grpc.aio.Server], None] = (
    policy_pb2_grpc.add_PolicyServiceServicer_to_server)
_engine_stub: Callable[[Any], Any] = engine_pb2_grpc.EngineServiceStub
_policy_stub: Callable[[Any], Any] = policy_pb2_grpc.PolicyServiceStub


class EngineStub(Protocol):
    Connect: grpc.aio.StreamStreamMultiCallable[engine_pb2.ConnectRequest,
                                                engine_pb2.ConnectResponse]


class AsyncPolicyStub(Protocol):
    GetPolicy: grpc.aio.UnaryUnaryMultiCallable[policy_pb2.GetPolicyRequest,
                                                policy_pb2.GetPolicyResponse]
    SetOverride: grpc.aio.UnaryUnaryMultiCallable[policy_pb2.SetOverrideRequest,
                                                  policy_pb2.SetOverrideResponse]
    ClearOverride: grpc.aio.UnaryUnaryMultiCallable[policy_pb2.ClearOverrideRequest,
                                                    policy_pb2.ClearOverrideResponse]
    WatchDecisions: grpc.aio.UnaryStreamMultiCallable[policy_pb2.WatchDecisionsRequest,
                                                      policy_pb2.WatchDecisionsResponse]
    ExplainDecision: grpc.aio.UnaryUnaryMultiCallable[policy_pb2.ExplainDecisionRequest,
                                                      policy_pb2.ExplainDecisionResponse]
    GetRecommendations: grpc.aio.UnaryUnaryMultiCallable[
        policy_pb2.GetRecommendationsRequest, policy_pb2.GetRecommendationsResponse]


class PolicyStub(Protocol):
    """The blocking client (the CLI)."""

    GetPolicy: grpc.UnaryUnaryMultiCallable[policy_pb2.GetPolicyRequest,
                                            policy_pb2.GetPolicyResponse]
    SetOverride: grpc.UnaryUnaryMultiCallable[policy_pb2.SetOverrideRequest,
                                              policy_pb2.SetOverrideResponse]
    ClearOverride: grpc.UnaryUnaryMultiCallable[policy_pb2.ClearOverrideRequest,
                                                policy_pb2.ClearOverrideResponse]
    WatchDecisions: grpc.UnaryStreamMultiCallable[policy_pb2.WatchDecisionsRequest,
                                                  policy_pb2.WatchDecisionsResponse]
    ExplainDecision: grpc.UnaryUnaryMultiCallable[policy_pb2.ExplainDecisionRequest,
                                                  policy_pb2.ExplainDecisionResponse]
    GetRecommendations: grpc.UnaryUnaryMultiCallable[
        policy_pb2.GetRecommendationsRequest, policy_pb2.GetRecommendationsResponse]


def add_engine_service(servicer: object, server: grpc.aio.Server) -> None:
    _add_engine(servicer, server)


def add_policy_service(servicer: object, server: grpc.aio.Server) -> None:
    _add_policy(servicer, server)


def engine_stub(channel: grpc.aio.Channel) -> EngineStub:
    return cast(EngineStub, _engine_stub(channel))


def async_policy_stub(channel: grpc.aio.Channel) -> AsyncPolicyStub:
    return cast(AsyncPolicyStub, _policy_stub(channel))


def policy_stub(channel: grpc.Channel) -> PolicyStub:
    return cast(PolicyStub, _policy_stub(channel))
