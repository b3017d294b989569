"""Warm start from the fleet against a cold start, side by side in the simulator.

    .venv/bin/python benchmarks/warm_start.py [SCENARIO.yaml ...] [--out STEM]

For each scenario: a "veteran" sidecar runs it once (seed s); its exported acceptance evidence is
what the fleet knows. Then, on another request stream (seed s + 1), a cold sidecar and a warm one
(the same controller, its fleet view holding the veteran's export as Redis would hand it) run the
same traffic. Reported per scenario: exploring decisions (reason "explore") and decision changes in
the first minute, and the first minute's throughput as a share of the oracle's. Writes
benchmarks/results/warm_start.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.sim import policies
from benchmarks.sim.engine import SimEngine
from benchmarks.sim.scenario import Scenario, load_scenario
from benchmarks.sim.specpilot_policy import SpecPilotPolicy
from specpilot.contract.records import DecisionEvent, Reason
from specpilot.controller.core.fleet import EvidenceExport, fleet_evidence

DEFAULT_SCENARIOS = ("stationary-mixed", "five-classes", "h100-70b-8b", "flat-high")
FIRST_SECONDS = 60.0
OUT = Path("benchmarks/results/warm_start")


@dataclass(frozen=True)
class StartRun:
    explores: int
    changes: int
    first_minute_tokens: int


def _run(s: Scenario, seed: int, fleet: EvidenceExport | None) -> tuple[StartRun, SpecPilotPolicy]:
    engine = SimEngine(s, seed)
    policy = policies.build("specpilot", engine)
    assert isinstance(policy, SpecPilotPolicy)
    core = policy.core
    if fleet is not None:
        core.set_fleet_evidence(fleet_evidence([fleet], "newcomer", 0.0, core.evidence_half_life,
                                               float("inf")), 0.0)
        core.decide(0.0)
        policy.push_policy(0.0)  # the engine applies the warm decisions from its first step
    explores = changes = 0
    decide = core.decide

    def counting(now: float, joint: bool = True) -> list[DecisionEvent]:
        nonlocal explores, changes
        events = decide(now, joint)
        if now <= FIRST_SECONDS:
            changes += sum(e.previous is not None for e in events)
            explores += sum(e.decision.reason is Reason.EXPLORE for e in events)
        return events

    core.decide = counting  # type: ignore[method-assign]
    result = engine.run(policy)
    bins = int(FIRST_SECONDS / result.timeline_seconds)
    return StartRun(explores, changes, sum(result.tokens_timeline[:bins])), policy


def _oracle_first_minute(s: Scenario, seed: int) -> int:
    engine = SimEngine(s, seed)
    result = engine.run(policies.build("oracle", engine))
    return sum(result.tokens_timeline[:int(FIRST_SECONDS / result.timeline_seconds)])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="warm_start.py", description=__doc__.splitlines()[0])
    p.add_argument("scenarios", nargs="*", metavar="SCENARIO.yaml")
    p.add_argument("--out", type=Path, default=OUT, help=f"output stem (default {OUT})")
    args = p.parse_args(argv)
    paths = args.scenarios or [f"benchmarks/scenarios/{n}.yaml" for n in DEFAULT_SCENARIOS]
    rows: list[dict[str, Any]] = []
    for i, path in enumerate(paths, 1):
        s = load_scenario(path)
        print(f"[{i}/{len(paths)}] {s.name}: veteran, cold, warm, oracle", file=sys.stderr,
              flush=True)
        _, veteran = _run(s, s.seed, None)
        end = s.duration_seconds
        export = EvidenceExport("veteran", 0.0, veteran.core.export_evidence(end))
        cold, _ = _run(s, s.seed + 1, None)
        warm, _ = _run(s, s.seed + 1, export)
        oracle = _oracle_first_minute(s, s.seed + 1)
        rows.append({"scenario": s.name, "cold": cold.__dict__, "warm": warm.__dict__,
                     "oracle_first_minute_tokens": oracle})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(rows, indent=1), encoding="utf-8")
    lines = ["| scenario | exploring decisions, first minute (cold -> warm) | decision changes "
             "(cold -> warm) | first minute / oracle (cold -> warm) |", "|---|---|---|---|"]
    for r in rows:
        c, w, o = r["cold"], r["warm"], r["oracle_first_minute_tokens"]
        lines.append(f"| {r['scenario']} | {c['explores']} -> {w['explores']} | "
                     f"{c['changes']} -> {w['changes']} | {c['first_minute_tokens'] / o:.3f} -> "
                     f"{w['first_minute_tokens'] / o:.3f} |")
    table = "\n".join(lines) + "\n"
    args.out.with_suffix(".md").write_text(table, encoding="utf-8")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
