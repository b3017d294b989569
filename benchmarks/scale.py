"""Scale benchmarks: one controller for many engines, and one Redis for many sidecars.

    python benchmarks/scale.py controller [--engines 64] [--seconds 6] [--out benchmarks/results]
    python benchmarks/scale.py overload [--engine-counts 16,64,150,250,500] [--seconds 8]
    python benchmarks/scale.py fleet [--sidecars 4,16,64] [--out benchmarks/results]
    python benchmarks/scale.py streams [--streams 1000] [--engines 200] [--seconds 60]

``controller``: the real server (this process, pinned to one core) and a client process on
another core streaming ``--engines`` engines over loopback, each report a busy engine's interval
(8 classes, K=4, 9 step-timing groups, 32 finished requests), at increasing offered rates; one
more engine flips its class's acceptance every report. Per rate: reports acknowledged per second,
report -> acknowledgement latency, report -> decided (how long each report waited for the
decide round that used it, as the server measures it: then its policy goes out), and for the
flipping engine report -> new policy as it saw it (p50, p99).

``overload``: the real server on one core with the embedded defaults (report_budget_share 0.5)
and a client on the other running 0 to 500 engines, each reporting a busy interval once a second
and backing off as the plugin does when a report is shed; a probe process beside it asks gRPC
health, GetPolicy and HTTP /healthz every 100 ms. Per engine count: reports accepted and shed per
second, report -> answer latency, and each probe's latency (p50, p99, max) and failures.

``streams``: ``overload``'s set-up with ``--engines`` engines and, beside the control without
them, ``--streams`` dashboard event streams (/api/events, read as they come, from a viewer
process on the client core) while that process writes and clears an override every
CHURN_INTERVAL (decision churn, each round rendered and fanned out to every stream): probe
latencies and failures, how late the server's loop runs a 10 ms timer (the server's share of
any probe's wait; the probes also wait for their own core, which the client processes share),
reports lost (an engine stream that broke with one in flight), decision events the viewers
received, streams dropped, and the server's resident memory.

``fleet``: N sidecars (the real FleetSync and RedisStore, split over worker processes) sharing
one redis-server, each with evidence for 8 classes x 2 drafts and engine options, flushing every
``--interval`` seconds: Redis commands and bytes per flush per sidecar (INFO commandstats and
stats), redis-server CPU per flush per sidecar (INFO cpu), and the largest fleet one Redis carries
at the default 5 s interval, extrapolated from a fit of CPU per flush against N.

Writes scale-<part>.json and .md (and .png with matplotlib) under --out; docs/benchmarks.md quotes
them. A benchmark, not a test: the figures vary with the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, TypeVar

import grpc
import numpy as np

from benchmarks.ingest import realistic_report
from benchmarks.plots import plots_available, pyplot, save_figure
from benchmarks.synthetic_engine import SyntheticEngine, TrueCost
from specpilot.contract import engine_stream
from specpilot.contract.records import DraftKind, DraftSpec, EngineHello
from specpilot.controller.server.app import start_server
from specpilot.controller.server.stubs import engine_stub
from specpilot.controller.settings import load_settings
from specpilot.engine_plugin.link import shed_backoff, shed_pause
from specpilot.v1 import engine_pb2

ROOT = Path(__file__).resolve().parent.parent

OFFERED_RATES = (64, 256, 512, 1024, 1536)  # reports/s over all engines
CONNECT = f"/{engine_pb2.DESCRIPTOR.services_by_name['EngineService'].full_name}/Connect"
_RESULT_TAG, _POLICY_TAG = bytes([2 << 3 | 2]), bytes([3 << 3 | 2])  # ConnectResponse fields
M = TypeVar("M")


def _pin(core_index: int) -> None:
    if hasattr(os, "sched_setaffinity"):
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cores[core_index % len(cores)]})


def _percentile(values: list[float], q: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, int(q * len(v)))] if v else float("nan")


# --- controller ----------------------------------------------------------------------------------
def hello_request(engine_id: str, batch_wide: bool = False) -> engine_pb2.ConnectRequest:
    return engine_pb2.ConnectRequest(hello=engine_stream.hello_to_proto(EngineHello(
        engine_id, "bench-target", "v", (DraftSpec("draft", DraftKind.MODEL, 8, "v"),), 8,
        per_request_k=not batch_wide, batch_wide_k=batch_wide)))


async def _drain(outbox: asyncio.Queue[M | None]) -> AsyncIterator[M]:
    """A request stream of what is put on ``outbox``; None ends it."""
    while (msg := await outbox.get()) is not None:
        yield msg


def busy_report(engine_id: str) -> tuple[np.random.Generator, engine_pb2.EngineReport]:
    """A busy engine's rng and its report (a busy interval; set ``sequence`` before each
    send)."""
    rng = np.random.default_rng(abs(hash(engine_id)) % 2**32)
    return rng, engine_stream.report_to_proto(realistic_report(1, rng))


def busy_stream(engine_id: str) -> tuple[np.random.Generator, engine_pb2.EngineReport,
                                         asyncio.Queue[engine_pb2.ConnectRequest | None],
                                         AsyncIterator[engine_pb2.ConnectRequest]]:
    """A busy engine's parts: ``busy_report``'s, and a Connect request stream fed from a queue
    (None ends it)."""
    rng, report = busy_report(engine_id)
    outbox: asyncio.Queue[engine_pb2.ConnectRequest | None] = asyncio.Queue()
    return rng, report, outbox, _drain(outbox)


class EngineStream:
    """One engine's Connect stream on a channel of its own, its messages sent serialized and its
    responses left as bytes: the first byte of a ConnectResponse is its oneof's tag (policy
    0x1a, report_result 0x12), so a client of many engines need not parse the policy updates
    every decide round fans out to every engine.

    Reports go one at a time, each answered before the next (``answer``); ``send`` sends one
    until it is taken, a shed one again after ``pause``: the controller's
    ``ReportResult.retry_after_seconds``, or with ``backoff`` the plugin's pause (the report
    ``interval`` x ``specpilot.engine_plugin.link.shed_backoff``'s factor, ``shed_pause`` after a
    shed report)."""

    def __init__(self, target: str, hello: engine_pb2.ConnectRequest | bytes, *,
                 backoff: bool = False, interval: float = 1.0) -> None:
        self._channel = grpc.aio.insecure_channel(target)
        self._outbox: asyncio.Queue[bytes | None] = asyncio.Queue()
        connect = self._channel.stream_stream(CONNECT, request_serializer=None,
                                              response_deserializer=None)
        self._call = connect(_drain(self._outbox))
        self._responses: AsyncIterator[bytes] = aiter(self._call)
        self._hello = hello if isinstance(hello, bytes) else hello.SerializeToString()
        self._backoff, self._interval = backoff, interval
        self.factor = 1.0  # the plugin's backoff
        self.pause = 0.0  # seconds from the last answer to the next report
        self.sequence = 0
        self.accepted = self.shed = 0

    async def connect(self) -> None:
        """The hello sent and the first policy received."""
        await self._outbox.put(self._hello)
        while (await anext(self._responses))[:1] != _POLICY_TAG:
            pass

    def request(self, report: engine_pb2.EngineReport) -> bytes:
        """``report`` with this stream's next sequence number, a serialized ConnectRequest."""
        self.sequence += 1
        report.sequence = self.sequence
        return engine_pb2.ConnectRequest(report=report).SerializeToString()

    async def answer(self, data: bytes) -> engine_pb2.ReportResult:
        """A serialized report sent and its result (policy updates on the way skipped), counted
        as taken or shed, ``pause`` set; RuntimeError if it is refused."""
        await self._outbox.put(data)
        while (raw := await anext(self._responses))[:1] != _RESULT_TAG:
            pass
        result = engine_pb2.ConnectResponse.FromString(raw).report_result
        if result.accepted:
            self.accepted += 1
        elif result.code == engine_stream.REPORT_SHED_CODE:
            self.shed += 1
        else:
            raise RuntimeError(f"report {result.sequence} refused: {result.reason}")
        self.factor = shed_backoff(self.factor, shed=not result.accepted)
        if not self._backoff:
            self.pause = result.retry_after_seconds
        elif result.accepted:
            self.pause = self._interval * self.factor
        else:
            self.pause = shed_pause(self._interval, self.factor, result.retry_after_seconds)
        return result

    async def send(self, data: bytes) -> None:
        """A serialized report sent until it is taken."""
        while not (await self.answer(data)).accepted:
            await asyncio.sleep(self.pause)

    async def report(self, report: engine_pb2.EngineReport) -> None:
        """``report``, with the next sequence number, sent until it is taken."""
        await self.send(self.request(report))

    async def close(self) -> None:
        await self._outbox.put(None)
        self._call.cancel()
        await self._channel.close(None)


