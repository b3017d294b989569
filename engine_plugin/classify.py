"""Traffic class of a request: the caller's own label, then configured rules, then ``default``.

Precedence, first match wins:

1. ``SamplingParams.extra_args["traffic_class"]`` (the OpenAI server fills ``extra_args`` from the
   request body's ``vllm_xargs``). It must be a string that is a valid class name, the
   controller's rule: ``^[A-Za-z0-9][A-Za-z0-9_.:/-]*$``, at most 64 characters. Anything else is
   treated as absent (never an error: the request is served either way).
2. The rules of the class-rules file, in file order.
3. ``default``.

At most ``max_classes`` distinct names are ever returned, ``default`` and ``other`` included: once
the limit is reached, a name not seen before is folded into ``other``. Names seen earlier keep
their own class. The controller counts ``other`` only once it has seen it, so this is at least as
strict: with the same ``max_classes`` (``set_max_classes`` adopts the HelloAck's), the controller
never has to fold this engine's classes.

Class-rules file (YAML; ``SPECPILOT_PLUGIN_CLASS_RULES`` names it)::

    rules:
      # Long prompts with short answers are offline batch work.
      - class: offline
        min_prompt_tokens: 2000
        max_max_tokens: 64
      # Everything served through this LoRA adapter.
      - class: summarise
        lora: summarise-v2
      # A rule without conditions matches every request (a catch-all).

Each rule has ``class`` (a valid class name) and any of these conditions, all of which must hold:

- ``lora``: the request's LoRA adapter name equals this string;
- ``min_prompt_tokens``: the prompt has at least this many tokens (integer >= 0);
- ``max_max_tokens``: the request sets ``max_tokens`` and it is at most this (integer >= 0);
  a request without a ``max_tokens`` limit does not match.

An empty file means no rules. Any other key, a missing or bad ``class`` or a bad condition value
raises ValueError naming the rule's index and the field (``rules[2].min_prompt_tokens: ...``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

# The controller's own rules (names, folding), so the engine never sends a name the controller
# would reject or fold.
from specpilot.contract.classes import DEFAULT_CLASS, OTHER_CLASS, fold_class
from specpilot.contract.validation import (
    CLASS_NAME_PATTERN,
    MAX_CLASS_NAME_LENGTH,
    valid_class_name,
)

log = logging.getLogger(__name__)

TRAFFIC_CLASS_ARG = "traffic_class"

_CONDITIONS = ("lora", "min_prompt_tokens", "max_max_tokens")
_RULE_KEYS = ("class", *_CONDITIONS)


@dataclass(frozen=True)
class ClassRule:
    """One rule: ``traffic_class`` when every condition that is set holds."""

    traffic_class: str
    lora: str | None = None
    min_prompt_tokens: int | None = None
    max_max_tokens: int | None = None

    def matches(self, lora_name: str | None, prompt_tokens: int, max_tokens: int | None) -> bool:
        if self.lora is not None and lora_name != self.lora:
            return False
        if self.min_prompt_tokens is not None and prompt_tokens < self.min_prompt_tokens:
            return False
        return self.max_max_tokens is None or (
            max_tokens is not None and max_tokens <= self.max_max_tokens)


def parse_rules(data: Any, source: str = "class rules") -> tuple[ClassRule, ...]:
    """Rules from the parsed YAML document; ValueError naming the rule index and field."""
    if data is None:
        return ()
    if not isinstance(data, Mapping):
        raise ValueError(f"{source}: expected a mapping with a 'rules' list, got "
                         f"{type(data).__name__}")
    extra = sorted(str(k) for k in data if k != "rules")
    if extra:
        raise ValueError(f"{source}: unknown top-level key {extra[0]!r} (only 'rules')")
    items = data.get("rules")
    if items is None:
        return ()
    if not isinstance(items, list):
        raise ValueError(f"{source}: rules: expected a list, got {type(items).__name__}")
    return tuple(_parse_rule(item, f"{source}: rules[{i}]") for i, item in enumerate(items))


def _parse_rule(item: Any, where: str) -> ClassRule:
    if not isinstance(item, Mapping):
        raise ValueError(f"{where}: expected a mapping, got {type(item).__name__}")
    for key in item:
        if key not in _RULE_KEYS:
            raise ValueError(f"{where}.{key}: unknown field (fields: {', '.join(_RULE_KEYS)})")
    if "class" not in item:
        raise ValueError(f"{where}.class: missing")
    name = item["class"]
    if not valid_class_name(name):
        raise ValueError(
            f"{where}.class: {name!r} must be a string matching {CLASS_NAME_PATTERN.pattern} "
            f"of at most {MAX_CLASS_NAME_LENGTH} characters")
    lora = item.get("lora")
    if "lora" in item and (not isinstance(lora, str) or not lora):
        raise ValueError(f"{where}.lora: expected a non-empty string, got {lora!r}")
    bounds: dict[str, int | None] = {}
    for key in ("min_prompt_tokens", "max_max_tokens"):
        value = item.get(key)
        if key in item and (type(value) is not int or value < 0):
            raise ValueError(f"{where}.{key}: expected an integer >= 0, got {value!r}")
        bounds[key] = value
    return ClassRule(name, lora, bounds["min_prompt_tokens"], bounds["max_max_tokens"])


def load_rules(path: str | Path) -> tuple[ClassRule, ...]:
    """Rules from a YAML file; ValueError naming the file, rule index and field."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"class rules file {path}: {exc}") from None
    return parse_rules(data, f"class rules file {path}")


