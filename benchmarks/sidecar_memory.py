"""The controller's memory, for the Helm chart's requests and limits: `specpilot serve` in a
child process, its resident set idle and after an engine streamed reports of many classes.

    .venv/bin/python benchmarks/sidecar_memory.py [--classes 48] [--reports 1500]

Prints the RSS (MiB) at each stage and writes benchmarks/results/sidecar_memory.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "proto")]

import grpc  # noqa: E402

from controller.server.stubs import engine_stub  # noqa: E402
from specpilot.v1 import common_pb2, engine_pb2  # noqa: E402


def _rss_mib(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+)", status).group(1)) / 1024  # type: ignore[union-attr]


async def _stream(target: str, classes: int, reports: int) -> None:
    hello = engine_pb2.EngineHello(
        engine_id="memory-bench", model="m", target_vocab_hash="v", max_k=4, drafts=[
            engine_pb2.DraftInfo(name="d", kind=common_pb2.DRAFT_KIND_MODEL, vocab_hash="v",
                                 max_k=4)],
        capabilities=engine_pb2.EngineCapabilities(per_request_k=True), max_batch_size=64)

    async def messages() -> AsyncIterator[engine_pb2.ConnectRequest]:
        yield engine_pb2.ConnectRequest(hello=hello)
        for seq in range(1, reports + 1):
            yield engine_pb2.ConnectRequest(report=engine_pb2.EngineReport(
                sequence=seq, interval_seconds=1.0, acceptance=[
                    engine_pb2.AcceptanceCounts(traffic_class=f"class-{j}", draft="d", k=4,
                                                steps_by_accepted=[10 + (seq + j) % 7, 20, 30,
                                                                   40, 50])
                    for j in range(classes)]))
            if seq % max(reports // 10, 1) == 0:
                print(f"  {seq}/{reports} reports", flush=True)

    async with grpc.aio.insecure_channel(target) as ch:
        answered = 0
        async for msg in engine_stub(ch).Connect(messages()):
            answered += msg.HasField("report_result")
            if answered == reports:
                break


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--classes", type=int, default=48)
    ap.add_argument("--reports", type=int, default=1500)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; from controller.cli import main; sys.exit(main())",
         "serve", "--grpc-port", "0", "--http-port", "0", "--set",
         f"max_classes={args.classes + 2}", "--set", "decision_log_size=10000"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        target = None
        assert proc.stdout is not None
        while target is None:
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError("specpilot serve exited before listening")
            found = re.search(r"grpc listening on (\S+)", line)
            target = found.group(1) if found else None
        idle = _rss_mib(proc.pid)
        print(f"idle: {idle:.0f} MiB", flush=True)
        asyncio.run(_stream(target, args.classes, args.reports))
        busy = _rss_mib(proc.pid)
        print(f"after {args.reports} reports of {args.classes} classes: {busy:.0f} MiB")
    finally:
        proc.terminate()
        proc.wait(10)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sidecar_memory.json").write_text(json.dumps(
        {"idle_mib": idle, "busy_mib": busy, "classes": args.classes,
         "reports": args.reports}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