async def _engine(engine_id: str, interval: float, until: float, acks: list[float],
                  target: str, batch_wide: bool) -> None:
    """One engine streaming busy reports every ``interval`` seconds (one in flight)."""
    rng, report = busy_report(engine_id)
    engine = EngineStream(target, hello_request(engine_id, batch_wide))  # 64 fit on one core
    try:
        await engine.connect()
        await asyncio.sleep(float(rng.random()) * interval)  # engines out of phase
        while time.monotonic() < until:
            sent = time.monotonic()
            data = engine.request(report)
            await engine.answer(data)
            acks.append(time.monotonic() - sent)
            await asyncio.sleep(max(0.0, interval - (time.monotonic() - sent)))
    finally:
        await engine.close()


async def _flipper(until: float, latencies: list[float], target: str) -> None:
    """An engine whose class alternates easy and hopeless traffic: each report moves its
    decision, so report -> policy latency is measured on every report."""
    engine = SyntheticEngine({"flip": np.full(4, 0.95)}, TrueCost(), max_k=4,
                             steps_per_report=5000, engine_id="flipper")
    outbox: asyncio.Queue[engine_pb2.ConnectRequest | None] = asyncio.Queue()
    async with grpc.aio.insecure_channel(target) as channel:
        call = engine_stub(channel).Connect(_drain(outbox))
        await outbox.put(engine.hello())
        responses = aiter(call)
        while (msg := await anext(responses)).WhichOneof("message") != "policy":
            pass
        engine.policy = msg.policy
        i = 0
        while time.monotonic() < until:
            i += 1
            engine.rates["flip"] = np.full(4, 0.95 if i % 2 else 0.02)
            version = engine.policy.version
            sent = time.monotonic()
            await outbox.put(engine.report())
            got_result = got_policy = False
            while not (got_result and got_policy):
                msg = await anext(responses)
                kind = msg.WhichOneof("message")
                got_result |= kind == "report_result"
                if kind == "policy":
                    engine.policy = msg.policy
                    if msg.policy.version > version and not got_policy:
                        got_policy = True
                        latencies.append(time.monotonic() - sent)
            await asyncio.sleep(0.05)
        await outbox.put(None)
        call.cancel()


def _client(target: str, engines: int, rate: float, seconds: float, batch_wide: bool,
            core: int, out: Any) -> None:
    """Client process: ``engines`` engines at ``rate`` reports/s in all, plus the flipper."""
    _pin(core)

    async def run() -> dict[str, list[float]]:
        acks: list[float] = []
        flips: list[float] = []
        until = time.monotonic() + seconds
        await asyncio.gather(
            *(_engine(f"engine-{i}", engines / rate, until, acks, target, batch_wide)
              for i in range(engines)),
            _flipper(until, flips, target))
        return {"acks": acks, "flips": flips}

    out.send(asyncio.run(run()))


