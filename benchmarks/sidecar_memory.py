"""The controller's memory at every documented limit, for the Helm chart's requests and limits.

    .venv/bin/python benchmarks/sidecar_memory.py [--cases idle,classes-max,...] [--out DIR]

Each case is a fresh `specpilot serve` child process (benchmarks.faults.ControllerProcess,
settings by ``--set``) driven to its limit over the real gRPC and HTTP interfaces from this
process (grpc.aio; engine streams leave the policy fan-out unparsed: benchmarks.scale's
EngineStream). The child's resident set comes from /proc: VmRSS after the case's work (its
streams still open, its state held, the loop settled) and VmHWM, the peak over the process's
life; also its CPU share at that state. Cases (``cases``):

- idle: the embedded defaults.
- classes-default, classes-max: max_classes at its default and its bound, filled by one engine
  of MAX_DRAFTS drafts reporting every class x every draft x K 1..max_k (reports of at most
  max_report_bytes), then read whole by GetPolicy and /api/dashboard.
- drafts: a hello of MAX_DRAFTS drafts, every id MAX_ID_CHARS long and MAX_PROFILE_POINTS
  profile points, each draft reported for every class at every K.
- reports, reports-max: reports of max_report_bytes (its default, then its bound) back to back,
  the resident set sampled as they go.
- log-default, log-max: decision_log_size at its default and its bound, filled by pinning and
  clearing K through the policy API, then read whole (a WatchDecisions replay, /api/decisions).
- overrides: an override on every class of max_classes (declared) with a note of
  MAX_NOTE_CHARS, written until the audit log (AUDIT_LOG_SIZE) is full.
- engines: 500 engines, maximal hellos (as drafts), one report each, one channel each.
- watchers: WatchDecisions streams that never read, each overfilled past STREAM_QUEUE_LIMIT;
  the first is read at last (RESOURCE_EXHAUSTED).
- distinct-drafts: engines whose model drafts are named differently (no limit bounds their
  union, and the cost model grows with it).
- all: everything at once (fewer engines: there each hello costs a ~1-2 s decide round).

Prints progress per case; writes sidecar_memory.json and sidecar_memory.md under --out
(docs/benchmarks.md and docs/reliability.md quote the table), against the chart's controller
resources (deploy/helm/specpilot/values.yaml). A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import yaml

from benchmarks.faults import ControllerProcess
from benchmarks.scale import EngineStream
from specpilot.contract.validation import (
    MAX_CLASS_NAME_LENGTH,
    MAX_DRAFTS,
    MAX_HARDWARE_CHARS,
    MAX_ID_CHARS,
    MAX_PROFILE_POINTS,
)
from specpilot.controller.core.overrides import MAX_NOTE_CHARS
from specpilot.controller.server.app import STREAM_QUEUE_LIMIT
from specpilot.controller.server.policy_writes import AUDIT_LOG_SIZE
from specpilot.controller.server.stubs import AsyncPolicyStub, async_policy_stub
from specpilot.controller.settings import SETTINGS
from specpilot.v1 import common_pb2, engine_pb2, policy_pb2

ROOT = Path(__file__).resolve().parent.parent

TOKEN = "memory-bench-token"
AUTH = (("authorization", f"Bearer {TOKEN}"),)
WATCH = f"/{policy_pb2.DESCRIPTOR.services_by_name['PolicyService'].full_name}/WatchDecisions"

MAX_CLASSES_DEFAULT: int = SETTINGS["max_classes"].default
MAX_CLASSES_BOUND = int(SETTINGS["max_classes"].constraints.le or 256)
LOG_DEFAULT: int = SETTINGS["decision_log_size"].default
LOG_BOUND = int(SETTINGS["decision_log_size"].constraints.le or 10_000)
MAX_REPORT_BYTES: int = SETTINGS["max_report_bytes"].default
REPORT_BYTES_BOUND = int(SETTINGS["max_report_bytes"].constraints.le or 4 << 20)
MAX_K: int = SETTINGS["max_k"].default  # the controller's; engines announce as much
BUCKET_BOUNDS: tuple[int, ...] = SETTINGS["batch_bucket_upper_bounds"].default
BATCH = 256  # the engines' max_batch_size
REPORT_INTERVAL: float = SETTINGS["report_interval_seconds"].default
# What the largest reports cover, seconds: long enough for all they count at the profile's step
# rate (the controller refuses a report counting more than its engine runs in its interval).
REPORT_SPAN = 600.0
WATCHERS_MAX: int = SETTINGS["max_watch_streams"].default
SETTLE_SECONDS = 2.0  # after a case's work: the CPU share over this long
VALUES = ROOT / "deploy" / "helm" / "specpilot" / "values.yaml"


def _mib(quantity: str) -> float:
    """A Kubernetes memory quantity (128Mi, 1Gi) in MiB."""
    units = {"Ki": 1 / 1024, "Mi": 1.0, "Gi": 1024.0}
    for unit, scale in units.items():
        if quantity.endswith(unit):
            return float(quantity[: -len(unit)]) * scale
    return float(quantity) / 2**20


def chart_resources() -> tuple[float, float]:
    """The chart's controller memory request and limit, MiB."""
    res = yaml.safe_load(VALUES.read_text())["controller"]["resources"]
    return _mib(str(res["requests"]["memory"])), _mib(str(res["limits"]["memory"]))


