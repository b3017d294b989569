"""Fan-out from the core to open streams: policy updates to engines, decision events to watchers.

``Hub.decide`` is the one place a decision round runs on the server: whatever prompted it (a
report, a hello, an override, the periodic task), its events reach watchers, metrics and engines
the same way. Reports ask for a round with ``decide_soon``: one round runs after the reports
already waiting on the loop, and the next no sooner than ``decide_min_interval_seconds`` and
the last round's own duration after it (rounds take at most half the loop), so under load many
reports share a round instead of each paying for one, and reports are still read while rounds
are slow. ``specpilot_report_to_decision_seconds`` is how long each report waited for its round.

Everything here runs on the server's event loop, like every access to the core, so no locks.
Each stream owns an ``Outbox`` (an asyncio queue) that its RPC handler drains; producers never
await, so a decision made while handling one engine's report reaches every engine's queue before
the loop does anything else.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import grpc

from specpilot.contract.records import DecisionEvent
from specpilot.controller.core.controller import ControllerCore
from specpilot.controller.core.snapshot import concerns
from specpilot.controller.metrics import Metrics
from specpilot.controller.server.overload import ReportBudget
from specpilot.controller.wire import event_to_proto, policy_update_to_proto
from specpilot.v1 import engine_pb2, policy_pb2

T = TypeVar("T")
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _End:
    """Ends a stream: with OK when ``code`` is None, else with that status."""

    code: grpc.StatusCode | None = None
    details: str = ""


class Outbox(Generic[T]):
    """Messages waiting for one stream. A reader that falls ``limit`` messages behind is cut off
    (RESOURCE_EXHAUSTED) instead of growing the queue without bound."""

    def __init__(self, limit: int) -> None:
        self._queue: asyncio.Queue[T | _End] = asyncio.Queue()
        self._limit = limit
        self.closed = False

    def put(self, item: T) -> None:
        if self.closed:
            return
        if self._queue.qsize() >= self._limit:
            self.close(grpc.StatusCode.RESOURCE_EXHAUSTED,
                       f"stream fell {self._limit} messages behind; reconnect")
            return
        self._queue.put_nowait(item)

    def close(self, code: grpc.StatusCode | None = None, details: str = "") -> None:
        if not self.closed:
            self.closed = True
            self._queue.put_nowait(_End(code, details))

    async def drain(self, context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[T]:
        """Yield queued items until closed; end the RPC with the closing status."""
        while not isinstance(item := await self._queue.get(), _End):
            yield item
        if item.code is not None:
            await context.abort(item.code, item.details)


class _PolicyDue:
    """Queue marker: send the policy as it is when the marker is dequeued. Several pushes before
    the stream catches up collapse into one, always the newest."""


_POLICY_DUE = _PolicyDue()


class EngineSession:
    def __init__(self, engine_id: str, limit: int) -> None:
        self.engine_id = engine_id
        self.outbox: Outbox[engine_pb2.ConnectResponse | _PolicyDue] = Outbox(limit)
        self._policy_due = False

    def send(self, msg: engine_pb2.ConnectResponse) -> None:
        self.outbox.put(msg)

    def push_policy(self) -> None:
        if not self._policy_due:
            self._policy_due = True
            self.outbox.put(_POLICY_DUE)

    async def responses(
        self, context: grpc.aio.ServicerContext[Any, Any],
        policy: Callable[[], engine_pb2.ConnectResponse],
    ) -> AsyncIterator[engine_pb2.ConnectResponse]:
        """What the stream sends, the policy rendered by ``policy()`` as of sending time."""
        async for item in self.outbox.drain(context):
            if isinstance(item, _PolicyDue):
                self._policy_due = False
                yield policy()
            else:
                yield item


class Watcher:
    """One WatchDecisions stream: its events as serialized WatchDecisionsResponse messages
    (each event is serialized once, whatever the number of watchers)."""

    def __init__(self, traffic_class: str, limit: int, client: str) -> None:
        self.traffic_class, self.client = traffic_class, client
        self.outbox: Outbox[bytes] = Outbox(limit)

    def wants(self, e: DecisionEvent) -> bool:
        return concerns(e, self.traffic_class)


class WatchersFull(Exception):
    """No more decision watchers now (the message says why, for the client)."""


class Hub:
    def __init__(self, core: ControllerCore, metrics: Metrics, clock: Callable[[], float],
                 fail_static_timeout_seconds: float, queue_limit: int,
                 decide_min_interval_seconds: float = 0.0,
                 budget: ReportBudget | None = None, *, max_watchers: int,
                 max_watchers_per_client: int) -> None:
        """``budget``: report-prompted rounds spend from it (``overload``). ``max_watchers``:
        decision watchers served at once, ``max_watchers_per_client`` of them from one client
        address (``watch`` refuses more)."""
        self._max_watchers, self._per_client = max_watchers, max_watchers_per_client
        self._core = core
        self._budget = budget
        self._min_interval = decide_min_interval_seconds
        self._decide_due: asyncio.Handle | None = None
        self._next_decide = -float("inf")  # loop time before which no report-prompted round
        self._waiting: list[float] = []  # loop times of the reports since the last round
        self._metrics = metrics
        self._clock = clock
        self._fail_static = fail_static_timeout_seconds
        self._limit = queue_limit
        self.sessions: dict[str, EngineSession] = {}
        self._watchers: set[Watcher] = set()
        self._listeners: list[Callable[[list[DecisionEvent]], None]] = []
        self._left: list[Callable[[], None]] = []
        self._pushed_version: int | None = None
        self._cached: engine_pb2.ConnectResponse | None = None
        # Serialized watch messages by event identity (the event kept, so an id is never
        # reused while cached): a replay of the log and a burst of decisions cost one
        # serialization an event, not one a watcher. Bounded: the log plus one queue.
        self._wire: dict[int, tuple[DecisionEvent, bytes]] = {}
        self._wire_limit = core.config.decision_log_size + queue_limit

    # --- engines -------------------------------------------------------------------------------
    def connected(self, engine_id: str) -> bool:
        """Whether a stream of ``engine_id`` is open."""
        return engine_id in self.sessions

    def open_session(self, engine_id: str) -> EngineSession:
        """A new stream for ``engine_id``; an older stream of the same engine is ended (the
        engine reconnected, proving its identity, and the old stream is dead or about to be)."""
        old = self.sessions.get(engine_id)
        if old is not None:
            old.outbox.close(grpc.StatusCode.ABORTED,
                             f"engine {engine_id!r} opened a newer stream")
        session = EngineSession(engine_id, self._limit)
        self.sessions[engine_id] = session
        return session

    def drop_silent(self, now: float, timeout_seconds: float) -> list[str]:
        """End the streams of engines that have not reported for ``timeout_seconds`` and
        forget them; returns their ids."""
        dropped = []
        for engine_id, age in self._core.report_ages(now).items():
            session = self.sessions.get(engine_id)
            if session is None or age <= timeout_seconds:
                continue
            del self.sessions[engine_id]
            session.outbox.close(grpc.StatusCode.UNAVAILABLE,
                                 f"no report for {age:.1f} s (engine silence timeout "
                                 f"{timeout_seconds:g} s); reconnect")
            self._disconnect(engine_id)
            dropped.append(engine_id)
        return dropped

    def forget_idle_classes(self, now: float) -> tuple[str, ...]:
        """Free the slots of classes no engine reports any more
        (``ControllerCore.forget_idle_classes``); the next round's policy leaves them out."""
        return self._core.forget_idle_classes(now)

    def forget_departed(self, now: float) -> tuple[str, ...]:
        """Forget the names no engine announced for ``name_grace_seconds``
        (``ControllerCore.forget_departed``); returns the drafts forgotten."""
        return self._core.forget_departed(now)

    def close_session(self, session: EngineSession) -> None:
        """Forget the engine, unless a newer stream of the same engine took over."""
        session.outbox.close()
        if self.sessions.get(session.engine_id) is session:
            del self.sessions[session.engine_id]
            self._disconnect(session.engine_id)

    def _disconnect(self, engine_id: str) -> None:
        self._core.disconnect_engine(engine_id)
        for listener in self._left:
            listener()

    def on_engine_left(self, listener: Callable[[], None]) -> None:
        """Call ``listener`` whenever an engine is forgotten (it must not block)."""
        self._left.append(listener)

    def policy_message(self) -> engine_pb2.ConnectResponse:
        """The current PolicyUpdate, built once per policy version."""
        if self._cached is None or self._cached.policy.version != self._core.version:
            self._cached = engine_pb2.ConnectResponse(policy=policy_update_to_proto(
                self._core.snapshot(self._clock()), self._fail_static))
        self._metrics.policy_update_sent()
        return self._cached

    # --- decisions -----------------------------------------------------------------------------
    def decide(self, now: float, joint: bool = True) -> None:
        """Re-decide as of ``now`` and publish what changed (``ControllerCore.decide``)."""
        self._publish(self._core.decide(now, joint))

    def refresh_joint(self, now: float) -> None:
        """One bucket's joint search (``ControllerCore.refresh_joint``); the periodic task
        runs a few, one per loop turn."""
        self._core.refresh_joint(now, max_buckets=1)

    def decide_soon(self) -> None:
        """A round for a report's new evidence: after what is already waiting on the loop, and
        not before the previous round's spacing is over. Never blocks."""
        loop = asyncio.get_running_loop()
        self._waiting.append(loop.time())
        if self._decide_due is not None:
            return
        wait = self._next_decide - loop.time()
        self._decide_due = (loop.call_later(wait, self._decide_now) if wait > 0
                            else loop.call_soon(self._decide_now))

    def _decide_now(self) -> None:
        loop = asyncio.get_running_loop()
        self._decide_due = None
        start = loop.time()
        try:
            self.decide(self._clock(), joint=False)
        except Exception:  # one failed round must not stop later ones
            log.exception("decide round failed")
        end = loop.time()
        if self._budget is not None:
            self._budget.spend(end - start)
        self._next_decide = end + max(self._min_interval, end - start)
        self._metrics.reports_decided([end - t for t in self._waiting])
        self._waiting.clear()

    def _publish(self, events: list[DecisionEvent]) -> None:
        """Hand new decisions to watchers and metrics; push the policy to every engine when its
        version moved."""
        self._metrics.decisions(events)
        if events:
            for listener in self._listeners:
                listener(events)
        for watcher in self._watchers:
            for e in events:
                if watcher.wants(e):
                    watcher.outbox.put(self.watch_message(e))
        if self._core.version != self._pushed_version:
            self._pushed_version = self._core.version
            for session in self.sessions.values():
                session.push_policy()

    def on_decisions(self, listener: Callable[[list[DecisionEvent]], None]) -> None:
        """Call ``listener`` with every round's new decisions (it must not block)."""
        self._listeners.append(listener)

    def watch_message(self, e: DecisionEvent) -> bytes:
        """``e`` as a serialized WatchDecisionsResponse."""
        hit = self._wire.get(id(e))
        if hit is not None and hit[0] is e:
            return hit[1]
        data = policy_pb2.WatchDecisionsResponse(event=event_to_proto(e)).SerializeToString()
        self._wire[id(e)] = (e, data)
        if len(self._wire) > self._wire_limit:
            del self._wire[next(iter(self._wire))]  # the oldest cached
        return data

    def watch(self, traffic_class: str, client: str) -> tuple[list[DecisionEvent], Watcher]:
        """The recent log (for replay, ``watch_message`` each) and a watcher for what
        follows, with no gap between; WatchersFull when ``max_watchers`` are served, or
        ``max_watchers_per_client`` to ``client`` (its address)."""
        if len(self._watchers) >= self._max_watchers:
            raise WatchersFull(f"{len(self._watchers)} decision watchers are served, the most "
                               "at once (max_watch_streams); try again when one has ended")
        if sum(w.client == client for w in self._watchers) >= self._per_client:
            raise WatchersFull(f"this client holds {self._per_client} decision watchers, the "
                               "most one may (event_streams_per_client)")
        watcher = Watcher(traffic_class, self._limit, client)
        self._watchers.add(watcher)
        return list(self._core.snapshot(self._clock()).events(traffic_class)), watcher

    def unwatch(self, watcher: Watcher) -> None:
        self._watchers.discard(watcher)

    def close_all(self) -> None:
        """End every stream with OK (server shutdown)."""
        if self._decide_due is not None:
            self._decide_due.cancel()
            self._decide_due = None
        for session in list(self.sessions.values()):
            session.outbox.close()
        for watcher in self._watchers:
            watcher.outbox.close()
