"""The embedded default store: everything in this process's memory (one sidecar, no fleet). Also
the reference behaviour the Redis store is tested against, and a fleet of controllers inside one
process (the tests, the simulator) can share one."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import replace
from typing import Any

from specpilot.contract.records import DecisionEvent, Override, OverrideScope
from specpilot.controller.core.fleet import CostExport, EvidenceExport
from specpilot.controller.core.recommend import EngineOptions, Recommendation


class MemoryStore:
    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._evidence: dict[str, dict[str, tuple[EvidenceExport, float]]] = {}
        self._options: dict[str, dict[str, tuple[EngineOptions, float]]] = {}
        self._costs: dict[str, dict[str, tuple[CostExport, float]]] = {}
        self._overrides: dict[str, dict[str, Override]] = {}
        self._subscribers: dict[str, set[asyncio.Queue[None]]] = {}
        # One log per model, as the Redis stream: decisions and recommendations interleaved.
        self._log: dict[str, deque[tuple[str, DecisionEvent | tuple[float, Recommendation]]]] = {}

    async def put_evidence(self, model: str, export: EvidenceExport,
                           ttl_seconds: float) -> None:
        self._evidence.setdefault(model, {})[export.sidecar] = (
            export, self._clock() + ttl_seconds)

    async def evidence(self, model: str, since: float) -> list[EvidenceExport]:
        now = self._clock()
        held = self._evidence.get(model, {})
        for sidecar in [s for s, (_, expires) in held.items() if expires <= now]:
            del held[sidecar]
        return sorted((ex for ex, _ in held.values() if ex.at >= since),
                      key=lambda ex: ex.sidecar)

    async def put_costs(self, model: str, export: CostExport, ttl_seconds: float) -> None:
        self._costs.setdefault(model, {})[export.sidecar] = (export, self._clock() + ttl_seconds)

    async def costs(self, model: str, since: float) -> list[CostExport]:
        now = self._clock()
        held = self._costs.get(model, {})
        return sorted((c for c, expires in held.values() if expires > now and c.at >= since),
                      key=lambda c: c.sidecar)

    async def put_options(self, model: str, options: EngineOptions, ttl_seconds: float) -> None:
        self._options.setdefault(model, {})[options.sidecar] = (
            options, self._clock() + ttl_seconds)

    async def options(self, model: str, since: float) -> list[EngineOptions]:
        now = self._clock()
        held = self._options.get(model, {})
        return sorted((o for o, expires in held.values() if expires > now and o.at >= since),
                      key=lambda o: o.sidecar)

    def _notify(self, model: str) -> None:
        for queue in self._subscribers.get(model, ()):
            queue.put_nowait(None)

    async def put_override(self, model: str, override: Override) -> None:
        self._overrides.setdefault(model, {})[override.traffic_class] = replace(
            override, scope=OverrideScope.FLEET)
        self._notify(model)

    async def clear_override(self, model: str, traffic_class: str) -> bool:
        cleared = self._overrides.get(model, {}).pop(traffic_class, None) is not None
        if cleared:
            self._notify(model)
        return cleared

    async def overrides(self, model: str) -> list[Override]:
        held = self._overrides.get(model, {})
        return [held[c] for c in sorted(held)]

    async def override_changes(self, model: str) -> AsyncIterator[None]:
        queue: asyncio.Queue[None] = asyncio.Queue()
        self._subscribers.setdefault(model, set()).add(queue)
        try:
            yield None
            while True:
                await queue.get()
                yield None
        finally:
            self._subscribers[model].discard(queue)

    def _append(self, model: str, entries: list[tuple[str, Any]], max_len: int) -> None:
        log = self._log.get(model)
        if log is None or log.maxlen != max_len:
            log = self._log[model] = deque(log or (), maxlen=max_len)
        log.extend(entries)

    def _newest(self, model: str, count: int) -> list[tuple[str, Any]]:
        return list(self._log.get(model, ()))[-count:] if count > 0 else []

    async def add_decisions(self, model: str, sidecar: str, events: Sequence[DecisionEvent],
                            max_len: int) -> None:
        self._append(model, [(sidecar, e) for e in events], max_len)

    async def decisions(self, model: str, count: int) -> list[tuple[str, DecisionEvent]]:
        return [(s, e) for s, e in self._newest(model, count) if isinstance(e, DecisionEvent)]

    async def add_recommendations(self, model: str, sidecar: str,
                                  recommendations: Sequence[Recommendation], at: float,
                                  max_len: int) -> None:
        self._append(model, [(sidecar, (at, r)) for r in recommendations], max_len)

    async def recommendations_log(self, model: str, count: int
                                  ) -> list[tuple[str, float, Recommendation]]:
        return [(s, e[0], e[1]) for s, e in self._newest(model, count) if isinstance(e, tuple)]

    async def close(self) -> None:
        return None
