"""Reading the whole policy at max_classes x MAX_DRAFTS: the credible intervals and GetPolicy /
/api/dashboard before and after, side by side, in one run.

    .venv/bin/python benchmarks/policy_read.py [--repeats N] [--out benchmarks/results]

The state is benchmarks/sidecar_memory.py's case classes-max: one engine of MAX_DRAFTS model
drafts reporting max_classes classes (its bound, 256) x every draft x K 1..max_k, here in one
report applied to the core directly (no shedding). Measured, each the median of --repeats:

- intervals: the 90% credible interval of every estimate GetPolicy reports (~4,100 x 8
  positions), the former way (a 4,097-point grid in x per estimate, one pass per end) against
  now (``specpilot.controller.core.beta.credible_bounds``: both ends, every estimate, one pass);
  also now one call per estimate, and all three on as many distinct random posteriors (alpha,
  beta log-uniform in [1, 1e4]: nothing shared, unlike the workload's repeated histograms).
  With the largest difference between the former and the new figures.
- reads: on a real server in this process (gRPC and HTTP on loopback), GetPolicy of all classes
  and GET /api/dashboard, the former code path (``former_estimates_values``: figures per
  estimate with the former grid; the generic protobuf-to-JSON converter for the dashboard)
  patched in, then as now. Round trips, the client's parsing included; and the loop's share of
  them (the same calls in-process: snapshot, message, serialization / JSON).

Prints progress; writes policy_read.json and policy_read.md under --out. A benchmark, not a test:
figures move with the machine; the ratios of one run are what compare.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from unittest.mock import patch

import aiohttp
import grpc
import numpy as np
import numpy.typing as npt

from benchmarks.sidecar_memory import (
    MAX_CLASSES_BOUND,
    MAX_K,
    _class_names,
    _draft_names,
    acceptance,
    hello,
    timings,
)
from specpilot.contract import engine_stream
from specpilot.contract.validation import MAX_DRAFTS
from specpilot.controller import wire
from specpilot.controller.core.acceptance import CREDIBLE_LEVEL
from specpilot.controller.core.beta import credible_bounds
from specpilot.controller.core.controller import ControllerCore
from specpilot.controller.core.snapshot import AcceptanceEstimate, CoreSnapshot
from specpilot.controller.dashboard import routes
from specpilot.controller.server import views
from specpilot.controller.server.app import RunningServer, start_server
from specpilot.controller.server.stubs import async_policy_stub
from specpilot.controller.settings import load_settings
from specpilot.v1 import engine_pb2, policy_pb2

FloatArray = npt.NDArray[np.float64]
LEVEL = CREDIBLE_LEVEL
TOKEN = "policy-read-bench"


def _progress(msg: str) -> None:
    print(f"  {msg}", flush=True)


# --- the former method, kept here for the comparison --------------------------------------------
def former_grid_ppf(q: float, a: FloatArray, b: FloatArray) -> FloatArray:
    """The quantile as specpilot.controller.core.acceptance computed it before: the CDF summed on a
    1/4096 grid in x, recomputed for every call."""
    grid = np.linspace(0.0, 1.0, 4097)[1:-1]
    log_pdf = (a[:, None] - 1.0) * np.log(grid) + (b[:, None] - 1.0) * np.log1p(-grid)
    log_pdf -= log_pdf.max(axis=1, keepdims=True)
    cdf = np.cumsum(np.exp(log_pdf), axis=1)
    cdf /= cdf[:, -1:]
    idx = np.argmax(cdf >= q, axis=1)
    return np.asarray(grid[idx], dtype=np.float64)


def former_interval(a: FloatArray, b: FloatArray, level: float) -> tuple[FloatArray, FloatArray]:
    tail = (1.0 - level) / 2.0
    return former_grid_ppf(tail, a, b), former_grid_ppf(1.0 - tail, a, b)


def former_estimates_values(estimates: Sequence[AcceptanceEstimate], credible_level: float
                            ) -> list[wire.EstimateValues]:
    """The figures of every estimate as estimate_to_proto computed them before: one estimate at
    a time, its interval on the former grid."""
    out = []
    for e in estimates:
        n = e.positions
        lower, upper = former_interval(np.array(e.alpha[:n]), np.array(e.beta[:n]),
                                       credible_level)
        out.append(wire.EstimateValues(e.mean.tolist(), lower.tolist(), upper.tolist(),
                                       e.effective_tries.tolist(), e.expected_tokens.tolist()))
    return out


@contextmanager
def former_code() -> Iterator[None]:
    """The read path as it was: per-estimate figures, the generic JSON converter."""
    def generic_json(snap: CoreSnapshot, traffic_class: str = "") -> dict[str, Any]:
        return views.to_json_dict(views.policy_response(snap, traffic_class))

    with patch.object(wire, "estimates_values", former_estimates_values), \
            patch.object(views, "policy_json", generic_json), \
            patch.object(routes, "policy_json", generic_json):
        yield


# --- the state ----------------------------------------------------------------------------------
def fill(core: ControllerCore, classes: int, drafts: int, now: float) -> None:
    """sidecar_memory's classes-max state: one engine, ``classes`` x ``drafts`` x K 1..max_k."""
    names = _draft_names(drafts, False)
    msg = engine_pb2.ConnectRequest.FromString(hello("filler", names)).hello
    core.connect_engine(engine_stream.hello_from_proto(msg), now)
    report = engine_pb2.EngineReport(
        sequence=1, interval_seconds=1.0, running_requests=64,
        acceptance=acceptance(_class_names(classes, True), names, range(1, MAX_K + 1)),
        step_timings=timings(names))
    core.ingest("filler", engine_stream.report_from_proto(report), now)
    core.decide(now)


