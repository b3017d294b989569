"""The demo's traffic: classes, load phases, and the exact request list (pure, no I/O).

Four classes, each a different answer for the controller, shaped like real serving traffic
(chat and generation are mostly sampled; edits and tool output repeat their input):

- ``chat``: a held-out licence or documentation passage, continued, sampled at T=0.8. The draft
  model, drafting probabilistically, predicts it best; prompt lookup hardly helps.
- ``codegen``: a held-out Python source passage, continued, sampled at T=0.8.
- ``edit``: an edit-like request, greedy. The prompt holds a passage and then starts it again, so
  the continuation repeats text that is already in the prompt: prompt-lookup (n-gram) drafts win.
- ``offline``: batch work, a long prompt with a short answer, greedy; the controller pins it off.

Load runs in phases of closed-loop concurrency (1 -> 16 -> 32 -> 1 by default): a phase keeps its
concurrency of requests in flight until all of its requests are admitted, then drains. The
request list is a pure function of the workload, the texts and the tokenizer, so every engine
configuration replays exactly the same requests: greedy outputs are comparable token by token,
sampled ones by their distribution.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

# Text kinds a class draws its passages from (see benchmarks.demo.models.heldout_texts).
TextKind = str


@dataclass(frozen=True)
class ClassSpec:
    """One traffic class of the demo."""

    name: str
    # Where passages come from: "code" (Python sources) or "prose" (licences, docs).
    kind: TextKind
    # Share of the requests of each phase (relative weight; normalised over classes).
    share: float
    # Prompt length, tokens (the passage, cut at a token boundary).
    prompt_tokens: int
    # Generated tokens per request (greedy; ignore_eos so every config does the same work).
    max_tokens: int
    # "plain": continue the passage. "edit": passage, separator, then the passage restarted.
    shape: str = "plain"
    # Marked offline on the controller (pinned off).
    offline: bool = False
    # Sampling temperature (0 = greedy: outputs must equal no speculation token for token).
    temperature: float = 0.0


@dataclass(frozen=True)
class Phase:
    """A load phase: ``requests`` requests with ``concurrency`` of them in flight."""

    name: str
    concurrency: int
    requests: int


@dataclass(frozen=True)
class Workload:
    classes: tuple[ClassSpec, ...]
    phases: tuple[Phase, ...]
    seed: int = 0

    def class_names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.classes)

    def offline_classes(self) -> list[str]:
        return [c.name for c in self.classes if c.offline]

    def greedy_classes(self) -> frozenset[str]:
        return frozenset(c.name for c in self.classes if c.temperature == 0)

    def temperature(self, traffic_class: str) -> float:
        return next(c.temperature for c in self.classes if c.name == traffic_class)

    @property
    def max_concurrency(self) -> int:
        return max(p.concurrency for p in self.phases)

    def scaled(self, factor: float) -> Workload:
        """The same workload with ``factor`` times as many requests per phase (at least 1)."""
        phases = tuple(Phase(p.name, p.concurrency, max(1, round(p.requests * factor)))
                       for p in self.phases)
        return Workload(self.classes, phases, self.seed)


@dataclass(frozen=True)
class DemoRequest:
    request_id: str
    phase: int
    traffic_class: str
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    temperature: float = 0.0


@dataclass(frozen=True)
class RequestPlan:
    """The requests of a workload, in admission order, grouped by phase."""

    workload: Workload
    requests: tuple[DemoRequest, ...]
    by_phase: tuple[tuple[DemoRequest, ...], ...] = field(repr=False)


# Edit-like prompts: the passage, this separator, then the passage's first tokens again.
EDIT_SEPARATOR = "\n\n# The same, revised:\n\n"
# Share of the passage repeated after the separator in an edit prompt (the rest is the answer).
EDIT_RESTART_SHARE = 0.25

# Sampled classes' temperature: what chat and generation traffic mostly runs at (0.6-1.0).
SAMPLED_TEMPERATURE = 0.8

DEFAULT_CLASSES: tuple[ClassSpec, ...] = (
    ClassSpec("chat", "prose", share=0.3, prompt_tokens=96, max_tokens=96,
              temperature=SAMPLED_TEMPERATURE),
    ClassSpec("codegen", "code", share=0.3, prompt_tokens=96, max_tokens=96,
              temperature=SAMPLED_TEMPERATURE),
    ClassSpec("edit", "code", share=0.25, prompt_tokens=192, max_tokens=96, shape="edit"),
    ClassSpec("offline", "prose", share=0.15, prompt_tokens=384, max_tokens=8, offline=True),
)

# The demo's load: light, a burst at concurrency 16, a peak at 32, light again.
DEFAULT_WORKLOAD = Workload(
    classes=DEFAULT_CLASSES,
    phases=(Phase("light", 1, 12), Phase("burst", 16, 64), Phase("peak", 32, 96),
            Phase("light-again", 1, 12)),
)


def _passages(texts: Sequence[str], encode: Callable[[str], list[int]], length: int,
              count: int, rng: np.random.Generator) -> list[list[int]]:
    """``count`` token windows of ``length`` from ``texts`` (random text, random offset)."""
    pools = [ids for ids in (encode(t) for t in texts) if len(ids) >= length]
    if not pools:
        raise ValueError(f"no text has {length} tokens; need longer local texts")
    out: list[list[int]] = []
    for _ in range(count):
        ids = pools[int(rng.integers(len(pools)))]
        start = int(rng.integers(len(ids) - length + 1))
        out.append(ids[start:start + length])
    return out


def _class_order(workload: Workload, n: int, rng: np.random.Generator) -> list[int]:
    """Class index per request: shares rounded to counts, then shuffled (largest remainder)."""
    shares = np.array([c.share for c in workload.classes], dtype=float)
    want = shares / shares.sum() * n
    counts = np.floor(want).astype(int)
    for i in np.argsort(-(want - counts))[: n - int(counts.sum())]:
        counts[i] += 1
    order = np.repeat(np.arange(len(shares)), counts)
    rng.shuffle(order)
    return [int(i) for i in order]


def build_plan(workload: Workload, texts: Mapping[TextKind, Sequence[str]],
               encode: Callable[[str], list[int]]) -> RequestPlan:
    """Every request of ``workload``, deterministic in its seed.

    ``encode`` turns text into token ids without special tokens; ``texts`` maps each class's
    kind to held-out passages. Raises ValueError when a kind has no text long enough.
    """
    rng = np.random.default_rng(workload.seed)
    separator = encode(EDIT_SEPARATOR)
    phases: list[tuple[DemoRequest, ...]] = []
    n = 0
    for p_index, phase in enumerate(workload.phases):
        order = _class_order(workload, phase.requests, rng)
        requests: list[DemoRequest] = []
        for c_index in order:
            spec = workload.classes[c_index]
            if spec.kind not in texts:
                raise ValueError(f"class {spec.name!r}: no texts of kind {spec.kind!r}")
            if spec.shape == "edit":
                body = max(8, (spec.prompt_tokens - len(separator)) * 4 // 5)
                [passage] = _passages(texts[spec.kind], encode, body, 1, rng)
                restart = passage[: max(1, int(len(passage) * EDIT_RESTART_SHARE))]
                prompt = passage + separator + restart
            else:
                [prompt] = _passages(texts[spec.kind], encode, spec.prompt_tokens, 1, rng)
            requests.append(DemoRequest(f"{p_index}-{n}-{spec.name}", p_index, spec.name,
                                        tuple(prompt), spec.max_tokens, spec.temperature))
            n += 1
        phases.append(tuple(requests))
    flat = tuple(r for phase in phases for r in phase)
    return RequestPlan(workload, flat, tuple(phases))
