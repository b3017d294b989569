"""Engine test helpers: vLLM's spec-decode counters, a log of the engine's steps, and a stand-in
n-gram matcher. Engine start and stop live in :mod:`benchmarks.demo.engine`, which the tests
import directly."""

from __future__ import annotations

import collections
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from engine_plugin.worker_patch import is_decode_only

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


def runner_of(llm: Any) -> Any:
    return llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner


@contextmanager
def step_log(llm: Any) -> Iterator[list[tuple[bool, int, bool]]]:
    """(decode only, batch K, drafter's forward ran) per engine step."""
    runner = runner_of(llm)
    steps: list[tuple[bool, int, bool]] = []
    execute, propose = runner.execute_model, runner.drafter.propose

    def spy_execute(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        if scheduler_output.total_num_scheduled_tokens:
            steps.append((is_decode_only(scheduler_output),
                          scheduler_output.num_spec_tokens_to_schedule, False))
        return execute(scheduler_output, *args, **kwargs)

    def spy_propose(*args: Any, **kwargs: Any) -> Any:
        steps[-1] = (*steps[-1][:2], True)
        return propose(*args, **kwargs)

    runner.execute_model, runner.drafter.propose = spy_execute, spy_propose
    try:
        yield steps
    finally:
        del runner.execute_model, runner.drafter.propose


class ModeDrafts:
    """Stands in for the n-gram matcher, whose matches the tiny target's sampled text rarely
    gives: drafts the most frequent token of each position in the target's own samples. A
    deterministic function of the context (its length), plausible enough that verification
    accepts some and rejects some: exactly the case one-hot rows must get right."""

    def __init__(self, samples: list[list[int]], prompt_len: int) -> None:
        """``samples``: the target's own generations of one prompt of ``prompt_len`` tokens."""
        self.modes = [collections.Counter(s[i] for s in samples).most_common(1)[0][0]
                      for i in range(len(samples[0]))]
        self.prompt_len = prompt_len

    def propose(self, tokens: list[int], k: int) -> list[int]:
        at = len(tokens) - self.prompt_len
        return self.modes[at:at + k]