def _median(fn: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def _interval_times(a_s: list[FloatArray], b_s: list[FloatArray], label: str,
                    repeats: int) -> dict[str, float]:
    """Former, now one call per estimate, now in one pass: the intervals of (a_s, b_s)."""
    flat_a, flat_b = np.concatenate(a_s), np.concatenate(b_s)
    pairs = list(zip(a_s, b_s, strict=True))
    former_s, former = _median(lambda: [former_interval(a, b, LEVEL) for a, b in pairs],
                               repeats)
    _progress(f"intervals, {label}: former {former_s:.3f} s")
    each_s, _ = _median(lambda: [credible_bounds(a, b, LEVEL) for a, b in pairs], repeats)
    _progress(f"intervals, {label}: now, one call per estimate {each_s:.3f} s")
    batch_s, (lower, upper) = _median(lambda: credible_bounds(flat_a, flat_b, LEVEL), repeats)
    _progress(f"intervals, {label}: now, one pass {batch_s:.4f} s")
    old_lower = np.concatenate([lo for lo, _ in former])
    old_upper = np.concatenate([hi for _, hi in former])
    return {"former_seconds": former_s, "now_per_estimate_seconds": each_s,
            "now_one_pass_seconds": batch_s, "speedup": former_s / batch_s,
            "max_abs_difference_vs_former": float(max(np.abs(lower - old_lower).max(),
                                                      np.abs(upper - old_upper).max()))}


def bench_intervals(estimates: Sequence[AcceptanceEstimate], repeats: int) -> dict[str, Any]:
    """The credible intervals of ``estimates``, and of as many distinct random posteriors."""
    alphas = [np.array(e.alpha[:e.positions]) for e in estimates]
    betas = [np.array(e.beta[:e.positions]) for e in estimates]
    rng = np.random.default_rng(0)
    rand_a = [10.0 ** rng.uniform(0.0, 4.0, a.size) for a in alphas]
    rand_b = [10.0 ** rng.uniform(0.0, 4.0, a.size) for a in alphas]
    return {"estimates": len(estimates), "positions": int(sum(a.size for a in alphas)),
            "workload": _interval_times(alphas, betas, "workload", repeats),
            "distinct": _interval_times(rand_a, rand_b, "distinct", repeats)}


def bench_loop(core: ControllerCore, repeats: int) -> dict[str, float]:
    """The loop's share of a read: the same work in-process, no transport."""
    def get_policy() -> int:
        return len(views.policy_response(core.snapshot(time.time())).SerializeToString())

    def dashboard() -> int:
        return len(views.json_dumps(views.policy_json(core.snapshot(time.time()))))

    out = {}
    for label, code in (("former", former_code), ("now", _unchanged)):
        with code():
            out[f"{label}_get_policy_seconds"] = _median(get_policy, repeats)[0]
            out[f"{label}_dashboard_policy_json_seconds"] = _median(dashboard, repeats)[0]
        _progress(f"loop, {label}: GetPolicy {out[f'{label}_get_policy_seconds']:.3f} s, "
                  f"dashboard's policy JSON {out[f'{label}_dashboard_policy_json_seconds']:.3f}"
                  " s")
    out["snapshot_seconds"] = _median(lambda: core.snapshot(time.time()), repeats)[0]
    return out


@contextmanager
def _unchanged() -> Iterator[None]:
    yield


async def bench_server(server: RunningServer, repeats: int) -> dict[str, Any]:
    """GetPolicy and /api/dashboard over loopback, former and now."""
    out: dict[str, Any] = {}
    async with grpc.aio.insecure_channel(server.grpc_target,
                                         options=[("grpc.max_receive_message_length",
                                                   64 << 20)]) as channel, \
            aiohttp.ClientSession() as http:
        policy = async_policy_stub(channel)
        for label, code in (("former", former_code), ("now", _unchanged)):
            with code():
                for name in ("get_policy", "dashboard"):
                    times, size = [], 0
                    for _ in range(repeats):
                        start = time.perf_counter()
                        if name == "get_policy":
                            resp = await policy.GetPolicy(policy_pb2.GetPolicyRequest())
                            size, classes = resp.ByteSize(), len(resp.classes)
                            out["classes"] = classes
                            out["estimates"] = sum(len(c.estimates) for c in resp.classes)
                        else:
                            async with http.get(server.http_url + "/api/dashboard") as r:
                                size = len(await r.read())
                        times.append(time.perf_counter() - start)
                    out[f"{label}_{name}_seconds"] = statistics.median(times)
                    out[f"{label}_{name}_bytes"] = size
                    _progress(f"server, {label}: {name} {statistics.median(times):.3f} s "
                              f"(median of {repeats}), {size:,} bytes")
    return out


async def run(repeats: int, classes: int, drafts: int) -> dict[str, Any]:
    server = await start_server(load_settings(
        grpc_port=0, http_port=0, max_classes=classes, seed=1, policy_token=TOKEN))
    try:
        start = time.perf_counter()
        fill(server.core, classes, drafts, time.time())
        snap = server.core.snapshot(time.time())
        estimates = [e for c in snap.classes for e in c.estimates]
        _progress(f"state: {len(snap.classes)} classes, {len(estimates):,} estimates in "
                  f"{time.perf_counter() - start:.1f} s")
        intervals = bench_intervals(estimates, repeats)
        loop = bench_loop(server.core, repeats)
        reads = await bench_server(server, repeats)
    finally:
        await server.stop()
    return {"intervals": intervals, "loop": loop, "server": reads}


def markdown(r: dict[str, Any]) -> str:
    i, lp, s = r["intervals"], r["loop"], r["server"]
    lines = [f"{r['classes']} classes x {r['drafts']} drafts x K 1..{MAX_K}: "
             f"{i['estimates']:,} estimates, {i['positions']:,} positions; median of "
             f"{r['repeats']}, {r['machine']}", "",
             "| measurement | former | now | former / now |", "|---|---|---|---|"]

    def row(label: str, old: float, new: float, unit: str = "s") -> None:
        lines.append(f"| {label} | {old:.3f} {unit} | {new:.4f} {unit} | {old / new:.0f}x |")

    for label in ("workload", "distinct"):
        x = i[label]
        what = "the workload's posteriors" if label == "workload" else "distinct posteriors"
        row(f"credible intervals of every estimate, {what} (one pass)", x["former_seconds"],
            x["now_one_pass_seconds"])
        row("the same, one call per estimate", x["former_seconds"],
            x["now_per_estimate_seconds"])
    row("GetPolicy, the loop's share (snapshot, message, serialization)",
        lp["former_get_policy_seconds"], lp["now_get_policy_seconds"])
    row("the dashboard's policy JSON, the loop's share (snapshot, JSON, text)",
        lp["former_dashboard_policy_json_seconds"], lp["now_dashboard_policy_json_seconds"])
    row("GetPolicy over gRPC (all classes)", s["former_get_policy_seconds"],
        s["now_get_policy_seconds"])
    row("GET /api/dashboard over HTTP", s["former_dashboard_seconds"],
        s["now_dashboard_seconds"])
    lines += ["", f"Largest difference of an interval's end, now vs former: workload "
              f"{i['workload']['max_abs_difference_vs_former']:.1e}, distinct "
              f"{i['distinct']['max_abs_difference_vs_former']:.1e} (the former grid's "
              f"resolution is 2.4e-4). Snapshot alone: {lp['snapshot_seconds']:.3f} s."]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5, help="runs of each measurement (median)")
    ap.add_argument("--classes", type=int, default=MAX_CLASSES_BOUND,
                    help="traffic classes (default: max_classes' bound)")
    ap.add_argument("--drafts", type=int, default=MAX_DRAFTS, help="model drafts of the engine")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    print(f"specpilot policy reads: {args.classes} classes x {args.drafts} drafts, "
          f"median of {args.repeats}", flush=True)
    start = time.monotonic()
    result = asyncio.run(run(args.repeats, args.classes, args.drafts))
    result.update(classes=args.classes, drafts=args.drafts, repeats=args.repeats,
                  machine=f"{platform.machine()}, {os.cpu_count()} CPUs",
                  python=platform.python_version(), seconds=round(time.monotonic() - start))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "policy_read.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "policy_read.md").write_text(markdown(result))
    print(markdown(result))
    print(f"{result['seconds']} s in all; {out / 'policy_read.json'}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
