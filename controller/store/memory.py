"""The embedded default store: evidence in this process's memory (one sidecar, no fleet). Also the
reference behaviour the Redis store is tested against."""

from __future__ import annotations

import time
from collections.abc import Callable

from controller.core.fleet import EvidenceExport


class MemoryStore:
    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._evidence: dict[str, dict[str, tuple[EvidenceExport, float]]] = {}

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

    async def close(self) -> None:
        return None
