"""Operator overrides in force, in two layers: this pod's own and the fleet's.

For a class the one in force is its own before "*", and at each level the pod's before the
fleet's. An override may name only a class the controller can track; an operator's must also stay
within the policy API's bounds (``check_operator``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import replace

from specpilot.contract.records import ALL_CLASSES, OTHER_CLASS, Override, OverrideScope
from specpilot.contract.validation import check_class_name, valid_class_name
from specpilot.controller.core.class_table import ClassTable
from specpilot.controller.core.config import CoreConfig

# An override's note is a sentence for the audit log, not a document.
MAX_NOTE_CHARS = 1000


class Overrides:
    def __init__(self, config: CoreConfig, classes: ClassTable) -> None:
        self._config = config
        self._classes = classes
        # By scope, then class.
        self._layers: dict[OverrideScope, dict[str, Override]] = {
            scope: {} for scope in OverrideScope}

    def __contains__(self, traffic_class: object) -> bool:
        """Whether the class has an override of its own, in either layer."""
        return any(traffic_class in layer for layer in self._layers.values())

    def covering(self, traffic_class: str) -> list[Override]:
        """Every override that covers ``traffic_class``, the one in force first."""
        return [layer[c] for c in (traffic_class, ALL_CLASSES)
                for layer in (self._layers[OverrideScope.POD],
                              self._layers[OverrideScope.FLEET]) if c in layer]

    def in_force(self, traffic_class: str) -> Override | None:
        covering = self.covering(traffic_class)
        return covering[0] if covering else None

    def all(self) -> tuple[Override, ...]:
        """The pod's by class, then the fleet's by class."""
        return tuple(ov for scope in OverrideScope
                     for _, ov in sorted(self._layers[scope].items()))

    def fleet(self) -> tuple[Override, ...]:
        """The fleet layer as last set, by class."""
        layer = self._layers[OverrideScope.FLEET]
        return tuple(layer[c] for c in sorted(layer))

    def check(self, override: Override) -> None:
        """ValueError (naming the field) when ``override`` names a class that cannot be
        tracked; changes nothing."""
        name = override.traffic_class
        if name == ALL_CLASSES:
            return
        check_class_name(name, "override.traffic_class")
        if self._classes.canonical(name) != name:
            raise ValueError(
                f"override.traffic_class: {name!r} is new and the class limit "
                f"(max_classes={self._config.max_classes}) is reached, so its traffic is "
                f"folded into {OTHER_CLASS!r}: override {OTHER_CLASS!r} instead")

    def check_operator(self, override: Override, offered: Sequence[str],
                       largest_k: int | None = None) -> None:
        """What an operator's override must also satisfy (the policy API's bounds; overrides
        the core is given directly, as in tests, skip them): K at most the policy's max K and
        at most ``largest_k``, the largest K the connected engines offer (None: no engine
        connected; a pin is then taken, and capped at an engine's largest K once one
        connects, as when an engine with a smaller one replaces another), a forced draft one
        of the connected engines offer (``offered``) or a declared one (the same rule with or
        without engines), a note of at most MAX_NOTE_CHARS, and a class that is declared or
        that an engine has reported (else any client could take the class slots with
        overrides). ValueError naming the field and how to declare what it lacks."""
        self.check(override)
        max_k = self._config.policy.max_k
        if override.pin_k is not None and not 0 <= override.pin_k <= max_k:
            raise ValueError(f"override.pin_k: {override.pin_k} outside 0..max_k {max_k}")
        if override.pin_k and largest_k is not None and override.pin_k > largest_k:
            # Taken, it would run as the engines' largest K while the policy showed the pin.
            if largest_k == 0:
                raise ValueError(
                    f"override.pin_k: {override.pin_k}, but the connected engines offer no "
                    "speculation (no draft of theirs was accepted; the controller's log says "
                    "why): pin 0 or force speculation off, or connect an engine with "
                    "speculative decoding configured")
            raise ValueError(
                f"override.pin_k: {override.pin_k} is above {largest_k}, the largest K the "
                f"connected engines offer: pin {largest_k} or less (0 turns speculation off), "
                "or restart the engines with a larger num_speculative_tokens")
        known = [*offered, *sorted(self._config.declared_drafts.difference(offered))]
        if (draft := override.force_draft) is not None and draft not in known:
            named = draft if valid_class_name(draft) else "NAME"
            raise ValueError(
                f"override.force_draft: {draft[:80]!r} is neither a draft a connected engine "
                f"offers nor a declared one (known: {', '.join(known) or 'none'}); declare it "
                f"in the controller's settings and restart it (declared_drafts: [\"{named}\"] "
                f"in the settings file, or SPECPILOT_DECLARED_DRAFTS='[\"{named}\"]'), or "
                "connect an engine that offers it")
        if len(override.note) > MAX_NOTE_CHARS:
            raise ValueError(f"override.note: {len(override.note)} characters, at most "
                             f"{MAX_NOTE_CHARS}")
        name = override.traffic_class
        if name != ALL_CLASSES and name not in self._classes:
            raise ValueError(
                f"override.traffic_class: {name[:80]!r} is neither a class an engine has "
                "reported nor a declared one; declare it in the controller's settings and "
                f"restart it (declared_classes: [\"{name}\"] in the settings file, or "
                f"SPECPILOT_DECLARED_CLASSES='[\"{name}\"]'), or send a request of that class "
                "first")

    def set(self, override: Override) -> None:
        """Put ``override`` in force in its scope's layer, tracking its class. ValueError
        (naming the field), changing nothing, for a class that cannot be tracked."""
        self._track(override)
        self._layers[override.scope][override.traffic_class] = override

    def clear(self, traffic_class: str, scope: OverrideScope) -> bool:
        """Lift the override of ``scope`` on ``traffic_class``; False if none was set."""
        return self._layers[scope].pop(traffic_class, None) is not None

    def set_fleet(self, overrides: Iterable[Override]) -> list[tuple[Override, str]]:
        """Replace the fleet layer; returns the overrides refused, each with the reason."""
        layer: dict[str, Override] = {}
        refused = []
        for ov in overrides:
            try:
                self._track(ov)
            except ValueError as exc:
                refused.append((ov, str(exc)))
                continue
            layer[ov.traffic_class] = replace(ov, scope=OverrideScope.FLEET)
        self._layers[OverrideScope.FLEET] = layer
        return refused

    def _track(self, override: Override) -> None:
        self.check(override)
        if override.traffic_class != ALL_CLASSES:
            self._classes.track(override.traffic_class)
