"""``specpilot simulate``: run policies on scenarios, side by side, and write the results.

    specpilot simulate SCENARIO.yaml [SCENARIO.yaml ...] [--policy NAME ...] [--seed N]
                       [--seeds N] [--out DIR] [--jobs N] [--no-plots]
    specpilot simulate --write-schema FILE     (the scenario format's JSON schema)

Every policy of a scenario runs on the same request stream (same seed); with ``--seeds N`` on N
streams, pooled (tokens and time summed; timelines from the first). Output per scenario in
DIR/<scenario>/: result.json, table.md, k_timeline.png, ratios.png; with several scenarios also
DIR/suite.{json,md,png}. Deterministic given the seed.
"""

from __future__ import annotations

import argparse
import sys
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

from benchmarks.plots import plots_available
from benchmarks.sim import policies
from benchmarks.sim.engine import RunResult, SimEngine, pool_runs
from benchmarks.sim.report import ScenarioResult, suite_markdown, write_scenario, write_suite
from benchmarks.sim.scenario import Scenario, ScenarioError, load_scenario, scenario_json_schema

DEFAULT_OUT = "benchmarks/results/sim"


def _run_one(scenario: Scenario, policy: str, seed: int | None, bar: bool) -> RunResult:
    engine = SimEngine(scenario, seed)
    if not bar:
        return engine.run(policies.build(policy, engine))
    from tqdm import tqdm

    with tqdm(total=round(scenario.duration_seconds), unit="sim-s", leave=False,
              desc=f"{scenario.name} {policy}", file=sys.stderr) as pbar:
        def progress(now: float) -> None:
            pbar.update(round(now) - pbar.n)

        return engine.run(policies.build(policy, engine), progress)


def simulate(scenarios: list[Scenario], policy_names: list[str] | None, seed: int | None,
             jobs: int = 1, log: bool = True, seeds: int = 1) -> list[ScenarioResult]:
    """Run every policy on every scenario, ``seeds`` times (seed, seed + 1, ...; the scenario's
    seed unless ``seed`` is given) and pool the runs of a policy: ValueError for an unknown
    policy (before running)."""
    plan: list[tuple[int, int, str]] = []
    for i, s in enumerate(scenarios):
        first = s.seed if seed is None else seed
        engine = SimEngine(s, first)
        names = policies.expand(policy_names or s.policies or list(policies.DEFAULT_POLICIES),
                                engine)
        for name in names:
            policies.build(name, engine)  # validates the name for this scenario
        plan.extend((i, first + j, name) for j in range(seeds) for name in names)
    runs: list[dict[str, list[RunResult]]] = [{} for _ in scenarios]

    def done(i: int, run: RunResult, n: int) -> None:
        runs[i].setdefault(run.policy, []).append(run)
        if log:
            print(f"[{n}/{len(plan)}] {run.scenario} {run.policy}: {run.throughput:.1f} tokens/s "
                  f"({run.steps} steps, {run.wall_seconds:.1f} s)", file=sys.stderr, flush=True)

    if jobs <= 1:
        for n, (i, run_seed, name) in enumerate(plan, 1):
            done(i, _run_one(scenarios[i], name, run_seed, bar=log), n)
    else:
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            futures = {pool.submit(_run_one, scenarios[i], name, run_seed, False): i
                       for i, run_seed, name in plan}
            for n, fut in enumerate(as_completed(futures), 1):
                done(futures[fut], fut.result(), n)
    out = []
    for i, s in enumerate(scenarios):
        order = list(dict.fromkeys(name for j, _, name in plan if j == i))
        first = s.seed if seed is None else seed
        out.append(ScenarioResult(s.name, s.kind, s.description, first,
                                  {name: pool_runs(runs[i][name]) for name in order},
                                  seeds=seeds))
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("scenarios", nargs="*", metavar="SCENARIO.yaml")
    p.add_argument("--write-schema", metavar="FILE",
                   help="write the scenario format's JSON schema to FILE and exit")
    p.add_argument("--policy", action="append", dest="policies", metavar="NAME",
                   help="policy to run (repeatable; default: the scenario's list or all): "
                   "off, static:K[@DRAFT], static:all, batch-table, hf-heuristic, "
                   "sglang-adaptive, banditspec-ucb, trtllm-threshold, specpilot, specpilot-cut, "
                   "specpilot-nocut, oracle, "
                   "vllm-adaptive[:K], per-token-oracle")
    p.add_argument("--seed", type=int, default=None, help="override the scenarios' seeds")
    p.add_argument("--seeds", type=int, default=1,
                   help="runs per policy with seeds seed, seed+1, ...; pooled (default 1)")
    p.add_argument("--out", default=DEFAULT_OUT, help=f"output folder (default {DEFAULT_OUT})")
    p.add_argument("--jobs", type=int, default=1, help="parallel runs (processes)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")


def main(args: argparse.Namespace) -> int:
    if args.write_schema:
        Path(args.write_schema).write_text(scenario_json_schema(), encoding="utf-8")
        return 0
    if not args.scenarios:
        print("specpilot simulate: give at least one SCENARIO.yaml", file=sys.stderr)
        return 2
    try:
        scenarios = [load_scenario(path) for path in args.scenarios]
    except ScenarioError as exc:
        print(f"specpilot simulate: {exc}", file=sys.stderr)
        return 2
    names = [s.name for s in scenarios]
    if len(set(names)) != len(names):
        print(f"specpilot simulate: scenario names repeat: {names}", file=sys.stderr)
        return 2
    try:
        results = simulate(scenarios, args.policies, args.seed, jobs=args.jobs,
                           seeds=max(1, args.seeds))
    except ValueError as exc:
        print(f"specpilot simulate: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out)
    plots = not args.no_plots and plots_available("simulate")
    written: list[Path] = []
    for r in results:
        written += write_scenario(r, out / r.name, plots)
        print((out / r.name / "table.md").read_text(encoding="utf-8"))
    if len(results) > 1:
        written += write_suite(results, out, plots)
        print(suite_markdown(results))
    print(f"specpilot simulate: wrote {len(written)} files under {out}", file=sys.stderr)
    return 0
