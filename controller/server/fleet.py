"""The fleet edge: every ``flush_interval_seconds`` publish this sidecar's acceptance evidence,
its step-cost evidence, what its engines achieve and its decisions to the state store, load the
other sidecars' evidence (step costs from engines of the same type only) and the fleet's
overrides into the core, and recompute the fleet's recommendations (which draft
and which pool serve each class best; ``specpilot.controller.core.recommend``); between rounds, a
subscription to override changes brings a fleet override set through any sidecar into force
here within one report interval.

On the first round that knows the model (from the settings, or the first engine's hello, kept
after the engine left) the sidecar first reads its own record back, so a restart (even after
SIGKILL) resumes from its last flush: at most one flush interval of evidence is lost. It never
publishes before that read, so a restarted sidecar cannot overwrite its record with an empty
one. Step costs are read back the same way once an engine has said what hardware it runs on.
An engine that leaves brings the next round forward, and a graceful stop runs one last round,
so in a pod's stop order (the engine first, the sidecar last) what the engine taught is
published.

A store that fails (Redis down or restarting) costs nothing but sharing: the core keeps deciding
from memory (with the fleet overrides it last read), rounds retry with exponential backoff and
jitter, and the state change is logged once and shown by ``specpilot_state_store_up``; when the
store answers again the next round publishes and reloads (resynchronises) as usual. Decisions
made meanwhile wait in a bounded buffer and reach the decision log then.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from specpilot.contract.records import DecisionEvent, Override
from specpilot.controller.core.controller import ControllerCore
from specpilot.controller.core.fleet import EvidenceExport, fleet_evidence
from specpilot.controller.core.recommend import Recommendation, recommend
from specpilot.controller.logsafe import safe_name
from specpilot.controller.metrics import Metrics
from specpilot.controller.store.base import StateStore, StoreUnavailable

log = logging.getLogger(__name__)
_MAX_BACKOFF_FACTOR = 16  # retries wait at most 16 flush intervals
# Engine options older than this many flush intervals are left out of recommendations: they
# describe an engine's present, and a sidecar gone for longer is no pool to route to.
_OPTIONS_MAX_AGE_INTERVALS = 6
# The others' step costs are read every this many rounds (and whenever this sidecar's engine
# type changes): they move with a 10-minute half-life, and each is a 2 kB record, so reading them
# every round would grow the fleet's egress (N^2 records per interval) by half for nothing.
_COSTS_READ_EVERY_ROUNDS = 6


@dataclass(frozen=True)
class FleetIdentity:
    sidecar: str
    model: str  # "" until known: the first engine's hello names it


class FleetSync:
    def __init__(self, core: ControllerCore, store: StateStore, identity: FleetIdentity,
                 flush_interval_seconds: float, max_age_seconds: float,
                 clock: Callable[[], float], metrics: Metrics | None = None,
                 rng: random.Random | None = None,
                 decide: Callable[[float], None] | None = None,
                 decision_log_size: int = 10_000, recommend_min_tries: float = 200.0) -> None:
        """``decide``: what to run when the fleet's overrides changed (the hub's decide, so
        engines get the new policy at once)."""
        self._core, self._store, self._id = core, store, identity
        self._interval = flush_interval_seconds
        self._max_age = max_age_seconds
        self._clock = clock
        self._metrics = metrics
        self._rng = rng or random.Random()
        self._decide = decide
        self._log_size = decision_log_size
        self._pending: deque[DecisionEvent] = deque(maxlen=decision_log_size)
        self._restored = False
        self._costs_restored = False
        self._cost_peers = 0
        self._costs_read: tuple[int, str] | None = None  # (round, hardware) of the last read
        self._round = 0
        self._up: bool | None = None
        self._wake = asyncio.Event()  # set: run the next round now (``flush_soon``)
        self._refused: set[tuple[str, float]] = set()
        self._min_tries = recommend_min_tries
        # The other sidecars of the model and when each last published (the last round's read).
        self.peers: tuple[tuple[str, float], ...] = ()
        self.recommendations: tuple[Recommendation, ...] = ()
        self.recommended_at = 0.0  # when they were computed (0: never)

    @property
    def sidecar(self) -> str:
        return self._id.sidecar

    @property
    def up(self) -> bool | None:
        """Whether the last round reached the store (None before the first)."""
        return self._up

    async def fleet_decisions(self, count: int) -> list[tuple[str, DecisionEvent]]:
        """The newest ``count`` entries' decisions of the fleet's log (oldest first, with the
        sidecar of each); [] while the model is not known. Raises StoreUnavailable."""
        model = self.model()
        return await self._store.decisions(model, count) if model else []

    def model(self) -> str:
        return self._id.model or self._core.served_model()

    def _known_model(self) -> str:
        model = self.model()
        if not model:
            raise ValueError("scope: the fleet's model is not known yet (no engine has "
                             "connected and fleet_model is unset): set the override with scope "
                             "pod, or retry once an engine is connected")
        return model

    # --- rounds ---------------------------------------------------------------------------------
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
        if not self._costs_restored and self._core.hardware():
            await self._restore_costs(model)
        now = self._clock()
        export = EvidenceExport(self._id.sidecar, now, self._core.export_evidence(now))
        await self._store.put_evidence(model, export, ttl_seconds=self._max_age)
        costs = self._core.export_costs(self._id.sidecar, now)
        if costs is not None and self._costs_restored:
            await self._store.put_costs(model, costs, ttl_seconds=self._max_age)
        options = self._core.engine_options(self._id.sidecar, now)
        options_ttl = _OPTIONS_MAX_AGE_INTERVALS * self._interval
        if options is not None:
            await self._store.put_options(model, options, ttl_seconds=options_ttl)
        if self._pending:
            events = list(self._pending)
            self._pending.clear()  # what arrives meanwhile waits for the next round
            try:
                await self._store.add_decisions(model, self._id.sidecar, events,
                                                self._log_size)
            except BaseException:
                self._pending.extendleft(reversed(events))  # ahead of the newer ones
                raise
        exports = await self._store.evidence(model, now - self._max_age)
        self.peers = tuple((ex.sidecar, ex.at) for ex in exports if ex.sidecar != self._id.sidecar)
        now = self._clock()
        self._core.set_fleet_evidence(
            fleet_evidence(exports, self._id.sidecar, now, self._core.evidence_half_life,
                           self._max_age), now)
        await self._load_costs(model, now)
        await self._load_overrides(model)
        fleet_options = await self._store.options(model, now - options_ttl)
        changed = self._set_recommendations(recommend(fleet_options, self._min_tries), now)
        if changed and min(o.sidecar for o in fleet_options) == self._id.sidecar:
            # Every sidecar computes the same; the first by name logs the changes for the fleet.
            await self._store.add_recommendations(model, self._id.sidecar, changed, now,
                                                  self._log_size)
        return True

    async def _load_costs(self, model: str, now: float) -> None:
        hardware = self._core.hardware()
        self._round += 1
        if self._costs_read is not None:
            last_round, last_hardware = self._costs_read
            if last_hardware == hardware and self._round - last_round < _COSTS_READ_EVERY_ROUNDS:
                return
        peers = self._core.set_fleet_costs(await self._store.costs(model, now - self._max_age),
                                           self._id.sidecar, now, self._max_age)
        self._costs_read = (self._round, hardware)
        if peers != self._cost_peers:
            log.info("step costs shared with %d other sidecar(s) on %s", peers,
                     safe_name(hardware))
            self._cost_peers = peers

    async def _restore_costs(self, model: str) -> None:
        own = [c for c in await self._store.costs(model, self._clock() - self._max_age)
               if c.sidecar == self._id.sidecar]
        if own and self._core.restore_costs(own[0]):
            log.info("restored step-cost evidence of %.0f steps from the state store (flushed "
                     "%.1f s ago)", own[0].evidence.steps, self._clock() - own[0].at)
        self._costs_restored = True

    def _set_recommendations(self, recs: tuple[Recommendation, ...], now: float
                             ) -> list[Recommendation]:
        """Keep the latest; log each class whose recommended (pool, draft) changed, and return
        those."""
        before = {r.traffic_class: (r.pool, r.draft) for r in self.recommendations}
        changed = []
        for r in recs:
            if before.get(r.traffic_class) != (r.pool, r.draft):
                changed.append(r)
                best = r.options[0]
                runner_up = (f"; next {r.options[1].pool} {r.options[1].draft or 'off'} "
                             f"{r.options[1].goodput:.0f}") if len(r.options) > 1 else ""
                log.info("recommendation for class %s at batch %d: %s pool, draft %s "
                         "(%.0f tokens/s%s)", safe_name(r.traffic_class), r.batch_size, r.pool,
                         safe_name(r.draft or "none"), best.goodput, safe_name(runner_up))
        self.recommendations, self.recommended_at = recs, now
        if self._metrics is not None:
            self._metrics.recommendations(recs)
        return changed

    def record_decisions(self, events: Sequence[DecisionEvent]) -> None:
        """Decisions to append to the fleet's log at the next round (the oldest are dropped
        beyond the log's size while the store is away)."""
        self._pending.extend(events)

    # --- overrides ------------------------------------------------------------------------------
    async def _load_overrides(self, model: str) -> None:
        overrides = await self._store.overrides(model)
        before = self._core.fleet_overrides()
        for ov, reason in self._core.set_fleet_overrides(overrides):
            if (ov.traffic_class, ov.set_at) not in self._refused:
                self._refused.add((ov.traffic_class, ov.set_at))
                log.warning("fleet override on %s (set through %s) not in force here: %s",
                            safe_name(ov.traffic_class), safe_name(ov.set_by or "?"),
                            safe_name(reason, 300))
        if self._core.fleet_overrides() != before and self._decide is not None:
            self._decide(self._clock())

    async def set_override(self, override: Override) -> None:
        """Put a fleet override in force on every sidecar of the model, this one first.
        ValueError (naming the field) when it cannot be tracked here or the model is unknown;
        StoreUnavailable when the store did not take it (nothing changed then)."""
        self._core.check_override(override)
        model = self._known_model()
        await self._store.put_override(model, override)
        await self._load_overrides(model)

    async def clear_override(self, traffic_class: str) -> bool:
        """Lift the fleet override on ``traffic_class`` everywhere; False when none was set."""
        model = self._known_model()
        cleared = await self._store.clear_override(model, traffic_class)
        await self._load_overrides(model)
        return cleared

    async def _watch_overrides(self) -> None:
        """Reload the fleet's overrides whenever the store announces a change; resubscribe
        after a failure (the rounds report the store's state)."""
        failures = 0
        while True:
            model = self.model()
            if model:
                try:
                    async for _ in self._store.override_changes(model):
                        failures = 0
                        await self._load_overrides(model)
                except StoreUnavailable:
                    failures += 1
                except Exception:  # a bug here must not stop the subscription for good
                    log.exception("fleet override subscription failed")
                    failures += 1
            await asyncio.sleep(self._backoff(max(failures, 1)))

    # --- running --------------------------------------------------------------------------------
    def _backoff(self, failures: int) -> float:
        factor = min(2.0 ** (failures - 1), _MAX_BACKOFF_FACTOR)
        return float(self._interval * factor * (0.5 + self._rng.random()))

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

    async def _rounds(self) -> None:
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
                delay = self._backoff(failures)
            except Exception:  # a bug here must not stop sharing for good
                log.exception("fleet round failed")
                delay = self._interval
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), delay)
            self._wake.clear()

    def flush_soon(self) -> None:
        """Run the next round now rather than at the end of the interval (an engine left:
        what it taught is published at once, not lost if the sidecar is killed before the
        next round); not while the store is failing, whose retries keep their backoff."""
        if self._up is not False:
            self._wake.set()

    async def run(self) -> None:
        """Rounds and the override subscription, until cancelled."""
        await asyncio.gather(self._rounds(), self._watch_overrides())

    async def final_flush(self, timeout_seconds: float) -> None:
        """One last round on a graceful stop, so a planned restart loses nothing; a store that
        does not answer in time only costs that round."""
        try:
            await asyncio.wait_for(self.sync_once(), timeout_seconds)
        except (StoreUnavailable, TimeoutError):
            log.warning("final flush to the state store did not complete")
