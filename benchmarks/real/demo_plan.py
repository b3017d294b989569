"""The demo's traffic on the real model: held-out ShareGPT requests of every class (their chat
messages rendered with the target's template), mixed by the classes' shares, in the same load
phases as the benchmark, as the demo's request plan
(:class:`benchmarks.demo.workload.RequestPlan`)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from benchmarks.demo.workload import ClassSpec, DemoRequest, Phase, RequestPlan, Workload
from benchmarks.real.plan import PHASES, LoadPhase, build_plan
from benchmarks.real.sharegpt import CLASSES, HELDOUT, TrafficSet, chat_ids

# Output tokens per request in the demo (each class's own cap may be lower).
DEMO_MAX_TOKENS = 96


def real_workload(phases: Sequence[LoadPhase] = PHASES) -> Workload:
    classes = tuple(ClassSpec(c.name, "sharegpt", share=c.share, prompt_tokens=0,
                              max_tokens=min(c.max_tokens, DEMO_MAX_TOKENS), offline=c.offline,
                              temperature=c.temperature) for c in CLASSES)
    return Workload(classes, tuple(Phase(p.name, p.concurrency, p.requests) for p in phases))


def real_request_plan(traffic: TrafficSet, tokenizer_dir: Path,
                      workload: Workload | None = None) -> RequestPlan:
    """The plan of ``workload`` (default :func:`real_workload`) over held-out requests."""
    from transformers import AutoTokenizer

    workload = workload or real_workload()
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    specs = {c.name: c for c in workload.classes}
    phases = [LoadPhase(p.name, p.concurrency, p.requests) for p in workload.phases]
    chosen = build_plan({c.name: traffic.requests(c.name, HELDOUT) for c in CLASSES}, phases)
    by_phase: list[tuple[DemoRequest, ...]] = []
    for index, requests in enumerate(chosen):
        rows = []
        for r in requests:
            spec = specs[r.class_name]
            rows.append(DemoRequest(f"{index}-{r.id}", index, r.class_name,
                                    tuple(chat_ids(tokenizer, r.messages)),
                                    spec.max_tokens, spec.temperature))
        by_phase.append(tuple(rows))
    return RequestPlan(workload, tuple(r for p in by_phase for r in p), tuple(by_phase))
