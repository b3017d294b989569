"""The traffic classes the controller tracks, each in one of ``max_classes`` slots.

Declared and offline classes hold their slots for good (offline ones are pinned off from the first
policy on instead of running the warm-up K until a report names them). A report's new name takes a
free slot, else the slot of the least recently reported class no connected engine holds; it folds
into "other" when there is none, or when its engine holds its share of the slots already. A class
no engine reported for ``class_idle_seconds`` gives its slot back (``idle``).
"""

from __future__ import annotations

import math
from collections.abc import Container, Iterable, Iterator
from dataclasses import dataclass, field

from specpilot.contract.classes import fold_class, fold_classes
from specpilot.contract.records import DEFAULT_CLASS, OTHER_CLASS, Decision
from specpilot.controller.core.config import CoreConfig


@dataclass
class ClassState:
    """One tracked class: its decisions per bucket and what they were decided on, and who
    reports it."""

    decisions: dict[int, Decision] = field(default_factory=dict)
    changed_at: dict[int, float] = field(default_factory=dict)
    # When each bucket was last decided, and when acceptance evidence for the class last came.
    decided_at: dict[int, float] = field(default_factory=dict)
    evidence_at: float = -math.inf
    change_pending: bool = False
    # Connected engines that reported the class, and when each last did; when anyone last did.
    holders: dict[str, float] = field(default_factory=dict)
    reported_at: float = -math.inf


class ClassTable:
    """Tracked classes by name, in the order they were first tracked (the order decide rounds
    take their draws in)."""

    def __init__(self, config: CoreConfig) -> None:
        self.max_classes = config.max_classes
        self.idle_seconds = config.class_idle_seconds
        self._classes: dict[str, ClassState] = {DEFAULT_CLASS: ClassState()}
        self.declared = frozenset({DEFAULT_CLASS}) | frozenset(
            sorted(config.offline_classes | config.declared_classes)[: config.max_classes - 1])
        for name in sorted(self.declared):
            self._classes.setdefault(name, ClassState())

    def __contains__(self, name: object) -> bool:
        return name in self._classes

    def __iter__(self) -> Iterator[tuple[str, ClassState]]:
        return iter(self._classes.items())

    def __len__(self) -> int:
        return len(self._classes)

    def __getitem__(self, name: str) -> ClassState:
        return self._classes[name]

    def get(self, name: str) -> ClassState | None:
        return self._classes.get(name)

    def names(self) -> list[str]:
        return sorted(self._classes)

    def track(self, name: str) -> ClassState:
        """The class's record, tracking it from now on if it was not."""
        return self._classes.setdefault(name, ClassState())

    def remove(self, name: str) -> bool:
        """Stop tracking ``name``; whether it was tracked."""
        return self._classes.pop(name, None) is not None

    def canonical(self, name: str) -> str:
        """The tracked class for ``name`` now (unknown names beyond the limit map to "other")."""
        return fold_class(name, self._classes, self.max_classes)

    def fold(self, names: Iterable[str]) -> tuple[dict[str, str], tuple[str, ...]]:
        """``fold_classes`` against the classes tracked now (nothing changes)."""
        return fold_classes(names, self._classes, self.max_classes)

    def evictable(self, name: str, overridden: Container[str]) -> bool:
        """Whether the class may give its slot back: not declared, not "other", no override
        of its own (``overridden``: an override pins what its traffic runs once it comes)."""
        return name not in self.declared and name != OTHER_CLASS and name not in overridden

    def admit(self, engine_id: str, names: Iterable[str], engines: int,
              overridden: Container[str]) -> tuple[dict[str, str], tuple[str, ...],
                                                   tuple[str, ...]]:
        """The class each of a report's names counts under, the names it admits and the
        classes it evicts for them; nothing changes (``take`` applies it). ``engines``: how
        many are connected (with several, each may hold its share of the free slots)."""
        mapping, admitted = fold_classes(names, self._classes, self.max_classes)
        folded = [n for n, v in mapping.items() if v == OTHER_CLASS and n != OTHER_CLASS]
        held = sum(engine_id in s.holders for n, s in self._classes.items()
                   if n not in self.declared and n != OTHER_CLASS)
        # With several engines: the slots left after the declared classes and "other" (one
        # slot, as the plugin's classifier counts it), over the engines, rounded up. Alone, an
        # engine may fill the table.
        free = self.max_classes - len(self.declared) - 1
        share = -(-free // engines) if engines > 1 else self.max_classes
        kept = []
        for name in admitted:  # free slots
            if held < share:
                kept.append(name)
                held += 1
            else:
                mapping[name] = OTHER_CLASS
        named = set(mapping.values())  # never evict a class this report names
        vacant = sorted((s.reported_at, n) for n, s in self._classes.items()
                        if not s.holders and n not in named and self.evictable(n, overridden))
        evicted = []
        for name in folded:  # slots of departed engines' classes
            if held >= share or not vacant:
                break
            evicted.append(vacant.pop(0)[1])
            mapping[name] = name
            kept.append(name)
            held += 1
        return mapping, tuple(kept), tuple(evicted)

    def take(self, engine_id: str, mapping: dict[str, str], admitted: tuple[str, ...],
             now: float) -> None:
        """Apply an admission (``admit``): track the admitted classes (and "other" where names
        fold into it) and note that ``engine_id`` reported every class of ``mapping`` now."""
        for name in [*admitted, *(v for v in mapping.values() if v == OTHER_CLASS)]:
            self._classes.setdefault(name, ClassState())
        for cls in set(mapping.values()):
            self._classes[cls].holders[engine_id] = now
            self._classes[cls].reported_at = now

    def release(self, engine_id: str) -> None:
        """``engine_id`` left: it holds no class any more."""
        for state in self._classes.values():
            state.holders.pop(engine_id, None)

    def idle(self, now: float, overridden: Container[str]) -> tuple[str, ...]:
        """The classes no engine reported for ``class_idle_seconds`` that may give their slots
        back (``evictable``), by name; engines silent on a class that long stop holding it."""
        limit = now - self.idle_seconds
        for state in self._classes.values():
            for engine_id in [e for e, at in state.holders.items() if at < limit]:
                del state.holders[engine_id]
        return tuple(sorted(n for n, s in self._classes.items()
                            if s.reported_at < limit and not s.holders
                            and self.evictable(n, overridden)))
