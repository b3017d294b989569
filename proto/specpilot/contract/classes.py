"""Traffic-class names the system reserves, and the one rule that folds classes beyond a limit.

``default`` is the class of a request nothing else names; ``other`` is where names beyond the
class limit go. The engine plugin (``specpilot.engine_plugin.classify``) and the controller's core
(``ControllerCore.ingest``) fold with the same rule, so an engine with the controller's limit
never sends a name the controller would have to fold.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

DEFAULT_CLASS = "default"
OTHER_CLASS = "other"


def fold_class(name: str, tracked: Collection[str], max_classes: int) -> str:
    """The class ``name`` counts under, given the names ``tracked`` so far: itself when it is
    tracked already, is ``other``, or there is room for one more (``len(tracked) <
    max_classes``); else ``other``. Pure: admitting the name is the caller's business."""
    if name in tracked or name == OTHER_CLASS or len(tracked) < max_classes:
        return name
    return OTHER_CLASS


def fold_classes(names: Iterable[str], tracked: Collection[str],
                 max_classes: int) -> tuple[dict[str, str], tuple[str, ...]]:
    """``fold_class`` for a batch of names, in order, as if each name admitted earlier in the
    batch were tracked already: the class of each distinct name, and the names admitted (new,
    in order of first sight; ``other`` is never counted among them). ``tracked`` is not changed,
    so a caller can decide the whole mapping before any state changes."""
    mapping: dict[str, str] = {}
    admitted: dict[str, None] = {}
    # ``tracked`` plus the names admitted so far, for membership and the count.
    seen = dict.fromkeys(tracked)
    for name in names:
        if name in mapping:
            continue
        folded = mapping[name] = fold_class(name, seen, max_classes)
        if folded != OTHER_CLASS and folded not in seen:
            seen[folded] = None
            admitted[folded] = None
    return mapping, tuple(admitted)
