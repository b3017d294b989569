"""The one folding rule: names beyond the class limit go to "other", decided in order; the plugin's
classifier and the core's ingest both follow it."""

from __future__ import annotations

from specpilot.contract.classes import DEFAULT_CLASS, OTHER_CLASS, fold_class, fold_classes
from specpilot.contract.records import DEFAULT_CLASS as TYPES_DEFAULT
from specpilot.contract.records import OTHER_CLASS as TYPES_OTHER
from specpilot.engine_plugin.classify import Classifier


def test_reserved_names_are_defined_once() -> None:
    assert (DEFAULT_CLASS, OTHER_CLASS) == ("default", "other")
    assert (TYPES_DEFAULT, TYPES_OTHER) == (DEFAULT_CLASS, OTHER_CLASS)


def test_fold_class() -> None:
    tracked = {"default", "a"}
    assert fold_class("a", tracked, 2) == "a"  # tracked: always itself
    assert fold_class("b", tracked, 3) == "b"  # room for one more
    assert fold_class("b", tracked, 2) == OTHER_CLASS  # no room
    assert fold_class(OTHER_CLASS, tracked, 2) == OTHER_CLASS  # "other" is never folded


def test_fold_classes_decides_in_order_and_changes_nothing() -> None:
    tracked = {"default": None}
    mapping, admitted = fold_classes(["a", "b", "a", OTHER_CLASS, "c", "b"], tracked, 3)
    # "default" + a + b fill the limit; "other" does not count as admitted; c folds.
    assert mapping == {"a": "a", "b": "b", OTHER_CLASS: OTHER_CLASS, "c": OTHER_CLASS}
    assert admitted == ("a", "b")
    assert tracked == {"default": None}


def test_classifier_folds_like_the_rule() -> None:
    c = Classifier(max_classes=4)  # "default" and "other" hold two slots
    names = [f"c{i}" for i in range(4)]
    got = [c.classify({"traffic_class": n}, None, 1, None) for n in names]
    mapping, _ = fold_classes(names, [DEFAULT_CLASS, OTHER_CLASS], 4)
    assert got == [mapping[n] for n in names] == ["c0", "c1", OTHER_CLASS, OTHER_CLASS]
