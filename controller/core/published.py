"""What engines and watchers were last given: the policy version, the composition it carries and
the decision log.

A policy version is epoch x 2^EPOCH_SHIFT + the rounds that changed the policy since start, so a
restarted controller (a later epoch: its start time in tenths of a second, EPOCHS_PER_SECOND)
never sends a version below one its predecessor sent, unless that one made over 2^16 versions
per tenth of a second of uptime (a round changes the policy at most ~100 times a second).
2^16 keeps versions below 2^53 until the year 6000: exact in JSON and JavaScript.
"""

from __future__ import annotations

from collections import deque
from dataclasses import replace

from specpilot.contract.pricing import Composition
from specpilot.contract.records import DecisionEvent

EPOCH_SHIFT = 16
EPOCHS_PER_SECOND = 10


def epoch_at(unix_seconds: float) -> int:
    """The policy epoch of a controller started at ``unix_seconds``."""
    return int(unix_seconds * EPOCHS_PER_SECOND)


class PublishedPolicy:
    def __init__(self, epoch: int, log_size: int) -> None:
        if not 0 <= epoch < 2 ** (63 - EPOCH_SHIFT):
            raise ValueError(f"epoch: {epoch} outside 0..2^{63 - EPOCH_SHIFT}")
        self.epoch = epoch
        self.version = epoch << EPOCH_SHIFT
        # The composition the current version carries (None: no connected engine can use one).
        self.composition: Composition | None = None
        self._log: deque[DecisionEvent] = deque(maxlen=log_size)
        self._forgotten = False  # a class was forgotten since the last version

    @property
    def log(self) -> tuple[DecisionEvent, ...]:
        """The recent decisions, oldest first."""
        return tuple(self._log)

    def class_forgotten(self) -> None:
        """A class left the table: the next round's policy no longer lists it."""
        self._forgotten = True

    def publish(self, events: list[DecisionEvent], material: bool) -> list[DecisionEvent]:
        """A round's events, stamped with the version that carries them (a new one when the
        round changed what engines must apply, or a class was forgotten), and logged."""
        if material or self._forgotten:
            self.version += 1
            self._forgotten = False
        stamped = [replace(e, policy_version=self.version) for e in events]
        self._log.extend(stamped)
        return stamped

    def versions_behind(self, applied: int) -> int:
        """Versions of this epoch an engine that applied ``applied`` has yet to apply."""
        start = self.epoch << EPOCH_SHIFT
        if applied < start:  # its static configuration, or a previous controller's policy
            return self.version - start + 1
        return max(self.version - applied, 0)  # above ours: a later controller's, not behind