class Classifier:
    """Maps a request to its traffic class. Call ``classify`` from one thread (the scheduler's);
    it never raises."""

    def __init__(self, rules: Sequence[ClassRule] = (), max_classes: int = 16) -> None:
        if max_classes < 2:
            raise ValueError(f"max_classes: must be >= 2 (room for 'default' and 'other'), "
                             f"got {max_classes}")
        self.rules = tuple(rules)
        self._max = max_classes
        # Names returned so far; "default" and "other" always hold their slots.
        self._seen: dict[str, None] = {DEFAULT_CLASS: None, OTHER_CLASS: None}

    @classmethod
    def from_file(cls, path: str | Path | None, max_classes: int = 16) -> Classifier:
        """A classifier with the rules of ``path`` (none when empty or None)."""
        return cls(load_rules(path) if path else (), max_classes)

    @property
    def max_classes(self) -> int:
        return self._max

    def set_max_classes(self, max_classes: int) -> None:
        """Lower the limit (e.g. to the controller's). Names already admitted keep their class;
        a limit larger than the configured one is ignored."""
        if 2 <= max_classes < self._max:
            self._max = max_classes

    @property
    def classes(self) -> tuple[str, ...]:
        """Every name ``classify`` may return now, in order of admission."""
        return tuple(self._seen)

    def classify(
        self,
        extra_args: Mapping[str, Any] | None,
        lora_name: str | None,
        prompt_tokens: int,
        max_tokens: int | None,
    ) -> str:
        try:
            return self._admit(self._raw(extra_args, lora_name, prompt_tokens, max_tokens))
        except Exception:  # a request must be served whatever its arguments look like
            log.debug("classification failed; class %r", DEFAULT_CLASS, exc_info=True)
            return DEFAULT_CLASS

    def _raw(self, extra_args: Mapping[str, Any] | None, lora_name: str | None,
             prompt_tokens: int, max_tokens: int | None) -> str:
        if extra_args:
            name = extra_args.get(TRAFFIC_CLASS_ARG)
            # Admitted names are valid: the dict lookup spares the regex on the common path.
            if isinstance(name, str) and (name in self._seen or valid_class_name(name)):
                return name
        for rule in self.rules:
            if rule.matches(lora_name, prompt_tokens, max_tokens):
                return rule.traffic_class
        return DEFAULT_CLASS

    def _admit(self, name: str) -> str:
        folded = fold_class(name, self._seen, self._max)
        self._seen.setdefault(folded, None)
        return folded