async def _serve_one_rate(engines: int, rate: float, seconds: float,
                          batch_wide: bool) -> dict[str, Any]:
    # The embedded defaults: the flipper's reports move its class through the change detector.
    settings = load_settings(grpc_port=0, http_port=0, seed=1, max_k=4, max_classes=16)
    server = await start_server(settings)
    decided: list[float] = []  # each report's wait for its decide round, as the hub measures it
    observe = server.metrics.reports_decided

    def record(waits: Any) -> None:
        waits = list(waits)
        decided.extend(waits)
        observe(waits)

    server.metrics.reports_decided = record  # type: ignore[method-assign]
    ctx = mp.get_context("spawn")
    receive, send = ctx.Pipe(duplex=False)
    client = ctx.Process(target=_client, args=(server.grpc_target, engines, rate, seconds,
                                               batch_wide, 1, send))
    start, cpu_start = time.monotonic(), time.process_time()
    client.start()
    try:
        while not receive.poll():
            await asyncio.sleep(0.05)
        got: dict[str, list[float]] = receive.recv()
    finally:
        client.join(timeout=30)
        await server.stop(grace_seconds=0.5)
    elapsed = time.monotonic() - start
    cpu = time.process_time() - cpu_start  # the server's process: its loop and gRPC's threads
    acks, flips = got["acks"], got["flips"]
    return {
        "mode": "batch-wide" if batch_wide else "per-request",
        "offered_reports_per_second": rate,
        "acked_reports_per_second": len(acks) / seconds,
        "ack_p50_ms": 1e3 * statistics.median(acks) if acks else float("nan"),
        "ack_p99_ms": 1e3 * _percentile(acks, 0.99),
        "decision_p50_ms": 1e3 * statistics.median(decided) if decided else float("nan"),
        "decision_p99_ms": 1e3 * _percentile(decided, 0.99),
        "policy_p50_ms": 1e3 * statistics.median(flips) if flips else float("nan"),
        "policy_p99_ms": 1e3 * _percentile(flips, 0.99),
        "policy_updates_measured": float(len(flips)),
        "wall_seconds": elapsed,
        "server_cpu_fraction": cpu / elapsed,
    }


def bench_controller(args: argparse.Namespace) -> dict[str, Any]:
    _pin(0)
    rows = []
    runs = [(False, rate) for rate in args.rates] + [(True, rate) for rate in args.batch_wide_rates]
    for batch_wide, rate in runs:
        mode = "batch-wide" if batch_wide else "per-request"
        print(f"  controller: {args.engines} {mode} engines at {rate:.0f} reports/s offered ...",
              flush=True)
        row = asyncio.run(_serve_one_rate(args.engines, rate, args.seconds, batch_wide))
        print(f"    server CPU {row['server_cpu_fraction']:.0%}; "
              f"acked {row['acked_reports_per_second']:.0f}/s, ack p99 "
              f"{row['ack_p99_ms']:.1f} ms, report -> policy p99 {row['policy_p99_ms']:.1f} ms",
              flush=True)
        rows.append(row)
    return {"engines": args.engines, "seconds_per_rate": args.seconds, "rows": rows}


def _p50_p99(row: dict[str, Any], name: str) -> str:
    return f"{row[f'{name}_p50_ms']:.1f} / {row[f'{name}_p99_ms']:.1f}"


def _controller_md(result: dict[str, Any]) -> str:
    # (The flipping engine's report -> new policy is in the JSON: it measures how often its
    # decision moved as much as how fast, so it is not a latency figure.)
    lines = ["| engines' K | offered reports/s | acknowledged reports/s | "
             "report -> ack p50 / p99 ms | report -> decided p50 / p99 ms |",
             "|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['mode']} | {r['offered_reports_per_second']:.0f} | "
                     f"{r['acked_reports_per_second']:.0f} | {_p50_p99(r, 'ack')} | "
                     f"{_p50_p99(r, 'decision')} |")
    return "\n".join(lines)


def _latency_axis(ax: Any, line_ms: float, line_label: str, xlabel: str) -> None:
    ax.axhline(line_ms, color="grey", ls="--", lw=1, label=line_label)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("ms")
    ax.set_yscale("log")
    ax.legend(fontsize=7)


