"""The control loop end to end: a synthetic engine with known acceptance and step costs talks to
the real controller over gRPC on loopback; the pushed policy must match a brute-force optimum
computed here from the true parameters.

Time-based settings are scaled down (reports every ~10 ms instead of 1 s) so a run takes seconds.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest

from benchmarks.synthetic_engine import (
    SyntheticEngine,
    TrueCost,
    best_k,
    brute_force_goodputs,
    drive,
)
from specpilot.controller.server.app import RunningServer, start_server
from specpilot.controller.settings import load_settings

pytestmark = pytest.mark.integration

# Stated bounds (docs/architecture.md quotes them; measured values are printed by each test).
CONVERGE_WITHIN_REPORTS = 150
DRIFT_REACTION_WITHIN_REPORTS = 60
STEPS_PER_REPORT = 400
HYSTERESIS = 0.02

FAST: dict[str, Any] = {
    "grpc_port": 0, "http_port": 0, "seed": 11, "max_k": 6, "report_interval_seconds": 0.05,
    "dwell_seconds": 0.3, "hysteresis_ratio": HYSTERESIS, "half_life_seconds": 30.0,
    "change_fast_half_life_seconds": 1.0,
}


@pytest.fixture
async def server() -> AsyncIterator[RunningServer]:
    running = await start_server(load_settings(**FAST))
    try:
        yield running
    finally:
        await running.stop()


def _first_stable(history: list[int], want: int, share: float = 0.95) -> int | None:
    """First report index from which ``want`` holds at the end and in >= share of the rest."""
    if not history or history[-1] != want:
        return None
    for i in range(len(history)):
        rest = history[i:]
        if rest[0] == want and rest.count(want) >= share * len(rest):
            return i
    return None


async def test_three_classes_converge_to_the_brute_force_best_k(server: RunningServer) -> None:
    cost = TrueCost()
    rates = {
        "boilerplate": np.array([0.9, 0.88, 0.86, 0.84, 0.35, 0.3]),
        "prose": np.full(6, 0.3),
        "code-hard": np.full(6, 0.05),
    }
    want = {}
    for name, r in rates.items():
        k, margin = best_k(r, 1, cost)
        assert margin > 1 + HYSTERESIS, f"test premise: {name}'s optimum must be distinct"
        want[name] = k
    assert want["boilerplate"] >= 3 and want["prose"] in (1, 2) and want["code-hard"] == 0

    engine = SyntheticEngine(rates, cost, max_k=6, steps_per_report=STEPS_PER_REPORT)
    history: dict[str, list[int]] = {name: [] for name in rates}

    def record(e: SyntheticEngine, _: int) -> None:
        for name in rates:
            history[name].append(e.k_in_force(name))

    await drive(engine, f"127.0.0.1:{server.grpc_port}", reports=300, on_report=record)
    assert all(r.accepted for r in engine.results)
    for name in rates:
        at = _first_stable(history[name], want[name])
        print(f"{name}: best K={want[name]}, converged at report {at}")
        assert at is not None, f"{name}: K history tail {history[name][-20:]}, want {want[name]}"
        assert at <= CONVERGE_WITHIN_REPORTS
    # Off means off: the hard class only ever runs probes, at the configured small share.
    d = engine.decision("code-hard")
    assert d is not None and d.k == 0 and 0 < d.probe_rate <= 0.05


async def test_drift_lowers_k_within_the_stated_reports(server: RunningServer) -> None:
    cost = TrueCost()
    before, after = np.full(6, 0.72), np.full(6, 0.58)
    k_before, _ = best_k(before, 1, cost)
    k_after, _ = best_k(after, 1, cost)
    assert k_after < k_before
    engine = SyntheticEngine({"chat": before}, cost, max_k=6, steps_per_report=STEPS_PER_REPORT)
    history: list[int] = []
    drift_at = 150

    def record(e: SyntheticEngine, i: int) -> bool:
        history.append(e.k_in_force("chat"))
        if i == drift_at:
            e.rates["chat"] = after
        return False

    await drive(engine, f"127.0.0.1:{server.grpc_port}", reports=drift_at + 150, on_report=record)
    settled = history[drift_at - 30 : drift_at]
    assert min(settled) >= k_before - 1, f"not settled before the drift: {settled}"
    level = max(set(settled), key=settled.count)
    reaction = next((i for i, k in enumerate(history[drift_at:]) if k < level), None)
    print(f"drift {0.72}->{0.58}: K {level} -> lower after {reaction} reports "
          f"({None if reaction is None else reaction * STEPS_PER_REPORT} verification steps)")
    assert reaction is not None and reaction <= DRIFT_REACTION_WITHIN_REPORTS
    # Settled after it, on a K whose true goodput is within the hysteresis (3%) plus 2% of the
    # best: at 0.58, K=2 beats K=3 by only 3.8%, so an estimate a little off holds K=3 by
    # design (a test that wanted exactly K=2 failed 1 run in 3); K=4 (10% worse) fails this.
    tail = history[-30:]
    settled_k = max(set(tail), key=tail.count)
    goodputs = brute_force_goodputs(after, 1, cost)
    assert goodputs[settled_k] >= 0.95 * goodputs[k_after], f"not settled after it: {tail}"
    assert server.core.estimate("chat", "draft-small", time.time()).changes_detected >= 1


async def test_load_turns_speculation_off_at_batch_32_only(server: RunningServer) -> None:
    # Memory-bound at batch 1, compute-bound past 32 verified tokens.
    cost = TrueCost(ridge_tokens=32, per_token_above_ridge=1e-3)
    rates = np.full(6, 0.85)
    assert best_k(rates, 1, cost)[0] > 0 and best_k(rates, 32, cost)[0] == 0
    engine = SyntheticEngine({"chat": rates}, cost, max_k=6, steps_per_report=STEPS_PER_REPORT)
    seen: dict[int, list[int]] = {1: [], 32: []}

    def alternate(e: SyntheticEngine, i: int) -> None:
        seen[e.batch_size].append(e.k_in_force("chat"))
        e.batch_size = 1 if (i // 10) % 2 == 0 else 32

    await drive(engine, f"127.0.0.1:{server.grpc_port}", reports=300, on_report=alternate)
    tail: dict[int, Any] = {b: ks[-50:] for b, ks in seen.items()}
    print(f"K at batch 1 (last 50): {tail[1]}\nK at batch 32 (last 50): {tail[32]}")
    assert min(tail[1]) > 0
    assert max(tail[32]) == 0
