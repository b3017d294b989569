"""The dashboard at scale, side by side with a small controller, in a real browser.

    .venv/bin/python benchmarks/dashboard.py [--out benchmarks/results]

Two real controllers in this process: "small" (3 classes, ~100 decisions in the log) and
"large" (50 classes x 9 batch buckets, a 10,000-entry decision log). For each, Playwright
driving Debian's chromium loads the page; measured: the JSON the page reads (/api/dashboard,
a page of the log with its plain-language lines, the timeline's window) in ms and bytes, the
page load until every K cell and the first log page are drawn, and a live decision's way from
the controller to the page. Median of --repeats. Writes dashboard.{json,md} under --out; the
ratios large/small are what compare (absolute times move with the machine).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path
from typing import Any

import aiohttp
from playwright.async_api import async_playwright

from benchmarks.demo.screenshot import chromium_path
from specpilot.contract.records import (
    AcceptanceRecord,
    DraftKind,
    DraftSpec,
    EngineHello,
    EngineReport,
    Override,
)
from specpilot.controller.server.app import RunningServer, start_server
from specpilot.controller.settings import load_settings

SIZES = {"small": (3, 100), "large": (50, 10_000)}  # classes, decision-log entries


def _progress(msg: str) -> None:
    print(f"  {msg}", flush=True)


async def _controller(classes: int, log_entries: int) -> RunningServer:
    """A controller whose core holds ``classes`` classes with evidence and a full log (filled
    by pinning and clearing K: each change is one decision per bucket)."""
    server = await start_server(load_settings(
        grpc_port=0, http_port=0, max_classes=classes + 2, decision_log_size=log_entries,
        seed=1, policy_token="bench-token"))
    core, now = server.core, time.time()
    core.connect_engine(EngineHello("engine-1", "m", "v", (DraftSpec("d", DraftKind.MODEL, 4,
                                                                     "v"),), 4), now)
    names = [f"class-{i:02d}" for i in range(classes)]
    core.ingest("engine-1", EngineReport(1, 1.0, 0, tuple(
        AcceptanceRecord(n, "d", 4, (10 + i, 20, 30, 40, 50)) for i, n in enumerate(names))),
        now)
    core.decide(now)
    k = 0
    while len(core.snapshot(now).log) < log_entries:
        k = k % 4 + 1
        for n in names:
            core.set_override(Override(n, pin_k=k, note="bench"))
        core.decide(now)
    return server


async def _timed_get(session: aiohttp.ClientSession, url: str, repeats: int
                     ) -> tuple[float, int]:
    times, size = [], 0
    for _ in range(repeats):
        start = time.perf_counter()
        async with session.get(url) as r:
            body = await r.read()
        times.append((time.perf_counter() - start) * 1e3)
        size = len(body)
    return statistics.median(times), size


async def measure(name: str, classes: int, log_entries: int, repeats: int) -> dict[str, Any]:
    _progress(f"{name}: filling a controller with {classes} classes and {log_entries:,} "
              "decisions")
    server = await _controller(classes, log_entries)
    try:
        cells = len(server.core.snapshot(time.time()).classes) * server.core.config.n_buckets
        out: dict[str, Any] = {"classes": classes, "log_entries": log_entries, "cells": cells}
        async with aiohttp.ClientSession() as session:
            for key, path in (("state", "/api/dashboard"),
                              ("log_page", "/api/decisions?text=1&limit=100"),
                              ("timeline", "/api/decisions?limit=2000")):
                ms, size = await _timed_get(session, server.http_url + path, repeats)
                out[f"{key}_ms"], out[f"{key}_bytes"] = ms, size
        async with async_playwright() as p:
            browser = await p.chromium.launch(executable_path=chromium_path(),
                                              args=["--no-sandbox", "--disable-gpu"])
            loads, lives = [], []
            for i in range(repeats):
                _progress(f"{name}: page load {i + 1}/{repeats}")
                page = await browser.new_page(viewport={"width": 1280, "height": 900})
                start = time.perf_counter()
                await page.goto(server.http_url + "/")
                await page.wait_for_function(
                    f"document.querySelectorAll('#ktable td.kcell').length === {cells} && "
                    "document.querySelectorAll('#log li').length >= 100", timeout=60_000)
                loads.append((time.perf_counter() - start) * 1e3)
                # A live decision: pin one class through the HTTP API (as the page's own
                # control does), time until its cell shows it.
                cls, k = "class-00", 1 + i % 3
                start = time.perf_counter()
                async with aiohttp.ClientSession() as session:
                    await session.post(server.http_url + "/api/overrides", json={
                        "override": {"traffic_class": cls, "pin_k": k, "note": "live"}},
                        headers={"Authorization": "Bearer bench-token"})
                await page.wait_for_function(
                    f"(document.querySelector('#ktable td.kcell[data-class=\"{cls}\"]') || {{}})"
                    f".dataset?.k === '{k}'", timeout=60_000)
                lives.append((time.perf_counter() - start) * 1e3)
                heap = await page.evaluate("performance.memory ? performance.memory.usedJSHeapSize"
                                           " : 0")
                await page.close()
            await browser.close()
        out.update(page_load_ms=statistics.median(loads), live_ms=statistics.median(lives),
                   js_heap_bytes=heap)
        return out
    finally:
        await server.stop(grace_seconds=0.1)


async def run(repeats: int) -> dict[str, Any]:
    results = {name: await measure(name, c, n, repeats) for name, (c, n) in SIZES.items()}
    small, large = results["small"], results["large"]
    results["ratios"] = {k: large[k] / small[k] for k in (
        "state_ms", "log_page_ms", "timeline_ms", "page_load_ms", "live_ms") if small[k] > 0}
    return results


def markdown(r: dict[str, Any]) -> str:
    rows = [("classes x buckets (cells)", "cells", "{:,.0f}"),
            ("decision-log entries", "log_entries", "{:,.0f}"),
            ("GET /api/dashboard, ms", "state_ms", "{:.1f}"),
            ("GET /api/dashboard, bytes", "state_bytes", "{:,.0f}"),
            ("a log page with text (100 entries), ms", "log_page_ms", "{:.1f}"),
            ("the timeline's window (2,000 entries), ms", "timeline_ms", "{:.1f}"),
            ("page load until every K cell and the first log page are drawn, ms",
             "page_load_ms", "{:.0f}"),
            ("a new decision from the controller to its cell on the page, ms", "live_ms",
             "{:.0f}"),
            ("page's JS heap, bytes", "js_heap_bytes", "{:,.0f}")]
    lines = ["| | small | large | large / small |", "|---|---|---|---|"]
    for label, key, fmt in rows:
        ratio = r["ratios"].get(key)
        lines.append(f"| {label} | {fmt.format(r['small'][key])} | "
                     f"{fmt.format(r['large'][key])} | "
                     f"{'' if ratio is None else f'{ratio:.1f}x'} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    print("specpilot dashboard benchmark", flush=True)
    results = asyncio.run(run(args.repeats))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "dashboard.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "dashboard.md").write_text(markdown(results))
    print(markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
