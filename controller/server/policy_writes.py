"""Policy writes, for every edge that takes them: the gRPC PolicyService and the dashboard's HTTP
controls run the same checks and the same code, and each attempt (taken or refused) lands in
the audit log.

A write needs ``Bearer <token>`` (the gRPC metadata ``authorization``, or the HTTP header
``Authorization``): missing -> ``unauthenticated``, wrong -> ``permission_denied``; the token
is compared in constant time (``specpilot.controller.server.auth``). An override's scope is the pod
(this controller) or the fleet (every controller of the model, through the state store); unspecified
means the fleet where a shared store is configured.

The audit log is one JSON line per attempt on the ``specpilot.audit`` logger (ship it with the
controller's logs) and the newest ``AUDIT_LOG_SIZE`` in memory for the dashboard.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from specpilot.contract.records import ALL_CLASSES, OverrideScope
from specpilot.contract.validation import valid_class_name
from specpilot.controller.core.controller import ControllerCore
from specpilot.controller.metrics import Metrics
from specpilot.controller.server.auth import bearer_verdict
from specpilot.controller.server.fleet import FleetSync
from specpilot.controller.server.hub import Hub
from specpilot.controller.store.base import StoreUnavailable
from specpilot.controller.wire import override_from_proto, scope_from_proto
from specpilot.v1 import policy_pb2

audit_log = logging.getLogger("specpilot.audit")
AUDIT_LOG_SIZE = 1000
# What an audit entry keeps of a client's strings (a refused request may carry megabytes).
_AUDIT_CHARS = 200
Refusal = Literal["unauthenticated", "permission_denied", "invalid", "unavailable"]


class WriteRefused(Exception):
    """A write that was not taken: ``kind`` says why for the edge's status code, the message
    says why for people. Nothing changed."""

    def __init__(self, kind: Refusal, reason: str) -> None:
        super().__init__(reason)
        self.kind = kind
        self.reason = reason


@dataclass(frozen=True)
class AuditEntry:
    at: float  # seconds since the Unix epoch
    actor: str  # the edge and the peer, e.g. "grpc ipv4:10.0.0.7:51234" or "http 10.0.0.7"
    action: str  # "set_override" or "clear_override"
    traffic_class: str
    what: str  # the override's action ("pin_k=2", "force_off", "force_draft=x"), "" for a clear
    scope: str  # "pod", "fleet", or "" where the request did not get that far
    note: str
    outcome: str  # "ok" or the refusal's kind
    reason: str  # why it was refused; for a clear that found nothing: "nothing to clear"


class AuditLog:
    def __init__(self, size: int = AUDIT_LOG_SIZE) -> None:
        self._entries: deque[AuditEntry] = deque(maxlen=size)
        self._listeners: list[Callable[[AuditEntry], None]] = []

    def record(self, entry: AuditEntry) -> None:
        self._entries.append(entry)
        audit_log.info(json.dumps(dataclasses.asdict(entry), separators=(",", ":")))
        for listener in self._listeners:
            listener(entry)

    def entries(self) -> tuple[AuditEntry, ...]:
        """Oldest first."""
        return tuple(self._entries)

    def on_entry(self, listener: Callable[[AuditEntry], None]) -> None:
        """Call ``listener`` with every new entry (it must not block)."""
        self._listeners.append(listener)


def _what(msg: policy_pb2.Override) -> str:
    action = msg.WhichOneof("action")
    if action == "pin_k":
        return f"pin_k={msg.pin_k}"
    if action == "force_draft":
        return f"force_draft={msg.force_draft}"
    return "force_off" if action == "force_off" else ""


class PolicyWriter:
    def __init__(self, core: ControllerCore, hub: Hub, metrics: Metrics, token: str,
                 clock: Callable[[], float], sidecar: str, fleet: FleetSync | None,
                 audit: AuditLog) -> None:
        """``sidecar``: this controller's name, kept with the overrides it takes; ``fleet``:
        the state-store edge, None where no shared store is configured."""
        self._core, self._hub, self._metrics = core, hub, metrics
        self._token = token.encode()
        self._clock = clock
        self._sidecar = sidecar
        self._fleet = fleet
        self.audit = audit

    def _refuse(self, kind: Refusal, reason: str, entry: AuditEntry) -> WriteRefused:
        self._metrics.policy_write(kind)
        self.audit.record(dataclasses.replace(entry, outcome=kind, reason=reason))
        return WriteRefused(kind, reason)

    def _authorize(self, authorization: str | None, entry: AuditEntry) -> None:
        verdict = bearer_verdict(authorization, self._token)
        if verdict == "unauthenticated":
            raise self._refuse("unauthenticated", "policy writes need 'Bearer <token>' (gRPC "
                               "metadata 'authorization', HTTP header 'Authorization')", entry)
        if verdict == "permission_denied":
            raise self._refuse("permission_denied", "bearer token does not match", entry)

    def _scope(self, value: int, entry: AuditEntry) -> OverrideScope:
        try:
            scope = scope_from_proto(value)
        except ValueError as exc:
            raise self._refuse("invalid", str(exc), entry) from None
        if scope is None:
            return OverrideScope.FLEET if self._fleet is not None else OverrideScope.POD
        if scope is OverrideScope.FLEET and self._fleet is None:
            raise self._refuse("invalid", "scope: fleet overrides need a shared state store "
                               "(state_store is 'memory'); use scope pod", entry)
        return scope

    def _unavailable(self, exc: StoreUnavailable, entry: AuditEntry) -> WriteRefused:
        return self._refuse("unavailable", f"the state store did not take the fleet override "
                            f"({exc}); nothing changed: retry, or use scope pod", entry)

    async def set_override(self, request: policy_pb2.SetOverrideRequest,
                           authorization: str | None, actor: str
                           ) -> policy_pb2.SetOverrideResponse:
        now = self._clock()
        msg = request.override
        entry = AuditEntry(now, actor, "set_override", msg.traffic_class[:_AUDIT_CHARS],
                           _what(msg)[:_AUDIT_CHARS], "", msg.note[:_AUDIT_CHARS], "", "")
        self._authorize(authorization, entry)
        if not request.HasField("override"):
            raise self._refuse("invalid", "override: must be set", entry)
        scope = self._scope(msg.scope, entry)
        entry = dataclasses.replace(entry, scope=scope.value)
        try:
            override = dataclasses.replace(override_from_proto(msg), set_at=now, scope=scope,
                                           set_by=self._sidecar)
            self._core.check_operator_override(override)
            if self._fleet is not None and scope is OverrideScope.FLEET:
                await self._fleet.set_override(override)
            else:
                self._core.set_override(override)
        except ValueError as exc:  # ReportRejected (bad class name) is a ValueError too
            raise self._refuse("invalid", str(exc), entry) from None
        except StoreUnavailable as exc:
            raise self._unavailable(exc, entry) from None
        self._metrics.policy_write("ok")
        self.audit.record(dataclasses.replace(entry, outcome="ok"))
        self._hub.decide(now)
        return policy_pb2.SetOverrideResponse(policy_version=self._core.version)

    async def clear_override(self, request: policy_pb2.ClearOverrideRequest,
                             authorization: str | None, actor: str
                             ) -> policy_pb2.ClearOverrideResponse:
        entry = AuditEntry(self._clock(), actor, "clear_override",
                           request.traffic_class[:_AUDIT_CHARS], "", "", "", "", "")
        self._authorize(authorization, entry)
        if not request.traffic_class:
            raise self._refuse("invalid", "traffic_class: must not be empty (use '*' for all)",
                               entry)
        if request.traffic_class != ALL_CLASSES and not valid_class_name(request.traffic_class):
            raise self._refuse("invalid", f"traffic_class: {request.traffic_class[:80]!r} is not "
                               "a class name", entry)
        scope = self._scope(request.scope, entry)
        entry = dataclasses.replace(entry, scope=scope.value)
        try:
            if self._fleet is not None and scope is OverrideScope.FLEET:
                cleared = await self._fleet.clear_override(request.traffic_class)
            else:
                cleared = self._core.clear_override(request.traffic_class, scope)
        except ValueError as exc:
            raise self._refuse("invalid", str(exc), entry) from None
        except StoreUnavailable as exc:
            raise self._unavailable(exc, entry) from None
        self._metrics.policy_write("ok")
        self.audit.record(dataclasses.replace(
            entry, outcome="ok", reason="" if cleared else "nothing to clear"))
        if cleared:
            self._hub.decide(self._clock())
        return policy_pb2.ClearOverrideResponse(policy_version=self._core.version,
                                                cleared=cleared)

