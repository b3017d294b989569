"""The fleet edge: every ``flush_interval_seconds`` publish this sidecar's acceptance evidence to
the state store and load the other sidecars' into the core.

On the first round that knows the model (from the settings, or the first engine's hello) the
sidecar first reads its own record back, so a restart (even after SIGKILL) resumes from its last
flush: at most one flush interval of evidence is lost. It never publishes before that read, so a
restarted sidecar cannot overwrite its record with an empty one.

A store that fails (Redis down or restarting) costs nothing but sharing: the core keeps deciding
from memory, rounds retry with exponential backoff and jitter, and the state change is logged
once and shown by ``specpilot_state_store_up``; when the store answers again the next round
publishes and reloads (resynchronises) as usual.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable
from dataclasses import dataclass

from controller.core.controller import ControllerCore
from controller.core.fleet import EvidenceExport, fleet_evidence
from controller.metrics import Metrics
from controller.store.base import StateStore, StoreUnavailable

log = logging.getLogger(__name__)
_MAX_BACKOFF_FACTOR = 16  # retries wait at most 16 flush intervals


@dataclass(frozen=True)
class FleetIdentity:
    sidecar: str
    model: str  # "" until known: the first engine's hello names it


class FleetSync:
    def __init__(self, core: ControllerCore, store: StateStore, identity: FleetIdentity,
                 flush_interval_seconds: float, max_age_seconds: float,
                 clock: Callable[[], float], metrics: Metrics | None = None,
                 rng: random.Random | None = None) -> None:
        self._core, self._store, self._id = core, store, identity
        self._interval = flush_interval_seconds
        self._max_age = max_age_seconds
        self._clock = clock
        self._metrics = metrics
        self._rng = rng or random.Random()
        self._restored = False
        self._up: bool | None = None

    def model(self) -> str:
        return self._id.model or self._core.first_engine_model()

    async def sync_once(self) -> bool:
        """One round: restore (first time), publish, reload. False when the model is not known
        yet. Raises StoreUnavailable (nothing in the core changed then)."""
        model = self.model()
        if not model:
            return False
        if not self._restored:
            own = [ex for ex in await self._store.evidence(model, self._clock() - self._max_age)
                   if ex.sidecar == self._id.sidecar]
            if own:
                self._core.restore_evidence(own[0].entries, own[0].at, self._clock())
                log.info("restored acceptance evidence of %d (class, draft)s from the state "
                         "store (flushed %.1f s ago)", len(own[0].entries),
                         self._clock() - own[0].at)
            self._restored = True
        now = self._clock()
        export = EvidenceExport(self._id.sidecar, now, self._core.export_evidence(now))
        await self._store.put_evidence(model, export, ttl_seconds=self._max_age)
        exports = await self._store.evidence(model, now - self._max_age)
        now = self._clock()
        self._core.set_fleet_evidence(
            fleet_evidence(exports, self._id.sidecar, now, self._core.evidence_half_life,
                           self._max_age), now)
        return True

    def _set_up(self, up: bool, reason: str = "") -> None:
        if self._up is not up:
            if up:
                log.info("state store reachable: sharing acceptance evidence again")
            else:
                log.warning("state store unreachable (%s): deciding from memory, retrying",
                            reason)
        self._up = up
        if self._metrics is not None:
            self._metrics.state_store_up(up)

    async def run(self) -> None:
        """Rounds until cancelled."""
        failures = 0
        while True:
            try:
                await self.sync_once()
                self._set_up(True)
                failures = 0
                delay = self._interval
            except StoreUnavailable as exc:
                self._set_up(False, str(exc))
                failures += 1
                factor = min(2 ** (failures - 1), _MAX_BACKOFF_FACTOR)
                delay = self._interval * factor * (0.5 + self._rng.random())
            except Exception:  # a bug here must not stop sharing for good
                log.exception("fleet round failed")
                delay = self._interval
            await asyncio.sleep(delay)
