"""Figures from measured runs (pure): per-class and per-phase throughput and acceptance."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass

from benchmarks.demo.driver import RequestResult, RunResult


@dataclass(frozen=True)
class ClassFigures:
    traffic_class: str
    requests: int
    tokens: int
    # Mean over requests of generated tokens / request latency (admission to finish), tokens/s.
    request_tokens_per_second: float
    drafted: int
    accepted: int
    verify_steps: int
    # Engine steps that gave the class's requests tokens, summed.
    steps: int = 0

    @property
    def acceptance(self) -> float:
        """Accepted / drafted tokens; NaN when nothing was drafted."""
        return self.accepted / self.drafted if self.drafted else float("nan")

    @property
    def tokens_per_step(self) -> float:
        """Mean tokens a request gains per engine step it is in (NaN without steps): what the
        ceiling needs, since steps where a drafter proposed nothing count too."""
        return self.tokens / self.steps if self.steps else float("nan")

    @property
    def tokens_per_verify_step(self) -> float:
        """Mean tokens per verification step (accepted drafts + 1); NaN without one."""
        return 1.0 + self.accepted / self.verify_steps if self.verify_steps else float("nan")


def class_figures(results: Iterable[RequestResult]) -> dict[str, ClassFigures]:
    grouped: dict[str, list[RequestResult]] = {}
    for r in results:
        grouped.setdefault(r.traffic_class, []).append(r)
    out: dict[str, ClassFigures] = {}
    for cls, rs in sorted(grouped.items()):
        rates = [len(r.token_ids) / r.seconds for r in rs if r.seconds > 0]
        out[cls] = ClassFigures(
            traffic_class=cls, requests=len(rs), tokens=sum(len(r.token_ids) for r in rs),
            request_tokens_per_second=sum(rates) / len(rates) if rates else 0.0,
            drafted=sum(r.drafted for r in rs), accepted=sum(r.accepted for r in rs),
            verify_steps=sum(sum(r.histogram) for r in rs), steps=sum(r.steps for r in rs))
    return out


def output_mismatches(reference: RunResult, other: RunResult,
                      classes: Collection[str] | None = None) -> list[str]:
    """Request ids whose generated tokens differ between two runs of the same plan, among the
    requests of ``classes`` (None: all; sampled classes differ by chance and are left out)."""
    ref, mine = reference.outputs(), other.outputs()
    kept = {r.request_id for r in (*reference.requests, *other.requests)
            if classes is None or r.traffic_class in classes}
    return sorted(rid for rid in kept if ref.get(rid) != mine.get(rid))


def median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    n = len(ordered)
    if not n:
        return float("nan")
    mid = n // 2
    return ordered[mid] if n % 2 else (ordered[mid - 1] + ordered[mid]) / 2.0
