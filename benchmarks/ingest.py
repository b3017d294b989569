"""Micro-benchmark of the controller: reports ingested per second on one core, and the latency from
an engine report to the policy update it causes, over the real gRPC server on loopback.

    python benchmarks/ingest.py [--reports N] [--out benchmarks/results]

Writes ingest.json and ingest.md under --out (docs/benchmarks.md quotes the table). A benchmark,
not a test: figures vary with the machine; the ratios between rows measured in one run are what
compare.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from pathlib import Path

import grpc
import numpy as np

from benchmarks.synthetic_engine import SyntheticEngine, TrueCost
from specpilot.contract.records import (
    AcceptanceRecord,
    DraftKind,
    DraftSpec,
    EngineHello,
    EngineReport,
    RequestSummaryRecord,
    StepTimingRecord,
)
from specpilot.controller.core.controller import ControllerCore
from specpilot.controller.server.app import start_server
from specpilot.controller.server.stubs import engine_stub
from specpilot.controller.settings import core_config, load_settings
from specpilot.v1 import engine_pb2

ROOT = Path(__file__).resolve().parent.parent

CLASSES = [f"class-{i}" for i in range(8)]
# A flipping report whose policy change has not come after this long moved no decision.
NO_CHANGE_SECONDS = 1.0
K = 4


def _progress(label: str, done: int, total: int) -> None:
    if done == total or done % max(total // 10, 1) == 0:
        print(f"\r  {label}: {done}/{total}", end="\n" if done == total else "", flush=True)


def realistic_report(seq: int, rng: np.random.Generator) -> EngineReport:
    """One report interval of a busy engine: 8 classes, K=4 histograms, 9 step-timing groups,
    32 finished requests."""
    acceptance = tuple(
        AcceptanceRecord(c, "draft", K, tuple(int(x) for x in rng.integers(0, 200, K + 1)))
        for c in CLASSES
    )
    finished = tuple(RequestSummaryRecord(CLASSES[i % 8], "draft", 200, 100, 120, 80, 1.5)
                     for i in range(32))
    timings = tuple(StepTimingRecord(b, "draft", K, 50, 50 * 2**b, 50 * 2**b * 5, 50 * 2**b * 4,
                                     50 * 0.02 * (1 + 0.1 * b)) for b in range(9))
    return EngineReport(seq, 1.0, 1, acceptance, finished, timings)


def bench_core(reports: int) -> dict[str, float]:
    """Reports per second through ControllerCore on this core: ingest alone, ingest + decide."""
    settings = load_settings(seed=1)
    rng = np.random.default_rng(0)
    batch = [realistic_report(i + 1, rng) for i in range(reports)]
    hello = EngineHello("e", "m", "v", (DraftSpec("draft", DraftKind.MODEL, 8, "v"),), 8)
    # A batch-wide engine drafts only the K asked, so decide also runs the joint (whole-batch)
    # arm search (two stale buckets per decide round; a bucket is stale after 5 reports here).
    batch_wide = replace(hello, batch_wide_k=True)
    results = {}
    for label, decide, engine in (("ingest", False, hello), ("ingest_and_decide", True, hello),
                                  ("ingest_and_decide_batch_wide", True, batch_wide)):
        core = ControllerCore(core_config(settings), np.random.default_rng(0))
        core.connect_engine(engine, 0.0)
        start = time.perf_counter()
        for i, rep in enumerate(batch):
            now = float(i)
            core.ingest("e", rep, now)
            if decide:
                core.decide(now)
            _progress(label, i + 1, reports)
        results[label] = reports / (time.perf_counter() - start)
    return results


async def bench_grpc(reports: int) -> dict[str, float]:
    """Over loopback: report round trips per second on one stream, and report -> policy latency
    for reports that flip a class's decision."""
    settings = load_settings(grpc_port=0, http_port=0, seed=1, max_k=4, dwell_seconds=0.0,
                             hysteresis_ratio=0.0, half_life_seconds=0.001,
                             change_fast_half_life_seconds=0.0005, report_interval_seconds=60.0)
    server = await start_server(settings)
    engine = SyntheticEngine({"flip": np.full(4, 0.95)}, TrueCost(), max_k=4,
                             steps_per_report=5000)
    outbox: asyncio.Queue[engine_pb2.ConnectRequest] = asyncio.Queue()
    latencies: list[float] = []
    round_trips: list[float] = []
    unchanged = 0

    async def requests() -> AsyncIterator[engine_pb2.ConnectRequest]:
        while True:
            yield await outbox.get()

    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
            call = engine_stub(channel).Connect(requests())
            await outbox.put(engine.hello())
            inbox: asyncio.Queue[engine_pb2.ConnectResponse] = asyncio.Queue()

            async def read() -> None:
                async for msg in call:
                    await inbox.put(msg)

            reader = asyncio.create_task(read())

            async def until(pred: Callable[[engine_pb2.ConnectResponse], bool]
                            ) -> engine_pb2.ConnectResponse:
                while not pred(msg := await asyncio.wait_for(inbox.get(), NO_CHANGE_SECONDS)):
                    if msg.WhichOneof("message") == "policy":
                        engine.policy = msg.policy
                return msg

            first = await until(lambda m: m.WhichOneof("message") == "policy")
            engine.policy = first.policy
            for i in range(reports):
                # Alternate easy and hopeless traffic: every report moves the decision.
                engine.rates["flip"] = np.full(4, 0.95 if i % 2 else 0.02)
                version = engine.policy.version
                sent = time.perf_counter()
                await outbox.put(engine.report())
                await until(lambda m: m.WhichOneof("message") == "report_result")
                round_trips.append(time.perf_counter() - sent)

                def newer(m: engine_pb2.ConnectResponse, v: int = version) -> bool:
                    return m.WhichOneof("message") == "policy" and m.policy.version > v

                try:
                    msg = await until(newer)
                except TimeoutError:  # this report moved no decision (a draw kept the arm)
                    unchanged += 1
                    continue
                latencies.append(time.perf_counter() - sent)
                engine.policy = msg.policy
                _progress("grpc report -> policy", i + 1, reports)
            call.cancel()
            reader.cancel()
    finally:
        await server.stop()
    lat = sorted(latencies)
    return {
        "round_trips_per_second": len(round_trips) / sum(round_trips),
        "report_to_policy_p50_ms": 1e3 * statistics.median(lat),
        "report_to_policy_p99_ms": 1e3 * lat[min(len(lat) - 1, int(0.99 * len(lat)))],
        "policy_updates": float(len(latencies)),
        "reports_without_a_policy_change": float(unchanged),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reports", type=int, default=2000, help="reports per measurement")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})  # one core
    print(f"specpilot ingest benchmark: {args.reports} reports per measurement, one core")
    core = bench_core(args.reports)
    wire = asyncio.run(bench_grpc(max(args.reports // 4, 50)))
    result = {
        "machine": f"{platform.machine()} {platform.processor() or ''} cpus={os.cpu_count()}",
        "python": platform.python_version(),
        "reports": args.reports,
        "core_reports_per_second": core,
        "grpc": wire,
        "decide_cost_ratio": core["ingest"] / core["ingest_and_decide"],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "ingest.json").write_text(json.dumps(result, indent=2) + "\n")
    table = "\n".join([
        "| measurement | value |",
        "|---|---|",
        f"| core ingest, reports/s (8 classes, K=4, 9 timing groups, 32 requests) "
        f"| {core['ingest']:,.0f} |",
        f"| core ingest + decide, reports/s | {core['ingest_and_decide']:,.0f} |",
        f"| core ingest + decide, batch-wide engine (8 classes in the joint search), reports/s | "
        f"{core['ingest_and_decide_batch_wide']:,.0f} |",
        f"| decide cost (ingest-only rate / ingest+decide rate) "
        f"| {result['decide_cost_ratio']:.1f}x |",
        f"| gRPC loopback report round trips/s (one stream, one in flight) "
        f"| {wire['round_trips_per_second']:,.0f} |",
        f"| report -> policy update latency p50 | {wire['report_to_policy_p50_ms']:.2f} ms |",
        f"| report -> policy update latency p99 | {wire['report_to_policy_p99_ms']:.2f} ms |",
    ])
    (args.out / "ingest.md").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
