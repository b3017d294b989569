"""Which requests a step scores counterfactually with the deterministic drafts it does not run.

A request's score point is fixed (``score_point``). A step scores the requests whose point is
below ``per_step`` over the running requests (about ``per_step`` a step, whatever the batch
size), and the first request by point of every class that has none of those (so each class's
evidence starts within a step or two, not when one of its requests happens to draw a low point;
at most ``CLASS_SCAN`` requests looked at per class, and ``COUNTERFACTUAL_CLASS_PICKS`` classes
a step, taken in turn).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from typing import TypeVar

from specpilot.engine_plugin.policy.points import probe_point

# Requests of a class looked at, lowest point first, for the one it scores each step.
CLASS_SCAN = 8
# Classes scored that way in one step at most, taken in turn: the per-step cost stays bounded
# however many classes share the batch (with 64, each is scored every 8th step).
COUNTERFACTUAL_CLASS_PICKS = 8
T = TypeVar("T")


def score_point(request_key: str) -> float:
    """The request's fixed point in [0, 1) for counterfactual scoring (apart from its probe
    points: the requests scored are not the ones probed)."""
    return probe_point(request_key + "#ngram")


def take_in_turn(items: Sequence[T], take: Callable[[T], bool], turn: int, most: int) -> int:
    """Offer ``items`` to ``take`` from position ``turn`` (modulo their number) on, wrapping
    around, until it has taken ``most`` (it answers whether it took one); the ``turn`` to start
    from next time, past the last item offered."""
    start = turn % max(len(items), 1)
    taken = offered = 0
    for item in (*items[start:], *items[:start]):
        if taken == most:
            break
        offered += 1
        taken += take(item)
    return start + offered


class CounterfactualPicks:
    """The requests the engine holds, by score point and per traffic class, and the class turn.
    ``per_step``: requests scored per step on average by the point rule."""

    def __init__(self, per_step: float) -> None:
        self.per_step = per_step
        self._classes: dict[str, str] = {}  # request key -> traffic class
        # (point, key) of every request held, in order: a step scores a prefix; and the same per
        # traffic class (in the order the classes came), for each class's first.
        self._by_point: list[tuple[float, str]] = []
        self._class_points: dict[str, list[tuple[float, str]]] = {}
        self._turn = 0  # where the next step's per-class picks start among the classes

    def __contains__(self, request_key: object) -> bool:
        return request_key in self._classes

    def add(self, request_key: str, traffic_class: str) -> None:
        """A request the engine now holds (not held already: ``forget`` it first)."""
        self._classes[request_key] = traffic_class
        entry = (score_point(request_key), request_key)
        bisect.insort(self._by_point, entry)
        bisect.insort(self._class_points.setdefault(traffic_class, []), entry)

    def forget(self, request_key: str) -> None:
        """A request the engine no longer holds (unknown keys are ignored)."""
        traffic_class = self._classes.pop(request_key, None)
        if traffic_class is None:
            return
        entry = (score_point(request_key), request_key)
        mine = self._class_points[traffic_class]
        for points in (self._by_point, mine):
            i = bisect.bisect_left(points, entry)
            if i < len(points) and points[i][1] == request_key:
                del points[i]
        if not mine:  # the class's last request: it no longer takes a turn
            del self._class_points[traffic_class]

    def pick(self, eligible: Callable[[str], T | None], running: int) -> list[tuple[str, T]]:
        """This step's picks among the requests for which ``eligible`` answers something (not
        None: what the caller scores them with), ``running`` requests running."""
        threshold = self.per_step / max(running, 1)
        chosen: list[tuple[str, T]] = []
        covered: set[str] = set()
        for point, key in self._by_point:
            if point >= threshold:
                break
            if (found := eligible(key)) is not None:
                chosen.append((key, found))
                covered.add(self._classes[key])

        def first_of(traffic_class: str) -> bool:
            if traffic_class in covered:
                return False
            for _, key in self._class_points[traffic_class][:CLASS_SCAN]:
                if (found := eligible(key)) is not None:
                    chosen.append((key, found))
                    return True
            return False

        self._turn = take_in_turn(list(self._class_points), first_of, self._turn,
                                  COUNTERFACTUAL_CLASS_PICKS)
        return chosen