_started = [time.monotonic()]  # when the current case began


def _progress(msg: str) -> None:
    print(f"  {time.monotonic() - _started[0]:5.1f} s  {msg}", flush=True)


def _long(prefix: str, n: int) -> str:
    """``prefix`` padded to exactly ``n`` characters (the prefix keeps names distinct)."""
    return (prefix + "-" + "x" * n)[:n]


def _class_names(n: int, long: bool) -> list[str]:
    return [_long(f"class-{i:04d}", MAX_CLASS_NAME_LENGTH) if long else f"class-{i:04d}"
            for i in range(n)]


def _draft_names(n: int, long: bool, prefix: str = "draft") -> list[str]:
    return [_long(f"{prefix}-{j:02d}", MAX_ID_CHARS) if long else f"{prefix}-{j:02d}"
            for j in range(n)]


# --- engine streams -----------------------------------------------------------------------------
def hello(engine_id: str, drafts: list[str], long_ids: bool = False,
          profile: bool = False) -> bytes:
    """A ConnectRequest hello (serialized): model drafts at the controller's max K, every id
    MAX_ID_CHARS long with ``long_ids``, MAX_PROFILE_POINTS start-up profile points with
    ``profile``."""
    def pad(s: str) -> str:
        return _long(s, MAX_ID_CHARS) if long_ids else s

    points = [engine_pb2.StepProfile(
        batch_size=b, verified_tokens=b * (1 + p), draft=drafts[i % len(drafts)] if p else "",
        draft_passes=p, seconds=0.01 + 2e-5 * b * (1 + p) + 1e-3 * p)
        for i in range(MAX_PROFILE_POINTS if profile else 0)
        for b, p in [(1 + (i * 7) % BATCH, i % (MAX_K + 1))]]
    msg = engine_pb2.EngineHello(
        engine_id=pad(engine_id), model=pad("bench-model"), target_vocab_hash=pad("vocab"),
        drafts=[engine_pb2.DraftInfo(name=d, kind=common_pb2.DRAFT_KIND_MODEL,
                                     vocab_hash=pad("vocab"), max_k=MAX_K) for d in drafts],
        max_k=MAX_K, capabilities=engine_pb2.EngineCapabilities(per_request_k=True),
        engine_version=pad("engine-version"), plugin_version=pad("plugin-version"),
        max_batch_size=BATCH, step_profile=points,
        hardware=_long("bench-hardware", MAX_HARDWARE_CHARS) if long_ids else "cpu")
    return engine_pb2.ConnectRequest(hello=msg).SerializeToString()


def acceptance(classes: Iterable[str], drafts: list[str], ks: Iterable[int]
               ) -> list[engine_pb2.AcceptanceCounts]:
    """One histogram per (class, draft, K): every step of it, with acceptance that differs by
    class."""
    ks = list(ks)
    out = []
    for i, c in enumerate(classes):
        for d in drafts:
            for k in ks:
                out.append(engine_pb2.AcceptanceCounts(
                    traffic_class=c, draft=d, k=k,
                    steps_by_accepted=[5 + (i + a) % 11 for a in range(k + 1)]))
    return out


