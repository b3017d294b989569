"""The state-store interface: what the server flushes to and loads from, in the core's terms.

The core keeps every estimate in its own objects; a store only holds what sidecars exchange:
their acceptance evidence, their step-cost evidence (per engine type), what their engines
achieve (for recommendations), the fleet's overrides and the fleet's decision log. One model's keys
share a namespace (and, in Redis Cluster, a hash slot), so sidecars serving different models
never see each other's state.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Protocol

from specpilot.contract.records import DecisionEvent, Override
from specpilot.controller.core.fleet import CostExport, EvidenceExport
from specpilot.controller.core.recommend import EngineOptions, Recommendation


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

    async def put_costs(self, model: str, export: CostExport, ttl_seconds: float) -> None:
        """Publish one sidecar's step-cost evidence (replacing its previous export); it expires
        after ``ttl_seconds`` unless published again."""

    async def costs(self, model: str, since: float) -> list[CostExport]:
        """Every sidecar's latest step-cost export for ``model`` stamped at or after ``since``,
        by sidecar, this one's included. Records that cannot be read are skipped."""

    async def put_options(self, model: str, options: EngineOptions, ttl_seconds: float) -> None:
        """Publish what one sidecar's engines achieve (replacing its previous record); it
        expires after ``ttl_seconds`` unless published again."""

    async def options(self, model: str, since: float) -> list[EngineOptions]:
        """Every sidecar's latest options for ``model`` stamped at or after ``since``, by
        sidecar. Records that cannot be read are skipped."""

    async def put_override(self, model: str, override: Override) -> None:
        """Put a fleet override in force for ``model`` (replacing the one on the same class)
        and tell every subscriber of ``override_changes``."""

    async def clear_override(self, model: str, traffic_class: str) -> bool:
        """Lift the fleet override on ``traffic_class``; False when there was none."""

    async def overrides(self, model: str) -> list[Override]:
        """The model's fleet overrides, by class. Records that cannot be read are skipped."""

    def override_changes(self, model: str) -> AsyncIterator[None]:
        """Yields once subscribed (read ``overrides`` then) and after every change of the
        model's fleet overrides; raises StoreUnavailable when the subscription is lost
        (changes made meanwhile are seen by the next read, not replayed)."""

    async def add_decisions(self, model: str, sidecar: str, events: Sequence[DecisionEvent],
                            max_len: int) -> None:
        """Append ``sidecar``'s decisions to the model's decision log, which keeps about the
        newest ``max_len`` entries of the whole fleet."""

    async def decisions(self, model: str, count: int) -> list[tuple[str, DecisionEvent]]:
        """The decisions among the newest ``count`` entries of the model's decision log, oldest
        first, each with the sidecar that decided it. Entries that cannot be read are
        skipped."""

    async def add_recommendations(self, model: str, sidecar: str,
                                  recommendations: Sequence[Recommendation], at: float,
                                  max_len: int) -> None:
        """Append changed recommendations to the model's decision log (one entry each)."""

    async def recommendations_log(self, model: str, count: int
                                  ) -> list[tuple[str, float, Recommendation]]:
        """The recommendations among the newest ``count`` entries of the decision log, oldest
        first: the sidecar that logged each, when, and what. Entries that cannot be read are
        skipped."""

    async def close(self) -> None:
        """Release connections."""
