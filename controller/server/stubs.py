"""Typed handles on the generated ``*_pb2_grpc`` modules, and the services' registration.

grpcio-tools emits those modules without annotations, so under ``mypy --strict`` every call into
them is an untyped call and every stub method is ``Any``. The Protocols below state the real
request and response types once; servers, the CLI and the tests go through these functions.

The services are registered with their requests as bytes, parsed by ``parse``: a message that
does not parse is refused with INVALID_ARGUMENT and a reason like any other bad input, instead
of failing in gRPC's deserializer (UNKNOWN, and a traceback logged at ERROR).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol, TypeVar, cast

import grpc
from google.protobuf import message_factory
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message import DecodeError, Message

from specpilot.v1 import engine_pb2, engine_pb2_grpc, policy_pb2, policy_pb2_grpc

_M = TypeVar("_M", bound=Message)
# Untyped generated callables, bound once to annotated names (assignment is not an untyped call).
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


def parse(cls: type[_M], data: bytes) -> _M | str:
    """``data`` as a ``cls``, or why it is not one (for the refusal)."""
    try:
        return cls.FromString(data)
    except DecodeError as exc:
        name = cls.DESCRIPTOR.full_name
        why = str(exc).removeprefix(f"Error parsing message with type '{name}': ")
        return f"not a {name} ({why})"


def _parsed_unary(behaviour: Any, request: type[Message]) -> Callable[..., Any]:
    async def handle(data: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        msg = parse(request, data)
        if isinstance(msg, str):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, msg)
        return await behaviour(msg, context)
    return handle


def _parsed_stream(behaviour: Any, request: type[Message]) -> Callable[..., Any]:
    async def handle(data: bytes, context: grpc.aio.ServicerContext[Any, Any]
                     ) -> AsyncIterator[Any]:
        msg = parse(request, data)
        if isinstance(msg, str):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, msg)
        async for item in behaviour(msg, context):
            yield item
    return handle


def _serializer(message_class: Any) -> Callable[[Any], bytes]:
    """The response serializer: a message, or bytes a servicer serialized already (one
    message sent to many streams is serialized once)."""
    serialize = message_class.SerializeToString

    def to_bytes(msg: Any) -> bytes:
        return msg if isinstance(msg, bytes) else cast(bytes, serialize(msg))
    return to_bytes


def _add_service(servicer: object, service: ServiceDescriptor, server: grpc.aio.Server) -> None:
    """Every method of ``service`` on ``servicer``'s method of its name, the request as bytes:
    unary requests are parsed here; a streaming request's messages by the servicer (``parse``),
    which answers one that does not parse on the stream it keeps."""
    handlers = {}
    for method in service.methods:
        behaviour = getattr(servicer, method.name)
        request = message_factory.GetMessageClass(method.input_type)
        serialize = _serializer(message_factory.GetMessageClass(method.output_type))
        if method.client_streaming and method.server_streaming:
            handler = grpc.stream_stream_rpc_method_handler(behaviour, None, serialize)
        elif method.client_streaming:
            raise NotImplementedError(f"{method.full_name}: client streaming, one response")
        elif method.server_streaming:
            handler = grpc.unary_stream_rpc_method_handler(
                _parsed_stream(behaviour, request), None, serialize)
        else:
            handler = grpc.unary_unary_rpc_method_handler(
                _parsed_unary(behaviour, request), None, serialize)
        handlers[method.name] = handler
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(service.full_name, handlers),))


def add_engine_service(servicer: object, server: grpc.aio.Server) -> None:
    """``servicer.Connect`` gets the stream's messages as bytes (``parse`` each)."""
    _add_service(servicer, engine_pb2.DESCRIPTOR.services_by_name["EngineService"], server)


def add_policy_service(servicer: object, server: grpc.aio.Server) -> None:
    _add_service(servicer, policy_pb2.DESCRIPTOR.services_by_name["PolicyService"], server)


def engine_stub(channel: grpc.aio.Channel) -> EngineStub:
    return cast(EngineStub, _engine_stub(channel))


def async_policy_stub(channel: grpc.aio.Channel) -> AsyncPolicyStub:
    return cast(AsyncPolicyStub, _policy_stub(channel))


def policy_stub(channel: grpc.Channel) -> PolicyStub:
    return cast(PolicyStub, _policy_stub(channel))