def timings(drafts: list[str]) -> list[engine_pb2.StepTiming]:
    """One step-timing group per (bucket, draft): plausible shapes and times."""
    out = []
    for b, bound in enumerate((*BUCKET_BOUNDS, 2 * BUCKET_BOUNDS[-1])):
        size = min(bound, BATCH)
        for j, d in enumerate(drafts):
            k = 1 + j % MAX_K
            steps = 20
            out.append(engine_pb2.StepTiming(
                batch_bucket=b, draft=d, k=k, steps=steps, sum_batch_size=steps * size,
                sum_verified_tokens=steps * size * (1 + k // 2), sum_draft_tokens=steps * size * k,
                sum_step_seconds=steps * (0.015 + 2e-5 * size * (1 + k) + 1e-3 * k)))
    return out


def reports(records: list[engine_pb2.AcceptanceCounts], max_bytes: int,
            extra: list[engine_pb2.StepTiming] | None = None) -> list[engine_pb2.EngineReport]:
    """``records`` split into reports of at most ``max_bytes`` (less 1 KiB of room); the first
    carries ``extra`` step timings."""
    budget = max_bytes - 1024
    out: list[engine_pb2.EngineReport] = []
    current = engine_pb2.EngineReport(interval_seconds=REPORT_SPAN, running_requests=BATCH // 4,
                                      step_timings=extra or [])
    size = current.ByteSize()
    for rec in records:
        n = rec.ByteSize() + 4  # tag and length
        if size + n > budget and current.acceptance:
            out.append(current)
            current = engine_pb2.EngineReport(interval_seconds=REPORT_SPAN,
                                              running_requests=BATCH // 4)
            size = current.ByteSize()
        current.acceptance.append(rec)
        size += n
    out.append(current)
    assert all(r.ByteSize() <= max_bytes for r in out)
    return out


def full_report(classes: list[str], drafts: list[str], max_bytes: int
                ) -> engine_pb2.EngineReport:
    """One report of just under ``max_bytes``: histograms over ``classes`` x ``drafts`` x K,
    repeated as needed (each is a valid record: a report may name a class twice)."""
    base = acceptance(classes, drafts, range(1, MAX_K + 1))
    report = engine_pb2.EngineReport(interval_seconds=REPORT_SPAN, running_requests=BATCH // 4,
                                     step_timings=timings(drafts))
    size, i = report.ByteSize(), 0
    while True:
        rec = base[i % len(base)]
        n = rec.ByteSize() + 4
        if size + n > max_bytes - 64:
            break
        report.acceptance.append(rec)
        size, i = size + n, i + 1
    while report.ByteSize() > max_bytes:
        report.acceptance.pop()
    return report


async def connect_engines(target: str, hellos: list[bytes], concurrency: int = 50,
                          backoff: bool = False) -> list[EngineStream]:
    """Engines of ``hellos``, each on its own channel, connected ``concurrency`` at a time. A shed
    report is sent again after the pause its answer names or, with ``backoff``, the plugin's
    (EngineStream)."""
    engines = [EngineStream(target, h, backoff=backoff, interval=REPORT_INTERVAL) for h in hellos]
    for i in range(0, len(engines), concurrency):
        await asyncio.gather(*(e.connect() for e in engines[i:i + concurrency]))
    return engines


async def stream_all(engine: EngineStream, batch: list[engine_pb2.EngineReport],
                     label: str) -> None:
    for i, r in enumerate(batch):
        await engine.report(r)
        if len(batch) >= 10 and (i + 1) % max(len(batch) // 4, 1) == 0:
            _progress(f"{label}: {i + 1}/{len(batch)} reports taken ({engine.shed} shed)")


# --- the policy API and the measurement ---------------------------------------------------------
@dataclass
class Client:
    """What a case drives: the controller, a policy stub with the token, an HTTP session; and
    what it found (``notes``, ``after``)."""

    serve: ControllerProcess
    policy: AsyncPolicyStub
    http: aiohttp.ClientSession
    notes: dict[str, Any] = field(default_factory=dict)
    rss_after: float | None = None

    async def after(self) -> None:
        """The case's work is done and its state held: let the loop settle, read the RSS and
        the controller's CPU share over the next seconds (its periodic rounds at this state)."""
        await asyncio.sleep(1.0)
        cpu, start = self.serve.cpu_seconds(), time.monotonic()
        await asyncio.sleep(SETTLE_SECONDS)
        self.serve.ensure_alive()
        self.rss_after, hwm = self.serve.memory()
        self.notes.update(peak_before_reads_mib=round(hwm, 1), cpu_share_settled=round(
            (self.serve.cpu_seconds() - cpu) / (time.monotonic() - start), 2))

    async def log_total(self) -> int:
        async with self.http.get(self.serve.http_url + "/api/decisions?limit=0") as r:
            return int((await r.json())["total"])

    async def class_names(self) -> list[str]:
        resp = await self.policy.GetPolicy(policy_pb2.GetPolicyRequest())
        return [c.traffic_class for c in resp.classes]

    async def pin(self, traffic_class: str, k: int, note: str = "memory bench") -> None:
        await self.policy.SetOverride(policy_pb2.SetOverrideRequest(override=policy_pb2.Override(
            traffic_class=traffic_class, pin_k=k, note=note)), metadata=AUTH)

    async def clear(self, traffic_class: str) -> None:
        await self.policy.ClearOverride(policy_pb2.ClearOverrideRequest(
            traffic_class=traffic_class), metadata=AUTH)

    async def fill_log(self, size: int) -> int:
        """Pin K on every class ("*"), cycling K and clearing the pin now and then, until the
        log holds ``size`` decisions (a write moves every class's decision in every bucket).
        Returns the writes made."""
        writes, shown = 0, time.monotonic()
        while (total := await self.log_total()) < size:
            for _ in range(8):
                if writes % 5 == 4:
                    await self.clear("*")
                else:
                    await self.pin("*", 1 + writes % 5)
                writes += 1
            if time.monotonic() - shown > 5:
                shown = time.monotonic()
                _progress(f"decision log: {total:,}/{size:,} after {writes} writes")
        return writes

    async def read_log(self, watch: bool = True, text: bool = True) -> None:
        """The whole log as a WatchDecisions replay read to its end (with ``watch``), then over
        HTTP (/api/decisions, no limit), then (with ``text``) a page of LOG_DEFAULT entries with
        their plain-language lines (?text=1: ~2 ms of the loop per entry, so not the whole
        log)."""
        if watch:
            total, replayed = await self.log_total(), 0
            start = time.monotonic()
            call = self.policy.WatchDecisions(policy_pb2.WatchDecisionsRequest())
            async for _ in call:
                replayed += 1
                if replayed >= total:
                    break
            call.cancel()
            self.notes.update(watch_replayed=replayed,
                              watch_replay_seconds=round(time.monotonic() - start, 1),
                              hwm_after_watch_replay_mib=round(self.serve.memory()[1], 1))
        pages = [("api_decisions", ""), ("api_decisions_text", f"?text=1&limit={LOG_DEFAULT}")]
        for key, query in pages[:2 if text else 1]:
            start = time.monotonic()
            async with self.http.get(self.serve.http_url + "/api/decisions" + query) as r:
                self.notes[f"{key}_bytes"] = len(await r.read())
            self.notes.update({f"{key}_seconds": round(time.monotonic() - start, 1),
                               f"hwm_after_{key}_mib": round(self.serve.memory()[1], 1)})


# --- cases --------------------------------------------------------------------------------------
Work = Callable[[Client], Awaitable[None]]


@dataclass(frozen=True)
class Case:
    name: str
    limit: str
    value: str
    settings: dict[str, object]
    work: Work


async def _idle(c: Client) -> None:
    await c.after()


async def _filler(c: Client, n_classes: int, drafts: list[str], label: str,
                  long_ids: bool = False) -> EngineStream:
    """One engine reporting ``n_classes`` classes x every draft x every K, in as many reports
    of max_report_bytes as that takes (the first with a step-timing group per bucket and
    draft); it stays connected."""
    engine = (await connect_engines(c.serve.grpc_target, [
        hello("filler", drafts, long_ids=long_ids, profile=long_ids)]))[0]
    records = acceptance(_class_names(n_classes, True), drafts, range(1, MAX_K + 1))
    batch = reports(records, MAX_REPORT_BYTES, timings(drafts))
    _progress(f"{label}: {len(records):,} records in {len(batch)} reports")
    start = time.monotonic()
    await stream_all(engine, batch, label)
    c.notes.update(records=len(records), reports=len(batch), shed=engine.shed)
    _progress(f"{label}: taken in {time.monotonic() - start:.1f} s ({engine.shed} shed)")
    return engine


def _classes(n: int) -> Work:
    async def work(c: Client) -> None:
        engine = await _filler(c, n, _draft_names(MAX_DRAFTS, False), f"{n} classes")
        await c.after()
        # Then the state read whole once, by the policy API and the dashboard.
        start = time.monotonic()
        resp = await c.policy.GetPolicy(policy_pb2.GetPolicyRequest())
        c.notes.update(classes_tracked=len(resp.classes), get_policy_bytes=resp.ByteSize(),
                       get_policy_seconds=round(time.monotonic() - start, 2))
        start = time.monotonic()
        async with c.http.get(c.serve.http_url + "/api/dashboard") as r:
            c.notes["dashboard_bytes"] = len(await r.read())
        c.notes["dashboard_seconds"] = round(time.monotonic() - start, 2)
        _progress(f"{n} classes: GetPolicy {c.notes['get_policy_bytes']:,} bytes in "
                  f"{c.notes['get_policy_seconds']} s, /api/dashboard "
                  f"{c.notes['dashboard_bytes']:,} bytes in {c.notes['dashboard_seconds']} s")
        await engine.close()
    return work


async def _drafts(c: Client) -> None:
    engine = await _filler(c, MAX_CLASSES_DEFAULT, _draft_names(MAX_DRAFTS, True), "drafts",
                           long_ids=True)
    await c.after()
    await engine.close()


def _reports(n: int, size: int) -> Work:
    async def work(c: Client) -> None:
        drafts = _draft_names(MAX_DRAFTS, False)
        engine = (await connect_engines(c.serve.grpc_target, [hello("filler", drafts)]))[0]
        # Four times more class names than slots: the rest fold into "other".
        report = full_report(_class_names(4 * MAX_CLASSES_DEFAULT, True), drafts, size)
        c.notes.update(report_bytes=report.ByteSize(), records=len(report.acceptance))
        series, start = [], time.monotonic()
        for i in range(n):
            await engine.report(report)
            if (i + 1) % max(n // 5, 1) == 0:
                rss, hwm = c.serve.memory()
                series.append({"reports": i + 1, "rss_mib": round(rss, 1),
                               "hwm_mib": round(hwm, 1)})
                _progress(f"reports: {i + 1}/{n} of {report.ByteSize():,} bytes taken in "
                          f"{time.monotonic() - start:.1f} s ({engine.shed} shed), RSS "
                          f"{rss:.0f} MiB, peak {hwm:.0f} MiB")
        c.notes.update(reports=n, shed=engine.shed, series=series)
        await c.after()
        await engine.close()
    return work


async def _log_engine(c: Client, n_classes: int = MAX_CLASSES_DEFAULT) -> EngineStream:
    """An engine that reported ``n_classes`` classes once (a few fold into "other")."""
    engine = (await connect_engines(c.serve.grpc_target, [hello("filler", ["draft"])]))[0]
    await engine.report(engine_pb2.EngineReport(
        interval_seconds=REPORT_SPAN, running_requests=16,
        acceptance=acceptance(_class_names(n_classes, True), ["draft"], [4]),
        step_timings=timings(["draft"])))
    return engine


def _log(size: int) -> Work:
    async def work(c: Client) -> None:
        engine = await _log_engine(c)
        start = time.monotonic()
        c.notes["writes"] = await c.fill_log(size)
        c.notes["log_entries"] = await c.log_total()
        _progress(f"decision log: {c.notes['log_entries']:,} after {c.notes['writes']} writes "
                  f"in {time.monotonic() - start:.1f} s")
        await c.after()
        await c.read_log()
        n = c.notes
        _progress(f"decision log read whole: WatchDecisions replayed {n['watch_replayed']:,} in "
                  f"{n['watch_replay_seconds']} s (peak {n['hwm_after_watch_replay_mib']:.0f} "
                  f"MiB), /api/decisions {n['api_decisions_bytes']:,} bytes in "
                  f"{n['api_decisions_seconds']} s (peak {n['hwm_after_api_decisions_mib']:.0f} "
                  f"MiB), {LOG_DEFAULT:,} with text {n['api_decisions_text_bytes']:,} bytes in "
                  f"{n['api_decisions_text_seconds']} s (peak "
                  f"{n['hwm_after_api_decisions_text_mib']:.0f} MiB)")
        await engine.close()
    return work


DECLARED = _class_names(MAX_CLASSES_BOUND - 2, True)  # every slot but "default" and "other"


async def _override_every_class(c: Client, rounds: int) -> None:
    """``rounds`` times a pin on every declared class and on "*", each with a note of
    MAX_NOTE_CHARS: the audit log (AUDIT_LOG_SIZE entries) fills too."""
    note = "n" * MAX_NOTE_CHARS
    for r in range(rounds):
        for i, name in enumerate(DECLARED):
            await c.pin(name, 1 + (r + i) % MAX_K, note)
        await c.pin("*", 1 + r % MAX_K, note)
    c.notes.update(overrides=len(DECLARED) + 1, override_writes=rounds * (len(DECLARED) + 1))
    _progress(f"overrides: {len(DECLARED) + 1} classes, {rounds} rounds of "
              f"{MAX_NOTE_CHARS}-character notes")


async def _overrides(c: Client) -> None:
    # The classes are declared and overridden before the engine reports them: the state is the
    # same as overriding them after, and far quicker to write (each write runs a decide round,
    # 0.1-0.2 s at 256 reported classes).
    await _override_every_class(c, -(-AUDIT_LOG_SIZE // (len(DECLARED) + 1)))
    engine = await _filler(c, MAX_CLASSES_BOUND, ["draft"], "overrides")
    await c.after()
    await engine.close()


def _engine_report(traffic_class: str, draft: str) -> bytes:
    """An interval of one class on one draft at the controller's max K, serialized. (Small: a
    report costs the decide round it prompts, ~0.1 s when it moves 16 classes x 16 drafts, and
    500 such would take minutes; the engines' memory is their hellos and streams.)"""
    return engine_pb2.ConnectRequest(report=engine_pb2.EngineReport(
        sequence=1, interval_seconds=1.0, running_requests=BATCH // 4,
        acceptance=acceptance([traffic_class], [draft], [MAX_K]))).SerializeToString()


def fleet_payloads(n: int, drafts: list[str]) -> list[tuple[bytes, bytes]]:
    """(hello, report) of ``n`` engines: each hello maximal (``drafts``, ids of MAX_ID_CHARS, a
    full start-up profile), each report one record (made before any stream opens: building them
    blocks this process's loop for seconds)."""
    classes = _class_names(MAX_CLASSES_DEFAULT - 2, True)
    return [(hello(f"engine-{i:04d}", drafts, long_ids=True, profile=True),
             _engine_report(classes[i % len(classes)], drafts[i % len(drafts)]))
            for i in range(n)]


async def _many_engines(c: Client, payloads: list[tuple[bytes, bytes]]) -> list[EngineStream]:
    """The engines of ``payloads`` connected, one report each taken; they stay connected."""
    c.notes.update(engines=len(payloads), hello_bytes=len(payloads[0][0]),
                   engine_report_bytes=len(payloads[0][1]))
    start = time.monotonic()
    engines = await connect_engines(c.serve.grpc_target, [h for h, _ in payloads], backoff=True)
    _progress(f"engines: {len(engines)} connected in {time.monotonic() - start:.1f} s")
    await asyncio.gather(*(e.send(r) for e, (_, r) in zip(engines, payloads, strict=True)))
    c.notes["engine_reports_shed"] = sum(e.shed for e in engines)
    _progress(f"engines: one report each taken by {time.monotonic() - start:.1f} s "
              f"({c.notes['engine_reports_shed']} shed on the way)")
    return engines


async def _close_all(engines: list[EngineStream]) -> None:
    await asyncio.gather(*(e.close() for e in engines))


def _engines(n: int) -> Work:
    async def work(c: Client) -> None:
        engines = await _many_engines(c, fleet_payloads(n, _draft_names(MAX_DRAFTS, True)))
        await c.after()
        await _close_all(engines)
    return work


class Watchers:
    """WatchDecisions streams, each on its own channel, that never read."""

    def __init__(self, target: str, n: int) -> None:
        self._channels = [grpc.aio.insecure_channel(target) for _ in range(n)]
        self.calls = [ch.unary_stream(
            WATCH, request_serializer=policy_pb2.WatchDecisionsRequest.SerializeToString,
            response_deserializer=None)(policy_pb2.WatchDecisionsRequest())
            for ch in self._channels]

    async def opened(self) -> None:
        """Every stream answered (its replay began: the server holds its watcher)."""
        await asyncio.gather(*(asyncio.wait_for(call.initial_metadata(), 60)
                               for call in self.calls))

    async def read_first(self) -> dict[str, Any]:
        """Read the first stream to its end: what a slow reader gets when it reads at last."""
        got, code, details = 0, "OK", ""
        try:
            async for _ in self.calls[0]:
                got += 1
        except grpc.aio.AioRpcError as exc:
            code, details = exc.code().name, exc.details() or ""
        return {"messages": got, "code": code, "details": details}

    async def close(self) -> None:
        for call in self.calls:
            call.cancel()
        await asyncio.gather(*(ch.close(None) for ch in self._channels))


async def _overfill(c: Client, watchers: Watchers, log_size: int) -> None:
    """Decisions enough to overfill each watcher's queue past the log's replay."""
    per_write = len(await c.class_names()) * (len(BUCKET_BOUNDS) + 1)
    writes = -(-(min(log_size, await c.log_total()) + STREAM_QUEUE_LIMIT * 5 // 4) // per_write)
    _progress(f"watchers: {len(watchers.calls)} open, none reading; {writes} writes of "
              f"~{per_write} decisions each")
    for i in range(writes):
        await c.pin("*", 1 + i % 4)
    c.notes["watch_writes"] = writes


def _watchers(n: int) -> Work:
    async def work(c: Client) -> None:
        engine = await _log_engine(c)
        watchers = Watchers(c.serve.grpc_target, n)
        await watchers.opened()
        await _overfill(c, watchers, LOG_DEFAULT)
        c.notes["watchers"] = n
        await c.after()
        c.notes["first_watcher"] = await watchers.read_first()
        _progress(f"watchers: the first, read at last: {c.notes['first_watcher']}")
        await watchers.close()
        await engine.close()
    return work


def _distinct_drafts(n: int) -> Work:
    """Engines coming and going, each under MAX_DRAFTS model-draft names of its own (an
    upgrade, or a client churning names): two connected at a time, the older leaving as the
    next connects."""
    async def work(c: Client) -> None:
        engines: list[EngineStream] = []
        for i in range(n):
            drafts = _draft_names(MAX_DRAFTS, False, prefix=f"e{i:02d}-draft")
            engines += await connect_engines(c.serve.grpc_target, [hello(f"engine-{i}", drafts)])
            if len(engines) > 2:
                await engines.pop(0).close()
            rss, hwm = c.serve.memory()
            _progress(f"distinct drafts: {(i + 1) * MAX_DRAFTS} model-draft names so far, RSS "
                      f"{rss:.0f} MiB, peak {hwm:.0f} MiB")
        c.notes.update(engines=n, model_drafts=n * MAX_DRAFTS)
        await c.after()
        await _close_all(engines)
    return work


def _everything(engines: int, watchers: int, log_size: int, full_reports: int) -> Work:
    async def work(c: Client) -> None:
        # A full decide round at 256 classes x 16 drafts takes ~0.7 s of the loop, and every
        # hello and every policy write runs one: the state is built in the order that keeps
        # those rounds few. Everything the client sends is made first.
        drafts = _draft_names(MAX_DRAFTS, True)
        fleet_msgs = fleet_payloads(engines, drafts)
        filler_hello = hello("filler", drafts, long_ids=True, profile=True)
        filler_batch = reports(acceptance(_class_names(MAX_CLASSES_BOUND, True), drafts,
                                          range(1, MAX_K + 1)), MAX_REPORT_BYTES,
                               timings(drafts))
        full = full_report(DECLARED, drafts, MAX_REPORT_BYTES)
        # Overrides first, with no engine connected: each write runs a decide round, cheap
        # then.
        await _override_every_class(c, -(-AUDIT_LOG_SIZE // (len(DECLARED) + 1)))
        # Watchers on an empty log: the next round's decisions overflow every queue at once.
        watching = Watchers(c.serve.grpc_target, watchers)
        await asyncio.sleep(1.0)
        # The decision log, filled by an engine of one draft coming and going, its draft named
        # anew each time (of two names): every class's pinned K then runs on another draft,
        # 254 x 9 new decisions per visit.
        cycles = 0
        while await c.log_total() < log_size:
            logger = (await connect_engines(c.serve.grpc_target, [
                hello("logger", [f"logger-draft-{cycles % 2}"])]))[0]
            await logger.close()
            cycles += 1
        c.notes["log_cycles"] = cycles
        _progress(f"all: decision log full ({log_size:,}) after {cycles} engine visits; "
                  f"{watchers} watchers not reading")
        filler = (await connect_engines(c.serve.grpc_target, [filler_hello]))[0]
        await stream_all(filler, filler_batch, "all: classes")
        _progress(f"all: {MAX_CLASSES_BOUND} classes x {MAX_DRAFTS} drafts x K reported in "
                  f"{len(filler_batch)} reports ({filler.shed} shed)")
        fleet = await _many_engines(c, fleet_msgs)
        for _ in range(full_reports):
            await filler.report(full)
        _progress(f"all: {full_reports} more reports of {full.ByteSize():,} bytes taken "
                  f"({filler.shed} shed in all)")
        c.notes.update(watchers=watchers, full_reports=full_reports)
        await c.after()
        # The loop is saturated here (the periodic rounds of 256 classes x 16 drafts): reads
        # crawl, so only the one that makes the peak; a replay streams (no peak) and the
        # watchers' fate is case watchers'.
        await c.read_log(watch=False, text=False)
        _progress(f"all: log read whole (peak {c.notes['hwm_after_api_decisions_mib']:.0f} "
                  "MiB)")
        await watching.close()
        await _close_all([filler, *fleet])
    return work


def cases(args: argparse.Namespace) -> list[Case]:
    big_log = args.log_size
    declared = {"max_classes": MAX_CLASSES_BOUND, "declared_classes": DECLARED}
    return [
        Case("idle", "none: embedded defaults", "-", {}, _idle),
        Case("classes-default", "max_classes (x MAX_DRAFTS drafts x K 1..8)",
             f"{MAX_CLASSES_DEFAULT} (default)", {}, _classes(MAX_CLASSES_DEFAULT)),
        Case("classes-max", "max_classes (x MAX_DRAFTS drafts x K 1..8)",
             f"{MAX_CLASSES_BOUND} (its bound)", {"max_classes": MAX_CLASSES_BOUND},
             _classes(MAX_CLASSES_BOUND)),
        Case("drafts", "hello.drafts (MAX_DRAFTS), ids MAX_ID_CHARS",
             f"{MAX_DRAFTS} drafts at K {MAX_K}, {MAX_ID_CHARS}-char ids, "
             f"{MAX_PROFILE_POINTS} profile points", {}, _drafts),
        # Every report applied (report_budget_share 1): shedding half of them, as the default
        # 0.5 does when reports come back to back, doubles the time and changes no state.
        Case("reports", "max_report_bytes", f"{MAX_REPORT_BYTES >> 20} MiB (default): "
             f"{args.reports} such reports back to back", {"report_budget_share": 1.0},
             _reports(args.reports, MAX_REPORT_BYTES)),
        Case("reports-max", "max_report_bytes", f"{REPORT_BYTES_BOUND >> 20} MiB (its bound): "
             f"{args.max_reports} such reports back to back",
             {"report_budget_share": 1.0, "max_report_bytes": REPORT_BYTES_BOUND},
             _reports(args.max_reports, REPORT_BYTES_BOUND)),
        Case("log-default", "decision_log_size", f"{LOG_DEFAULT:,} (default), full, read whole",
             {}, _log(LOG_DEFAULT)),
        Case("log-max", "decision_log_size", f"{big_log:,}"
             f"{' (its bound)' if big_log == LOG_BOUND else ''}, full, read whole",
             {"decision_log_size": big_log}, _log(big_log)),
        Case("overrides", "override notes (MAX_NOTE_CHARS) on every class; audit log",
             f"{MAX_CLASSES_BOUND} classes, {MAX_NOTE_CHARS}-char notes, "
             f"{AUDIT_LOG_SIZE:,}+ writes", declared, _overrides),
        Case("engines", "engines connected (maximal hellos)",
             f"{args.engines} engines x {MAX_DRAFTS} drafts, {MAX_ID_CHARS}-char ids, "
             f"{MAX_PROFILE_POINTS} profile points, one report each", {},
             _engines(args.engines)),
        Case("watchers", "WatchDecisions streams that never read (queue limit)",
             f"{args.watchers} streams, {STREAM_QUEUE_LIMIT:,} queued each",
             {"max_watch_streams": max(args.watchers, WATCHERS_MAX)},
             _watchers(args.watchers)),
        Case("distinct-drafts", "model drafts across engines (max_model_drafts)",
             f"{args.distinct_engines} engines x {MAX_DRAFTS} distinct model drafts, two "
             "connected at a time", {},
             _distinct_drafts(args.distinct_engines)),
        Case("all", "everything at once",
             f"{MAX_CLASSES_BOUND} classes x {MAX_DRAFTS} drafts, log {big_log:,}, "
             f"{args.all_engines} engines, {args.all_watchers} watchers, notes, "
             f"{args.all_reports} more 1 MiB reports",
             {**declared, "decision_log_size": big_log, "report_budget_share": 1.0,
              "max_watch_streams": max(args.all_watchers, WATCHERS_MAX)},
             _everything(args.all_engines, args.all_watchers, big_log, args.all_reports)),
    ]


async def _run_case(case: Case, serve: ControllerProcess) -> Client:
    async with aiohttp.ClientSession() as http, grpc.aio.insecure_channel(
            serve.grpc_target) as ch:
        client = Client(serve, async_policy_stub(ch), http)
        await case.work(client)
        return client


def run_case(case: Case) -> dict[str, Any]:
    print(f"[{case.name}] {case.limit}: {case.value}", flush=True)
    start = _started[0] = time.monotonic()
    serve = ControllerProcess(settings=case.settings, token=TOKEN, log_level="warning")
    try:
        time.sleep(1.0)
        started = serve.memory()[0]
        try:
            client = asyncio.run(_run_case(case, serve))
        except Exception:
            print(f"[{case.name}] failed; the controller's last lines:\n" + serve.tail(),
                  flush=True)
            raise
        serve.ensure_alive()
        rss, peak = serve.memory()
    finally:
        serve.close()
    after = client.rss_after if client.rss_after is not None else rss
    peak = max(peak, after)  # VmHWM is kept in pages: a hair under VmRSS read just before
    seconds = time.monotonic() - start
    print(f"[{case.name}] RSS at start {started:.0f} MiB, after {after:.0f} MiB, peak "
          f"{peak:.0f} MiB ({seconds:.0f} s)", flush=True)
    return {"case": case.name, "limit": case.limit, "value": case.value,
            "settings": {k: f"{len(v)} names" if isinstance(v, list) else v
                         for k, v in case.settings.items()},
            "rss_start_mib": round(started, 1),
            "rss_after_mib": round(after, 1), "peak_mib": round(peak, 1),
            "seconds": round(seconds, 1), **client.notes}


def markdown(result: dict[str, Any]) -> str:
    request, limit = result["chart_request_mib"], result["chart_limit_mib"]
    lines = [f"| case | limit | value | RSS after, MiB | peak RSS, MiB | vs request {request:.0f}"
             f" / limit {limit:.0f} MiB | controller CPU after |",
             "|---|---|---|---|---|---|---|"]
    for r in result["cases"]:
        peak = r["peak_mib"]
        verdict = ("**over the limit**" if peak > limit else "over the request"
                   if peak > request else "within the request")
        cpu = r.get("cpu_share_settled")
        lines.append(f"| {r['case']} | {r['limit']} | {r['value']} | {r['rss_after_mib']:.0f} | "
                     f"{peak:.0f} | {peak / limit:.0%} of the limit, {verdict} | "
                     f"{'' if cpu is None else f'{cpu:.0%}'} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    ap.add_argument("--reports", type=int, default=8,
                    help="reports of max_report_bytes in case reports")
    ap.add_argument("--max-reports", type=int, default=4,
                    help="reports of its bound in case reports-max (each ~10 s)")
    ap.add_argument("--log-size", type=int, default=LOG_BOUND,
                    help="decision_log_size of cases log-max and all (default: its bound)")
    ap.add_argument("--engines", type=int, default=500)
    ap.add_argument("--all-engines", type=int, default=6,
                    help="engines in case all (each hello costs a ~0.7 s decide round there)")
    ap.add_argument("--watchers", type=int, default=WATCHERS_MAX,
                    help="WatchDecisions streams (default: max_watch_streams, the most served)")
    ap.add_argument("--all-watchers", type=int, default=WATCHERS_MAX)
    ap.add_argument("--distinct-engines", type=int, default=10)
    ap.add_argument("--all-reports", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    # SIGTERM (timeout, Ctrl-C of a wrapper) unwinds like an exception: the controller stops.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    chosen = [n for n in args.cases.split(",") if n]
    todo = [c for c in cases(args) if not chosen or c.name in chosen]
    if unknown := set(chosen) - {c.name for c in todo}:
        ap.error(f"unknown cases: {', '.join(sorted(unknown))}")
    request, limit = chart_resources()
    print(f"specpilot controller memory, {len(todo)} cases; the chart requests {request:.0f} "
          f"MiB and limits {limit:.0f} MiB", flush=True)
    start = time.monotonic()
    results = [run_case(c) for c in todo]
    result = {"chart_request_mib": request, "chart_limit_mib": limit,
              "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
              "python": platform.python_version(), "seconds": round(time.monotonic() - start),
              "cases": results}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sidecar_memory.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "sidecar_memory.md").write_text(markdown(result))
    print(markdown(result))
    print(f"{result['seconds']} s in all", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
