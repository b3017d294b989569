"""Engine test helpers: vLLM's spec-decode counters. Engine start and stop live in
:mod:`benchmarks.demo.engine`, which the tests import directly."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm import LLM


@dataclass(frozen=True)
class SpecCounters:
    """vLLM's cumulative speculative-decoding counters (``vllm:spec_decode_*``)."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_pos: tuple[int, ...] = field(default_factory=tuple)

    def __sub__(self, other: SpecCounters) -> SpecCounters:
        n = max(len(self.accepted_per_pos), len(other.accepted_per_pos))
        mine = self.accepted_per_pos + (0,) * (n - len(self.accepted_per_pos))
        theirs = other.accepted_per_pos + (0,) * (n - len(other.accepted_per_pos))
        return SpecCounters(
            drafts=self.drafts - other.drafts,
            draft_tokens=self.draft_tokens - other.draft_tokens,
            accepted_tokens=self.accepted_tokens - other.accepted_tokens,
            accepted_per_pos=tuple(a - b for a, b in zip(mine, theirs, strict=True)),
        )

    @property
    def acceptance(self) -> float:
        """Accepted / drafted tokens (NaN when nothing was drafted)."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else float("nan")


def spec_counters(llm: LLM) -> SpecCounters:
    """Snapshot of the spec-decode counters, summed over label sets; diff two snapshots."""
    totals = {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0}
    per_pos: list[int] = []
    for metric in llm.get_metrics():
        name = metric.name.removeprefix("vllm:spec_decode_num_")
        if name == metric.name:
            continue
        if name in totals:
            totals[name] += int(getattr(metric, "value", 0))
        elif name == "accepted_tokens_per_pos":
            values = list(getattr(metric, "values", []) or [])
            per_pos += [0] * (len(values) - len(per_pos))
            for i, v in enumerate(values):
                per_pos[i] += int(v)
    return SpecCounters(accepted_per_pos=tuple(per_pos), **totals)
