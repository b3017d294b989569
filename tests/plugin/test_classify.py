"""Traffic classes: the caller's label, then rules in order, then "default"; bounded names."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from specpilot.engine_plugin.classify import (
    Classifier,
    ClassRule,
    load_rules,
    parse_rules,
)

RULES = """
rules:
  - class: offline
    min_prompt_tokens: 1000
    max_max_tokens: 64
  - class: summarise
    lora: sum-v2
  - class: long
    min_prompt_tokens: 4000
"""


@pytest.fixture
def rules_file(tmp_path: Path) -> Path:
    path = tmp_path / "rules.yaml"
    path.write_text(RULES)
    return path


def test_rules_file_is_parsed(rules_file: Path) -> None:
    assert load_rules(rules_file) == (
        ClassRule("offline", min_prompt_tokens=1000, max_max_tokens=64),
        ClassRule("summarise", lora="sum-v2"),
        ClassRule("long", min_prompt_tokens=4000),
    )


def test_precedence(rules_file: Path) -> None:
    c = Classifier.from_file(rules_file, max_classes=16)
    # The caller's label wins over every rule.
    assert c.classify({"traffic_class": "chat"}, "sum-v2", 5000, 10) == "chat"
    # Rules in file order: the first that matches wins.
    assert c.classify(None, "sum-v2", 5000, 10) == "offline"
    assert c.classify({}, "sum-v2", 5000, 100) == "summarise"
    assert c.classify({"other_arg": 1}, None, 5000, None) == "long"
    # All conditions of a rule must hold; no max_tokens limit does not satisfy max_max_tokens.
    assert c.classify(None, None, 999, 10) == "default"
    assert c.classify(None, None, 1000, None) == "default"
    assert c.classify(None, None, 1000, 64) == "offline"
    assert c.classify(None, "other-lora", 10, 10) == "default"


@pytest.mark.parametrize("label", [
    "", " chat", "-chat", "chat!", "a" * 65, 7, None, ["chat"], b"chat", {"x": 1},
])
def test_invalid_labels_are_treated_as_absent(label: Any) -> None:
    c = Classifier([ClassRule("ruled", lora="x")])
    assert c.classify({"traffic_class": label}, "x", 1, 1) == "ruled"
    assert c.classify({"traffic_class": label}, None, 1, 1) == "default"


def test_valid_label_edge_cases() -> None:
    c = Classifier()
    for name in ("a" * 64, "team/chat:v1.2_x-y", "0"):
        assert c.classify({"traffic_class": name}, None, 0, None) == name


def test_names_fold_into_other_beyond_max_classes() -> None:
    c = Classifier(max_classes=4)  # default, other and two more
    seen = [c.classify({"traffic_class": f"c{i}"}, None, 0, None) for i in range(6)]
    assert seen == ["c0", "c1", "other", "other", "other", "other"]
    # Admitted names keep their class; default and other are always available.
    assert c.classify({"traffic_class": "c1"}, None, 0, None) == "c1"
    assert c.classify(None, None, 0, None) == "default"
    assert c.classify({"traffic_class": "other"}, None, 0, None) == "other"
    assert set(c.classes) == {"default", "other", "c0", "c1"}
    many = {c.classify({"traffic_class": f"n{i}"}, None, 0, None) for i in range(100)}
    assert many == {"other"} and len(c.classes) <= 4


def test_rule_classes_count_against_the_limit_too() -> None:
    c = Classifier([ClassRule("ruled", lora="x")], max_classes=3)
    assert c.classify({"traffic_class": "first"}, None, 0, None) == "first"
    assert c.classify(None, "x", 0, None) == "other"


def test_a_rule_without_conditions_catches_all() -> None:
    c = Classifier([ClassRule("narrow", lora="x"), ClassRule("rest")])
    assert c.classify(None, "x", 0, None) == "narrow"
    assert c.classify(None, None, 0, None) == "rest"


def test_limit_can_only_shrink() -> None:
    c = Classifier(max_classes=8)
    c.set_max_classes(3)
    c.set_max_classes(100)
    assert c.max_classes == 3


def test_classify_never_raises() -> None:
    c = Classifier([ClassRule("big", min_prompt_tokens=10)])

    class Hostile(dict[str, Any]):
        def get(self, *args: Any) -> Any:
            raise RuntimeError("boom")

    assert c.classify(Hostile(x=1), None, 0, None) == "default"
    assert c.classify(None, None, "many", None) == "default"  # type: ignore[arg-type]


@pytest.mark.parametrize(("text", "message"), [
    ("rules:\n  - class: ok\n  - lora: x\n", "rules[1].class: missing"),
    ("rules:\n  - class: ok\n  - class: 'bad name'\n", "rules[1].class: 'bad name' must"),
    ("rules:\n  - class: ok\n    min_prompt_tokens: -1\n", "rules[0].min_prompt_tokens: expected"),
    ("rules:\n  - class: ok\n    max_max_tokens: 1.5\n", "rules[0].max_max_tokens: expected"),
    ("rules:\n  - class: ok\n    max_max_tokens: true\n", "rules[0].max_max_tokens: expected"),
    ("rules:\n  - class: ok\n    lora: ''\n", "rules[0].lora: expected a non-empty string"),
    ("rules:\n  - class: a\n  - class: b\n  - class: c\n    prompt: 3\n",
     "rules[2].prompt: unknown field"),
    ("rules:\n  - just-a-string\n", "rules[0]: expected a mapping"),
    ("rules: {class: x}\n", "rules: expected a list"),
    ("- class: x\n", "expected a mapping with a 'rules' list"),
    ("rules: []\nextra: 1\n", "unknown top-level key 'extra'"),
    ("rules: [\n", "class rules file"),
])
def test_bad_rules_files_name_index_and_field(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "rules.yaml"
    path.write_text(text)
    with pytest.raises(ValueError) as err:
        load_rules(path)
    assert message in str(err.value)
    assert str(path) in str(err.value)


def test_missing_and_empty_files(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="No such file"):
        load_rules(tmp_path / "absent.yaml")
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    assert load_rules(empty) == ()
    assert parse_rules({"rules": None}) == ()
    assert Classifier.from_file(None).rules == ()
    assert Classifier.from_file("").rules == ()


def test_max_classes_below_two_is_refused() -> None:
    with pytest.raises(ValueError, match="max_classes"):
        Classifier(max_classes=1)
