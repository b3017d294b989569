"""Load shedding for engine reports, so health checks and the policy API always find the loop.

Everything on the server runs on one asyncio loop. Reports are the only work that grows with the
fleet: each costs its ingest (~0.6 ms for a busy one) plus its share of the decide round it
prompts, so past about 150 reports a second a core is busy with them alone and every health
check and ``GetPolicy`` waits behind the backlog (a kubelet would restart a controller that is
only busy). ``ReportBudget`` caps that work at a share of the loop's time per window: within the
budget reports are taken; beyond it they are shed at once, answered with RESOURCE_EXHAUSTED and
counted, and the plugin keeps the payload, slows its report interval and sends it again later.
Heartbeats (reports with no records) are always taken: they cost nothing and keep the engine
from being dropped as silent.

``LoopLag`` measures how late the loop runs a timer, the one figure that says whether anything
(reports or not) is starving it; it is exported as a gauge.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

# The budget's window, seconds: short enough that a burst is shed within it, long enough that
# one slow round does not shed the reports right after it.
WINDOW_SECONDS = 1.0
# How often LoopLag's timer fires, seconds.
LAG_PROBE_SECONDS = 0.1


class ReportBudget:
    """Loop time that reports (their ingest and the rounds they prompt) may take: ``share`` of
    each ``WINDOW_SECONDS`` window. ``max_retry_after``: the longest pause a shed report is
    told to wait, seconds (the server passes a quarter of its engine silence timeout, so an
    engine that honours the pause is never dropped as silent)."""

    def __init__(self, share: float, clock: Callable[[], float] = time.perf_counter,
                 max_retry_after: float = 15.0) -> None:
        if not 0 < share <= 1:
            raise ValueError(f"share: must be in (0, 1], got {share}")
        if not max_retry_after > 0:
            raise ValueError(f"max_retry_after: must be > 0, got {max_retry_after}")
        self._max_retry_after = max_retry_after
        self._allowed = share * WINDOW_SECONDS
        self._clock = clock
        self._start = clock()
        self._spent = 0.0

    def _roll(self, now: float) -> None:
        if now - self._start >= WINDOW_SECONDS:
            # Work beyond a window's budget is carried into the next, so a round longer than a
            # window still sheds what comes after it.
            self._spent = max(0.0, self._spent - self._allowed)
            self._start = now

    def admit(self) -> bool:
        """Whether a report may be ingested now."""
        self._roll(self._clock())
        return self._spent < self._allowed

    def spend(self, seconds: float) -> None:
        """Account for ``seconds`` of loop time spent on reports."""
        self._spent += max(seconds, 0.0)

    def retry_after_seconds(self) -> float:
        """When the budget has room again, seconds from now (at least the window's rest), at
        most ``max_retry_after``."""
        now = self._clock()
        self._roll(now)
        windows = max(self._spent - self._allowed, 0.0) / self._allowed
        due = WINDOW_SECONDS - (now - self._start) + windows * WINDOW_SECONDS
        return min(due, self._max_retry_after)


class LoopLag:
    """How late the running loop fires a timer (the most recent probe), seconds."""

    def __init__(self) -> None:
        self.seconds = 0.0

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + LAG_PROBE_SECONDS
            await asyncio.sleep(LAG_PROBE_SECONDS)
            self.seconds = max(loop.time() - due, 0.0)
