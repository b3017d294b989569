"""Acceptance per traffic class of a prepared model set, measured on the real engine.

Runs a few requests of every demo class (each at its own temperature) through vLLM with static
draft K=4 (probabilistic drafting) and with static n-gram K=4, and records accepted / drafted
tokens per class and draft in ``<build root>/acceptance-v2.json`` (v2: the sampled classes).
Cached: a second call reads the file.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import TYPE_CHECKING

from benchmarks.demo.configs import PROBABILISTIC, EngineConfig
from benchmarks.demo.workload import DEFAULT_CLASSES, Phase, Workload

if TYPE_CHECKING:
    from benchmarks.demo.models import ModelSet

ACCEPTANCE_FILE = "acceptance-v2.json"
# Requests per class in the measurement, and how many run at once.
REQUESTS_PER_CLASS = 6
CONCURRENCY = 4
MEASURED = (EngineConfig("draft:4p", "draft", 4, draft_sampling=PROBABILISTIC),
            EngineConfig("ngram:4", "ngram", 4))


def measurement_workload() -> Workload:
    classes = tuple(c for c in DEFAULT_CLASSES if not c.offline)
    return Workload(classes, (Phase("acceptance", CONCURRENCY,
                                    REQUESTS_PER_CLASS * len(classes)),), seed=7)


def record_acceptance(models: ModelSet, echo: Callable[[str], None] = print
                      ) -> dict[str, dict[str, float | None]]:
    """{config: {class: accepted/drafted}} for ``models``; measured once, then read back."""
    path = models.root / ACCEPTANCE_FILE
    try:
        cached: dict[str, dict[str, float | None]] = json.loads(path.read_text())
        return cached
    except (OSError, ValueError):
        pass
    from benchmarks.demo.demo import make_plan
    from benchmarks.demo.driver import run_plan
    from benchmarks.demo.engine import apply_engine_env, config_session
    from benchmarks.demo.summary import class_figures

    apply_engine_env()
    plan = make_plan(measurement_workload(), models.target)
    table: dict[str, dict[str, float | None]] = {}
    for config in MEASURED:
        echo(f"==> acceptance per class with {config.name} ({len(plan.requests)} requests)")
        with config_session(config, models.target, models.draft) as llm:
            run = run_plan(llm, plan, config.name)
        table[config.name] = {
            cls: (None if math.isnan(f.acceptance) else round(f.acceptance, 4))
            for cls, f in class_figures(run.requests).items()}
    path.write_text(json.dumps(table, indent=2) + "\n")
    return table