def _controller_plot(result: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    top = max(r["offered_reports_per_second"] for r in result["rows"])
    left.plot([0, top], [0, top], "k:", label="offered")
    for mode, marker in (("per-request", "o"), ("batch-wide", "s")):
        rows = [r for r in result["rows"] if r["mode"] == mode]
        if not rows:
            continue
        offered = [r["offered_reports_per_second"] for r in rows]
        left.plot(offered, [r["acked_reports_per_second"] for r in rows], marker + "-",
                  label=f"acknowledged, {mode}")
        right.plot(offered, [r["decision_p99_ms"] for r in rows], marker + "-",
                   label=f"report -> decided p99, {mode}")
        right.plot(offered, [r["ack_p99_ms"] for r in rows], marker + ":",
                   label=f"report -> ack p99, {mode}")
    left.set_xlabel("offered reports/s")
    left.set_ylabel("reports/s")
    left.legend(fontsize=8)
    left.set_title(f"{result['engines']} engines, one controller core")
    _latency_axis(right, 50, "50 ms", "offered reports/s")
    save_figure(fig, path)


# --- overload ------------------------------------------------------------------------------------
ENGINE_COUNTS = (16, 64, 150, 250, 500)
PROBE_INTERVAL, PROBE_TIMEOUT = 0.1, 2.0  # seconds; a kubelet probe's default timeout is 1 s


async def _shedding_engine(engine_id: str, until_ready: asyncio.Event, until: list[float],
                           stats: dict[str, list[float]], target: str) -> None:
    """One engine reporting once a second as the plugin does under shedding: a shed payload is
    sent again first, after a pause of the interval x its backoff (``EngineStream``'s)."""
    rng, report = busy_report(engine_id)
    engine = EngineStream(target, hello_request(engine_id), backoff=True)
    try:
        await engine.connect()
        stats["connected"].append(1.0)
        await until_ready.wait()
        await asyncio.sleep(float(rng.random()))  # engines out of phase
        while time.monotonic() < until[0]:
            sent = time.monotonic()
            data = engine.request(report)
            result = await engine.answer(data)
            stats["ack"].append(time.monotonic() - sent)
            stats["accepted" if result.accepted else "shed"].append(sent)
            await asyncio.sleep(max(0.0, engine.pause - (time.monotonic() - sent)))
    finally:
        await engine.close()


def _overload_client(target: str, engines: int, seconds: float, core: int, out: Any) -> None:
    """Client process: ``engines`` engines; once all are connected, says so and reports for
    ``seconds``."""
    _pin(core)

    async def run() -> dict[str, Any]:
        stats: dict[str, list[float]] = {"connected": [], "ack": [], "accepted": [], "shed": []}
        ready, until = asyncio.Event(), [0.0]
        tasks = [asyncio.ensure_future(_shedding_engine(f"engine-{i}", ready, until, stats,
                                                        target)) for i in range(engines)]
        while len(stats["connected"]) < engines:
            await asyncio.sleep(0.05)
        start = time.monotonic()
        until[0] = start + seconds
        out.send(("reporting", start, until[0]))
        ready.set()
        ended = await asyncio.gather(*tasks, return_exceptions=True)
        # An engine whose stream broke lost the report it had in flight.
        lost = [repr(e)[:200] for e in ended if isinstance(e, BaseException)]
        return {**stats, "start": start, "until": until[0], "lost": lost}

    out.send(("done", asyncio.run(run())))


def _prober(grpc_target: str, http_url: str, core: int, out: Any) -> None:
    """Probe process: gRPC health, GetPolicy and HTTP /healthz every PROBE_INTERVAL between the
    (monotonic) times it is sent; latencies in seconds, a probe past PROBE_TIMEOUT is failed."""
    import urllib.request

    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from specpilot.controller.server.stubs import policy_stub
    from specpilot.v1 import policy_pb2

    _pin(core)
    channel = grpc.insecure_channel(grpc_target)
    health = health_pb2_grpc.HealthStub(channel)
    policy = policy_stub(channel)
    probes: dict[str, Any] = {
        "grpc_health": lambda: health.Check(health_pb2.HealthCheckRequest(),
                                            timeout=PROBE_TIMEOUT),
        "get_policy": lambda: policy.GetPolicy(policy_pb2.GetPolicyRequest(),
                                               timeout=PROBE_TIMEOUT),
        "http_healthz": lambda: urllib.request.urlopen(f"{http_url}/healthz",
                                                       timeout=PROBE_TIMEOUT).read(),
    }
    out.send("ready")
    start, until = out.recv()
    latencies: dict[str, list[float]] = {name: [] for name in probes}
    failed = dict.fromkeys(probes, 0)
    errors: dict[str, str] = {}
    while time.monotonic() < start:
        time.sleep(0.01)
    while (t0 := time.monotonic()) < until:
        for name, probe in probes.items():
            began = time.monotonic()
            try:
                probe()
                latencies[name].append(time.monotonic() - began)
            except Exception as e:  # a failed probe is the figure
                failed[name] += 1
                errors.setdefault(name, repr(e)[:300])
        time.sleep(max(0.0, PROBE_INTERVAL - (time.monotonic() - t0)))
    channel.close()
    out.send({"latencies": latencies, "failed": failed, "errors": errors})


async def _overload_one(engines: int, seconds: float, streams: int | None = None
                        ) -> dict[str, Any]:
    """``streams``: also that many dashboard event streams and decision churn (``streams``
    part); None: neither."""
    # The embedded defaults (report_budget_share 0.5): the sidecar's settings.
    extra: dict[str, Any] = {} if streams is None else {
        "max_event_streams": max(streams, 1), "event_streams_per_client": max(streams, 1),
        "policy_token": STREAMS_TOKEN}
    settings = load_settings(grpc_port=0, http_port=0, seed=1, max_k=4, max_classes=16,
                             **extra)
    server = await start_server(settings)
    ctx = mp.get_context("spawn")
    viewers = None
    if streams is not None:
        view_here, view_there = ctx.Pipe()
        viewers = ctx.Process(target=_stream_client, args=(server.http_port, streams, 1,
                                                           view_there))
        viewers.start()
    probe_here, probe_there = ctx.Pipe()
    prober = ctx.Process(target=_prober, args=(server.grpc_target, server.http_url, 1,
                                               probe_there))
    prober.start()
    receive, send = ctx.Pipe(duplex=False)
    client = ctx.Process(target=_overload_client, args=(server.grpc_target, engines, seconds,
                                                         1, send))

    async def recv(pipe: Any) -> Any:
        while not pipe.poll():
            await asyncio.sleep(0.02)
        return pipe.recv()

    rss: list[float] = []
    lags: list[float] = []
    try:
        assert await recv(probe_here) == "ready"
        opened = await recv(view_here) if viewers is not None else 0
        if engines:
            client.start()
            _, start, until = await recv(receive)
        else:
            start = time.monotonic()
            until = start + seconds
        cpu_start = time.process_time()
        probe_here.send((start, until))
        if viewers is not None:
            view_here.send((start, until))
        sampler = asyncio.ensure_future(_sample_rss(rss))
        lagger = asyncio.ensure_future(_sample_lag(lags))
        got = ((await recv(receive))[1] if engines
               else {"ack": [], "accepted": [], "shed": [], "lost": []})
        probes = await recv(probe_here)
        viewed = await recv(view_here) if viewers is not None else {}
        sampler.cancel()
        lagger.cancel()
        cpu = time.process_time() - cpu_start
        dropped = _counter(server, "specpilot_event_streams_dropped_total")
    finally:
        if engines:
            client.join(timeout=60)
        if viewers is not None:
            viewers.join(timeout=60)
        prober.join(timeout=30)
        await server.stop(grace_seconds=0.5)
    window = until - start
    row: dict[str, Any] = {
        "engines": engines, "offered_reports_per_second": float(engines),
        "accepted_reports_per_second": len(got["accepted"]) / window,
        "shed_reports_per_second": len(got["shed"]) / window,
        "shed_share": len(got["shed"]) / max(1, len(got["accepted"]) + len(got["shed"])),
        "ack_p50_ms": 1e3 * statistics.median(got["ack"]) if got["ack"] else float("nan"),
        "ack_p99_ms": 1e3 * _percentile(got["ack"], 0.99),
        "server_cpu_fraction": cpu / window,
    }
    for name, values in probes["latencies"].items():
        row[f"{name}_p50_ms"] = 1e3 * statistics.median(values) if values else float("nan")
        row[f"{name}_p99_ms"] = 1e3 * _percentile(values, 0.99)
        row[f"{name}_max_ms"] = 1e3 * max(values, default=float("nan"))
        row[f"{name}_failed"] = probes["failed"][name]
    row["probe_errors"] = probes["errors"]  # the first of each kind
    row["reports_lost"] = len(got["lost"])
    row["lost_errors"] = got["lost"][:3]
    row["rss_mib_start"], row["rss_mib_max"] = (rss[0], max(rss)) if rss else (0.0, 0.0)
    row["loop_lag_p50_ms"] = 1e3 * _percentile(lags, 0.5)
    row["loop_lag_p99_ms"] = 1e3 * _percentile(lags, 0.99)
    row["loop_lag_max_ms"] = 1e3 * max(lags, default=float("nan"))
    if streams is not None:
        row.update(streams=streams, streams_opened=opened, streams_dropped=dropped,
                   **viewed)
    return row


# --- event streams -------------------------------------------------------------------------------
STREAMS_TOKEN = "bench-token-0123456789"
CHURN_INTERVAL = 0.25  # seconds between two policy writes (each a round of decision events)
LAG_TIMER = 0.01  # seconds: the server loop's lag probe


async def _sample_rss(out: list[float]) -> None:
    """The server process's resident memory, MiB, every second."""
    while True:
        with open("/proc/self/status") as f:
            out.extend(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS"))
        await asyncio.sleep(1.0)


async def _sample_lag(out: list[float]) -> None:
    """How late the server's loop runs a 10 ms timer, seconds, every time: the wait a request
    arriving then has before the loop turns to it, free of the client processes' own delays
    (they share the other core)."""
    loop = asyncio.get_running_loop()
    while True:
        due = loop.time() + LAG_TIMER
        await asyncio.sleep(LAG_TIMER)
        out.append(max(0.0, loop.time() - due))


def _counter(server: Any, name: str) -> float:
    for line in server.metrics.render().decode().splitlines():
        series, _, value = line.rpartition(" ")
        if series == name:
            return float(value)
    return float("nan")


def _stream_client(http_port: int, streams: int, core: int, pipe: Any) -> None:
    """Viewer process: ``streams`` /api/events streams read as they come; once all are open,
    says how many, then over the (monotonic) window it is sent writes an override and clears
    it on class-0 every CHURN_INTERVAL (decision churn). Sends bytes read, events seen, writes
    made and their latencies."""
    import aiohttp

    _pin(core)

    async def run() -> dict[str, Any]:
        counts = {"opened": 0, "bytes": 0, "events": 0, "ended": 0}

        async def view() -> None:
            reader, writer = await asyncio.open_connection("127.0.0.1", http_port)
            writer.write(b"GET /api/events HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            head = await reader.readuntil(b"\r\n\r\n")
            counts["opened"] += head.startswith(b"HTTP/1.1 200")
            while chunk := await reader.read(1 << 16):
                counts["bytes"] += len(chunk)
                counts["events"] += chunk.count(b"event: decision")
            counts["ended"] += 1
            writer.close()

        tasks = [asyncio.ensure_future(view()) for _ in range(streams)]
        for _ in range(600):
            if counts["opened"] + counts["ended"] >= streams:
                break
            await asyncio.sleep(0.05)
        pipe.send(counts["opened"])
        while not pipe.poll():
            await asyncio.sleep(0.02)
        start, until = pipe.recv()
        writes: list[float] = []
        url = f"http://127.0.0.1:{http_port}/api/overrides"
        auth = {"Authorization": f"Bearer {STREAMS_TOKEN}"}
        async with aiohttp.ClientSession() as http:
            while time.monotonic() < start:
                await asyncio.sleep(0.01)
            i = 0
            while (t0 := time.monotonic()) < until:
                path, body = ((url, {"override": {"traffic_class": "class-0", "pin_k": 1}})
                              if i % 2 == 0 else (url + "/clear", {"traffic_class": "class-0"}))
                async with http.post(path, json=body, headers=auth) as r:
                    await r.read()
                writes.append(time.monotonic() - t0)
                i += 1
                await asyncio.sleep(max(0.0, CHURN_INTERVAL - (time.monotonic() - t0)))
        for task in tasks:
            task.cancel()
        return {"stream_bytes": counts["bytes"], "stream_decision_events": counts["events"],
                "streams_ended_early": counts["ended"], "writes": len(writes),
                "write_p99_ms": 1e3 * _percentile(writes, 0.99)}

    pipe.send(asyncio.run(run()))


def bench_streams(args: argparse.Namespace) -> dict[str, Any]:
    """``args.engines`` engines reporting once a second, ``args.streams`` dashboard event
    streams (and the control without them) and decision churn, for ``args.seconds``."""
    _pin(0)
    rows = []
    for streams in (0, args.streams):
        print(f"  streams: {streams} event streams, {args.engines} engines, churn ...",
              flush=True)
        row = asyncio.run(_overload_one(args.engines, args.seconds, streams))
        print(f"    health p99 {row['grpc_health_p99_ms']:.1f} ms, /healthz p99 "
              f"{row['http_healthz_p99_ms']:.1f} ms, reports lost {row['reports_lost']}, "
              f"RSS {row['rss_mib_start']:.0f} -> {row['rss_mib_max']:.0f} MiB", flush=True)
        rows.append(row)
    return {"seconds": args.seconds, "engines": args.engines,
            "churn_interval_seconds": CHURN_INTERVAL, "probe_interval_seconds": PROBE_INTERVAL,
            "probe_timeout_seconds": PROBE_TIMEOUT, "rows": rows}


def _streams_md(result: dict[str, Any]) -> str:
    lines = [f"{result['engines']} engines reporting once a second, an override written or "
             f"cleared every {result['churn_interval_seconds']} s, {result['seconds']:.0f} s:", "",
             "| event streams (open / dropped) | server loop lag p50 / p99 / max ms | "
             "gRPC health p50 / p99 / max ms | "
             "/healthz p50 / p99 / max ms | GetPolicy p99 ms | probes failed | reports accepted "
             "/ shed per s | reports lost | decision events delivered | write p99 ms | "
             "server RSS start / max MiB | server CPU |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        failed = r["grpc_health_failed"] + r["get_policy_failed"] + r["http_healthz_failed"]
        lines.append(
            f"| {r['streams']} ({r.get('streams_opened', 0)} / "
            f"{r.get('streams_dropped', 0):.0f}) | {r['loop_lag_p50_ms']:.1f} / "
            f"{r['loop_lag_p99_ms']:.1f} / {r['loop_lag_max_ms']:.0f} | "
            f"{_p50_p99(r, 'grpc_health')} / {r['grpc_health_max_ms']:.0f} | "
            f"{_p50_p99(r, 'http_healthz')} / {r['http_healthz_max_ms']:.0f} | "
            f"{r['get_policy_p99_ms']:.1f} | {failed} | "
            f"{r['accepted_reports_per_second']:.0f} / {r['shed_reports_per_second']:.0f} | "
            f"{r['reports_lost']} | {r.get('stream_decision_events', 0)} | "
            f"{r.get('write_p99_ms', float('nan')):.0f} | "
            f"{r['rss_mib_start']:.0f} / {r['rss_mib_max']:.0f} | "
            f"{r['server_cpu_fraction']:.0%} |")
    return "\n".join(lines)


def bench_overload(args: argparse.Namespace) -> dict[str, Any]:
    _pin(0)
    rows = []
    for n in [0, *args.engine_counts]:
        print(f"  overload: {n} engines reporting once a second ...", flush=True)
        row = asyncio.run(_overload_one(n, args.seconds))
        failed = sum(row[f"{name}_failed"] for name in ("grpc_health", "get_policy",
                                                        "http_healthz"))
        print(f"    accepted {row['accepted_reports_per_second']:.0f}/s, shed "
              f"{row['shed_reports_per_second']:.0f}/s; health p50/p99 "
              f"{row['grpc_health_p50_ms']:.1f}/{row['grpc_health_p99_ms']:.1f} ms, "
              f"GetPolicy p99 {row['get_policy_p99_ms']:.1f} ms, failed probes {failed}",
              flush=True)
        rows.append(row)
    return {"seconds_per_count": args.seconds, "probe_interval_seconds": PROBE_INTERVAL,
            "probe_timeout_seconds": PROBE_TIMEOUT, "rows": rows}


def _overload_md(result: dict[str, Any]) -> str:
    lines = ["| engines (reports/s offered) | accepted reports/s | shed reports/s | "
             "report -> answer p50 / p99 ms | gRPC health p50 / p99 / max ms | "
             "GetPolicy p50 / p99 ms | /healthz p50 / p99 ms | probes failed | server CPU |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        failed = r["grpc_health_failed"] + r["get_policy_failed"] + r["http_healthz_failed"]
        lines.append(
            f"| {r['engines']} | {r['accepted_reports_per_second']:.0f} | "
            f"{r['shed_reports_per_second']:.0f} | {_p50_p99(r, 'ack')} | "
            f"{_p50_p99(r, 'grpc_health')} / {r['grpc_health_max_ms']:.0f} | "
            f"{_p50_p99(r, 'get_policy')} | {_p50_p99(r, 'http_healthz')} | {failed} | "
            f"{r['server_cpu_fraction']:.0%} |")
    return "\n".join(lines)


def _overload_plot(result: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    rows = [r for r in result["rows"] if r["engines"]]
    ns = [r["engines"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    left.plot(ns, ns, "k:", label="offered")
    left.plot(ns, [r["accepted_reports_per_second"] for r in rows], "o-", label="accepted")
    left.plot(ns, [r["shed_reports_per_second"] for r in rows], "s-", label="shed")
    left.set_xlabel("engines, one report a second each")
    left.set_ylabel("reports/s")
    left.legend(fontsize=8)
    left.set_title("one controller core, embedded defaults")
    for name, label in (("grpc_health", "gRPC health"), ("get_policy", "GetPolicy"),
                        ("http_healthz", "/healthz")):
        right.plot(ns, [r[f"{name}_p99_ms"] for r in rows], "o-", label=f"{label} p99")
    _latency_axis(right, 1000, "kubelet probe timeout", "engines")
    save_figure(fig, path)


# --- fleet ---------------------------------------------------------------------------------------
def _fleet_worker(url: str, names: list[str], interval: float, rounds: int, model: str,
                  core: int, out: Any) -> None:
    """Worker process: one FleetSync (with its own core and Redis connection) per name."""
    _pin(core)
    from specpilot.controller.core.controller import ControllerCore
    from specpilot.controller.server.fleet import FleetIdentity, FleetSync
    from specpilot.controller.settings import core_config
    from specpilot.controller.store.redis_store import RedisStore

    async def run() -> int:
        syncs, stores = [], []
        rng = np.random.default_rng(0)
        hello = EngineHello("e", model, "v", (DraftSpec("draft", DraftKind.MODEL, 8, "v"),
                                              DraftSpec("ngram", DraftKind.NGRAM, 8)), 8,
                            hardware="NVIDIA H100 80GB HBM3 tp1 pp1 bfloat16")
        for name in names:
            core_ = ControllerCore(core_config(load_settings(seed=1)), np.random.default_rng(1))
            core_.connect_engine(hello, time.time())
            core_.ingest("e", realistic_report(1, rng), time.time())
            core_.decide(time.time())
            store = RedisStore.from_url(url, timeout_seconds=5.0)
            stores.append(store)
            syncs.append(FleetSync(core_, store, FleetIdentity(name, model), interval, 600.0,
                                   time.time))
        for sync in syncs:  # the first round restores; not measured
            await sync.sync_once()
        out.send("ready")
        out.recv()  # go
        done = 0
        for _ in range(rounds):
            start = time.monotonic()
            await asyncio.gather(*(s.sync_once() for s in syncs))
            done += len(syncs)
            await asyncio.sleep(max(0.0, interval - (time.monotonic() - start)))
        for store in stores:
            await store.close()
        return done

    out.send(asyncio.run(run()))


def _redis_info(cli: Any) -> dict[str, float]:
    stats = {}
    for line in cli("INFO", "all").splitlines():
        if ":" in line:
            k, v = line.split(":", 1)
            stats[k] = v
    calls = sum(int(v.split("calls=")[1].split(",")[0]) for k, v in stats.items()
                if k.startswith("cmdstat_"))
    return {"calls": float(calls), "in": float(stats["total_net_input_bytes"]),
            "out": float(stats["total_net_output_bytes"]),
            # The server's own CPU, in microseconds' resolution (/proc ticks are 10 ms).
            "cpu": float(stats["used_cpu_sys"]) + float(stats["used_cpu_user"])}


def bench_fleet(args: argparse.Namespace) -> dict[str, Any]:
    import tempfile

    from benchmarks.redis_servers import RedisServer

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        redis = RedisServer(Path(tmp))
        redis.start()
        try:
            # Redis's own background work (its cron, the INFO calls here), per second idle:
            # subtracted from every measurement.
            idle0, t_idle = _redis_info(redis.cli), time.monotonic()
            time.sleep(2.0)
            idle_cpu = (_redis_info(redis.cli)["cpu"] - idle0["cpu"]) / (time.monotonic() - t_idle)
            for n in args.sidecars:
                model = f"bench-{n}"
                workers = min(args.workers, n)
                ctx = mp.get_context("spawn")
                pipes, procs = [], []
                for w in range(workers):
                    names = [f"sidecar-{i}" for i in range(w, n, workers)]
                    here, there = ctx.Pipe()
                    p = ctx.Process(target=_fleet_worker, args=(
                        redis.url, names, args.interval, args.rounds, model, w + 1, there))
                    p.start()
                    pipes.append(here)
                    procs.append(p)
                for here in pipes:
                    assert here.recv() == "ready"
                before, t0 = _redis_info(redis.cli), time.monotonic()
                for here in pipes:
                    here.send("go")
                flushes = sum(here.recv() for here in pipes)
                after, t1 = _redis_info(redis.cli), time.monotonic()
                for p in procs:
                    p.join(timeout=30)
                row = {
                    "sidecars": n, "flushes": flushes, "seconds": t1 - t0,
                    "commands_per_flush": (after["calls"] - before["calls"]) / flushes,
                    "bytes_in_per_flush": (after["in"] - before["in"]) / flushes,
                    "bytes_out_per_flush": (after["out"] - before["out"]) / flushes,
                    "redis_cpu_ms_per_flush": 1e3 * max(
                        after["cpu"] - before["cpu"] - idle_cpu * (t1 - t0), 0.0) / flushes,
                }
                print(f"  fleet: {n} sidecars: {row['commands_per_flush']:.1f} commands, "
                      f"{row['bytes_in_per_flush']:.0f} B in, {row['bytes_out_per_flush']:.0f} B "
                      f"out, {row['redis_cpu_ms_per_flush']:.3f} ms redis CPU per flush",
                      flush=True)
                rows.append(row)
        finally:
            redis.stop()
    # Per flush, each sidecar reads every other's record: Redis CPU and egress per flush grow
    # with N, so N sidecars flushing every 5 s cost N (a + b N) / 5 per second. Fit a + b N to
    # each and solve for the N that fills half of one Redis core and half of a 10 GbE link.
    # The CPU fit leaves out fleets under 16 sidecars where there are enough others: their runs
    # are a few dozen flushes, too few for Redis's own background CPU (its cron, the idle
    # connections) to average out of the per-flush figure.
    default_interval, budget, link = 5.0, 0.5, 1.25e9
    fitted = [r for r in rows if r["sidecars"] >= 16]
    fitted = fitted if len(fitted) >= 2 else rows

    def largest(key: str, scale: float, capacity: float) -> tuple[float, float, float]:
        ns = np.array([r["sidecars"] for r in fitted], dtype=float)
        per_flush = np.array([r[key] for r in fitted]) * scale
        b, a = np.polyfit(ns, per_flush, 1) if len(ns) > 1 else (0.0, float(per_flush[0]))
        a, b = max(float(a), 0.0), max(float(b), 0.0)
        target = budget * capacity * default_interval
        n = target / a if b == 0 else (-a + (a * a + 4 * b * target) ** 0.5) / (2 * b)
        return a, b, n

    cpu_a, cpu_b, n_cpu = largest("redis_cpu_ms_per_flush", 1e-3, 1.0)
    out_a, out_b, n_net = largest("bytes_out_per_flush", 1.0, link)
    return {"rows": rows, "interval_seconds": args.interval,
            "fit_cpu_seconds_per_flush": {"a": cpu_a, "b_per_sidecar": cpu_b},
            "fit_bytes_out_per_flush": {"a": out_a, "b_per_sidecar": out_b},
            "budget": budget, "link_bytes_per_second": link,
            "default_interval_seconds": default_interval,
            "fitted_sidecars": [r["sidecars"] for r in fitted],
            "largest_fleet_by_cpu": n_cpu, "largest_fleet_by_network": n_net,
            "largest_fleet": min(n_cpu, n_net)}


def _fleet_md(result: dict[str, Any]) -> str:
    lines = ["| sidecars | commands / flush / sidecar | bytes in / out per flush | "
             "redis CPU per flush |", "|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['sidecars']} | {r['commands_per_flush']:.1f} | "
                     f"{r['bytes_in_per_flush']:,.0f} / {r['bytes_out_per_flush']:,.0f} | "
                     f"{1e3 * r['redis_cpu_ms_per_flush']:.0f} us |")
    cpu, out = result["fit_cpu_seconds_per_flush"], result["fit_bytes_out_per_flush"]
    lines += ["", (
        f"Fits over {', '.join(str(n) for n in result['fitted_sidecars'])} sidecars: "
        f"Redis CPU per flush {1e6 * cpu['a']:.0f} us + {1e6 * cpu['b_per_sidecar']:.2f} us"
        f" x N; bytes out per flush {out['a']:,.0f} + {out['b_per_sidecar']:,.0f} x N. With "
        f"every sidecar flushing every {result['default_interval_seconds']:.0f} s, "
        f"{result['budget']:.0%} of one Redis core carries about "
        f"{result['largest_fleet_by_cpu']:,.0f} sidecars and {result['budget']:.0%} of a "
        f"10 GbE link about {result['largest_fleet_by_network']:,.0f}: one Redis carries about "
        f"{result['largest_fleet']:,.0f} sidecars of one model.")]
    return "\n".join(lines)


def _fleet_plot(result: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    rows = result["rows"]
    ns = [r["sidecars"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    left.plot(ns, [r["redis_cpu_ms_per_flush"] * 1e3 for r in rows], "o-")
    left.set_xlabel("sidecars")
    left.set_ylabel("redis CPU per flush, us")
    right.plot(ns, [r["bytes_out_per_flush"] / 1e3 for r in rows], "o-", label="out")
    right.plot(ns, [r["bytes_in_per_flush"] / 1e3 for r in rows], "s-", label="in")
    right.set_xlabel("sidecars")
    right.set_ylabel("kB per flush per sidecar")
    right.legend()
    save_figure(fig, path)


PARTS: dict[str, tuple[Any, Any, Any]] = {  # part: (bench, markdown, plot or None)
    "controller": (bench_controller, _controller_md, _controller_plot),
    "overload": (bench_overload, _overload_md, _overload_plot),
    "fleet": (bench_fleet, _fleet_md, _fleet_plot),
    "streams": (bench_streams, _streams_md, None),  # two rows: the table reads better
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("part", choices=tuple(PARTS))
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--engines", type=int, default=64)
    parser.add_argument("--streams", type=int, default=1000,
                        help="streams: dashboard event streams (beside the control with none)")
    parser.add_argument("--seconds", type=float, default=6.0,
                        help="per offered rate (controller) or engine count (overload)")
    parser.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")],
                        default=list(OFFERED_RATES),
                        help="offered reports/s with per-request-K engines, comma-separated")
    parser.add_argument("--batch-wide-rates", type=lambda s: [float(x) for x in s.split(",")],
                        default=[64.0, 256.0], help="the same with batch-wide engines")
    parser.add_argument("--engine-counts", type=lambda s: [int(x) for x in s.split(",")],
                        default=list(ENGINE_COUNTS), help="overload: engines, comma-separated")
    parser.add_argument("--sidecars", type=lambda s: [int(x) for x in s.split(",")],
                        default=[4, 8, 16, 32, 64])
    parser.add_argument("--workers", type=int, default=4, help="fleet worker processes")
    parser.add_argument("--interval", type=float, default=0.5, help="fleet flush interval, s")
    parser.add_argument("--rounds", type=int, default=20, help="measured flushes per sidecar")
    args = parser.parse_args()
    print(f"specpilot scale benchmark: {args.part}", flush=True)
    bench, markdown, plot = PARTS[args.part]
    result = bench(args)
    result["machine"] = f"{platform.machine()} cpus={os.cpu_count()}"
    result["python"] = platform.python_version()
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"scale-{args.part}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    md = markdown(result)
    stem.with_suffix(".md").write_text(md + "\n")
    print(md)
    if plot is not None and plots_available("scale"):
        plot(result, stem.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
