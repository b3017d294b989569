"""The state-store interface: what the server flushes to and loads from, in the core's terms.

The core keeps every estimate in its own objects; a store only holds what sidecars exchange. One
model's keys share a namespace (and, in Redis Cluster, a hash slot), so sidecars serving different
models never see each other's evidence.
"""

from __future__ import annotations

from typing import Protocol

from controller.core.fleet import EvidenceExport


class StoreUnavailable(RuntimeError):
    """The store could not be reached or answered with an error; the caller keeps deciding from
    memory and retries later."""


class StateStore(Protocol):
    async def put_evidence(self, model: str, export: EvidenceExport,
                           ttl_seconds: float) -> None:
        """Publish one sidecar's evidence (replacing its previous export); it expires after
        ``ttl_seconds`` unless published again."""

    async def evidence(self, model: str, since: float) -> list[EvidenceExport]:
        """Every sidecar's latest export for ``model`` stamped at or after ``since``, this one's
        included (callers skip their own, or read it back after a restart). Records that cannot
        be read are skipped."""

    async def close(self) -> None:
        """Release connections."""
