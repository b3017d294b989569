"""Fault injection between a real vLLM engine (with the specpilot plugin) and a real controller
process: the parts shared by ``tests/engine/test_faults.py`` and ``benchmarks/soak.py``.

- :class:`ControllerProcess`: ``specpilot serve`` as a child process on loopback (the sidecar),
  its stdout read for the ports it prints, its last stderr lines kept (for ERROR lines), and the
  faults: SIGKILL, SIGTERM, SIGSTOP/SIGCONT. Its policy API and health check over gRPC; its
  memory and CPU time from /proc (``benchmarks/sidecar_memory.py``).
- :class:`TcpProxy`: a byte-forwarding TCP proxy the plugin connects through, which can cut a
  connection in the middle of a message (half a chunk forwarded, then both sides closed).
- :func:`start_flood` / ``python -m benchmarks.faults flood``: a separate process that opens many
  synthetic engine streams (the real stubs) and sends large valid reports as fast as it can.
- :class:`Load`: a thread that keeps the engine busy with batches of greedy requests and checks
  every output against the same prompts served without speculation.
- :class:`StepWindow` / :func:`step_stats`: the engine's per-step times in a window of time, from
  :class:`benchmarks.plugin_overhead.Recorder` (the engine-core step and the scheduler calls,
  timed around the plugin's hooks).
- :func:`link_counters`: the plugin link's report counters.

CPU priority: on a small machine the engine, the controller and the flood share cores. The child
processes can run at a lower priority (``nice``) so that what is measured is what the plugin
controls (its sender thread never blocks the scheduler), not the CPU share a busy neighbour takes:
in a deployment the sidecar has CPU of its own.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import queue
import re
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import yaml

ROOT = Path(__file__).resolve().parent.parent

SPECPILOT = str(Path(sys.executable).with_name("specpilot"))
STARTUP_SECONDS = 30.0
# The controller's settings for fault runs: fast reports, a short fail-static timeout (the
# controller's PolicyUpdate carries it to the engine).
FAST_SETTINGS: dict[str, object] = {
    "report_interval_seconds": 0.2,
    "fail_static_timeout_seconds": 1.5,
    "dwell_seconds": 0.2,
    "seed": 3,
    # No per-token cut (and so no early stop of the drafter's passes): with it the pinned K=4
    # runs fewer drafter passes than the static configuration fail-static falls back to, and
    # the step times of the two windows would not compare.
    "token_cut": False,
}
# The plugin's settings for fault runs (``benchmarks.demo.engine.plugin_environment``).
FAST_PLUGIN: dict[str, str] = {
    "fail_static_timeout_seconds": "1.5",
    "reconnect_initial_seconds": "0.1",
    "reconnect_max_seconds": "0.5",
    # The model draft only: the pinned policy then equals the static configuration (K=4 with the
    # drafter), so fail-static changes nothing of the engine's work and step times compare.
    "ngram_drafts": "false",
    "engine_id": "fault-engine",
}
PROMPTS = [
    "def add(a, b):\n    return a + b\n\ndef add(a, b):\n",
    "The licence grants you the right to copy, modify and distribute the software",
    "import os\nimport sys\nimport os\nimport",
    "one two three four one two three four one two",
    "Permission is hereby granted, free of charge, to any person obtaining a copy",
    "for i in range(10):\n    print(i)\nfor i in range(10):\n",
    "class Foo:\n    def __init__(self):\n        self.x = 1\n",
    "GNU GENERAL PUBLIC LICENSE Version 3, 29 June 2007",
]
CLASSES = ("chat", "code")


def wait_until(predicate: Callable[[], bool], timeout: float, what: str,
               poll: float = 0.02) -> float:
    """Seconds until ``predicate()`` held; AssertionError naming ``what`` after ``timeout``."""
    start = time.monotonic()
    while True:
        if predicate():
            return time.monotonic() - start
        if time.monotonic() - start > timeout:
            raise AssertionError(f"timed out after {timeout:.1f} s waiting for {what}")
        time.sleep(poll)


def _child_env(extra: Mapping[str, str]) -> dict[str, str]:
    """This environment without SPECPILOT_* settings (the plugin's are set in this process),
    plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECPILOT_")}
    return {**env, **extra}


# ``nice`` at or above this: the SCHED_IDLE policy (runs only on a core nothing else wants).
IDLE_PRIORITY = 20


def renice(pid: int, nice: int) -> None:
    """Lower the CPU priority of every thread of process ``pid`` (0: this thread) by ``nice``,
    or to SCHED_IDLE for ``nice >= IDLE_PRIORITY`` (Linux keeps both per thread; threads
    started later inherit their creator's)."""
    if nice <= 0:
        return
    tasks = Path(f"/proc/{pid}/task")
    tids = [int(t.name) for t in tasks.iterdir()] if pid and tasks.is_dir() else [pid]
    idle = getattr(os, "SCHED_IDLE", None)
    for tid in tids:
        with contextlib.suppress(OSError):
            if nice >= IDLE_PRIORITY and idle is not None:
                os.sched_setscheduler(tid, idle, os.sched_param(0))
            else:
                os.setpriority(os.PRIO_PROCESS, tid,
                               min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))


# --- the controller, a child process -------------------------------------------------------------
# Its stderr lines kept, the newest: at log level info a controller logs an audit line per policy
# write and a line per engine event, so a long benchmark's would grow without end.
KEPT_LINES = 10_000
# The child, before it becomes ``specpilot serve`` (exec, the same pid): SIGTERM when the thread
# that started it ends (Linux's PR_SET_PDEATHSIG), so that a benchmark or test killed outright
# leaves no controller behind; and out at once if that parent is gone already. (A launcher, not
# Popen's preexec_fn: that is unsafe in a process with threads, such as one running an engine.)
_DIE_WITH_PARENT = """\
import ctypes, os, signal, sys
if sys.platform == "linux":
    ctypes.CDLL(None).prctl(1, signal.SIGTERM)
    if os.getppid() != int(sys.argv[1]):
        sys.exit(1)
os.execv(sys.argv[2], sys.argv[2:])
"""


def set_flag(value: object) -> str:
    """``value`` as ``specpilot serve --set NAME=VALUE`` reads it (``yaml.safe_load``): numbers,
    bools, strings (quoted where YAML would read them otherwise), lists, all as they are."""
    text: str = yaml.safe_dump(value, default_flow_style=True, width=float("inf"),
                               allow_unicode=True)
    return text.removesuffix("\n").removesuffix("\n...")  # a scalar's end-of-document mark


class ControllerProcess:
    """``specpilot serve`` on loopback: gRPC on ``grpc_port`` (0: a free one), HTTP on a free
    port, ``settings`` as ``--set NAME=VALUE``, the policy token from the environment, logging at
    ``log_level`` (its last KEPT_LINES stderr lines kept); reniced by ``nice`` once it listens.
    It ends with the thread that started it (SIGTERM, on Linux)."""

    def __init__(self, grpc_port: int = 0, *, settings: Mapping[str, object] = FAST_SETTINGS,
                 token: str = "fault-injection-policy-token", nice: int = 0,
                 log_level: str = "info") -> None:
        self.token = token
        args = [SPECPILOT, "serve", "--grpc-port", str(grpc_port), "--http-port", "0",
                "--log-level", log_level]
        for name, value in settings.items():
            args += ["--set", f"{name}={set_flag(value)}"]
        self.started_at = time.monotonic()
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _DIE_WITH_PARENT, str(os.getpid()), *args],
            env=_child_env({"SPECPILOT_POLICY_TOKEN": token}), stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True)
        # Its stdout is the CLI's own few lines (the ports, then "stopping"); its stderr, the log.
        self.stdout: queue.Queue[str] = queue.Queue()
        self._stderr: deque[tuple[float, str]] = deque(maxlen=KEPT_LINES)
        self._stderr_lock = threading.Lock()
        self._pumps = [threading.Thread(target=self._pump, args=(s, put), daemon=True)
                       for s, put in ((self.proc.stdout, self.stdout.put),
                                      (self.proc.stderr, self._keep_err))]
        for t in self._pumps:
            t.start()
        self.grpc_target = ""
        self.http_url = ""
        self._channel: grpc.Channel | None = None
        try:
            self._read_ports()
        except BaseException:
            self.kill()
            raise
        self.ready_at = time.monotonic()
        # Started at full priority (a quick start), served at ``nice``.
        renice(self.proc.pid, nice)

    @staticmethod
    def _pump(stream: Any, put: Callable[[str], None]) -> None:
        for line in stream:
            put(line.rstrip("\n"))

    def _keep_err(self, line: str) -> None:
        with self._stderr_lock:
            self._stderr.append((time.monotonic(), line))

    @property
    def stderr(self) -> list[tuple[float, str]]:
        """Its last KEPT_LINES stderr lines, oldest first: (monotonic time, line)."""
        with self._stderr_lock:
            return list(self._stderr)

    def tail(self, n: int = 50) -> str:
        """Its last ``n`` stderr lines, one a line."""
        return "\n".join(line for _, line in self.stderr[-n:])

    def _read_ports(self) -> None:
        deadline = time.monotonic() + STARTUP_SECONDS
        while not (self.grpc_target and self.http_url):
            try:
                line = self.stdout.get(timeout=0.1)
            except queue.Empty:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    time.sleep(0.2)  # the last stderr lines
                    raise RuntimeError("specpilot serve did not start: "
                                       + " | ".join(e for _, e in self.stderr[-5:])) from None
                continue
            if line.startswith("specpilot: grpc listening on "):
                self.grpc_target = line.split()[-1]
            elif line.startswith("specpilot: http listening on "):
                self.http_url = line.split()[-1]

    @property
    def grpc_port(self) -> int:
        return int(self.grpc_target.rsplit(":", 1)[1])

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def ensure_alive(self) -> None:
        """RuntimeError, with its last lines, if it has exited."""
        if self.proc.poll() is not None:
            raise RuntimeError(f"specpilot serve exited ({self.proc.returncode}):\n"
                               + self.tail())

    # --- its resources, from /proc (Linux) -------------------------------------------------------
    def memory(self) -> tuple[float, float]:
        """Its resident set now and its peak so far (VmRSS, VmHWM), MiB."""
        status = Path(f"/proc/{self.proc.pid}/status").read_text()
        values = []
        for key in ("VmRSS", "VmHWM"):
            found = re.search(rf"{key}:\s+(\d+)", status)
            if found is None:
                raise RuntimeError(f"no {key} in /proc/{self.proc.pid}/status")
            values.append(int(found.group(1)) / 1024)
        return values[0], values[1]

    def cpu_seconds(self) -> float:
        """Its user and system CPU time so far, seconds."""
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    # --- faults ----------------------------------------------------------------------------------
    def kill(self) -> None:
        """SIGKILL, and reap it."""
        self._close_channel()
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)

    def terminate(self, timeout: float = 15.0) -> int:
        """SIGTERM (graceful: ``specpilot serve`` stops its servers and exits 0); its status."""
        self._close_channel()
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def freeze(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def error_lines(self, since: float = 0.0) -> list[str]:
        """Its stderr lines at ERROR or above, or with a traceback, logged after ``since``
        (monotonic)."""
        return [line for at, line in self.stderr if at >= since and (
            " ERROR " in line or " CRITICAL " in line or line.startswith("Traceback"))]

    # --- its APIs --------------------------------------------------------------------------------
    def channel(self) -> grpc.Channel:
        if self._channel is None:
            self._channel = grpc.insecure_channel(self.grpc_target)
        return self._channel

    def _close_channel(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None

    def get_policy(self, timeout: float = 5.0) -> Any:
        """Its GetPolicyResponse (version, engines, engine_status)."""
        from specpilot.controller.server.stubs import policy_stub
        from specpilot.v1 import policy_pb2

        return policy_stub(self.channel()).GetPolicy(policy_pb2.GetPolicyRequest(),
                                                     timeout=timeout)

    def pin_all(self, k: int, timeout: float = 5.0) -> int:
        """Pin every class to K=``k`` (an authenticated override); the new policy version."""
        from specpilot.controller.server.stubs import policy_stub
        from specpilot.v1 import policy_pb2

        request = policy_pb2.SetOverrideRequest(override=policy_pb2.Override(
            traffic_class="*", pin_k=k, note="fault injection: fixed work per step"))
        resp = policy_stub(self.channel()).SetOverride(
            request, timeout=timeout, metadata=(("authorization", f"Bearer {self.token}"),))
        return int(resp.policy_version)

    def health(self, timeout: float = 10.0) -> tuple[str, float]:
        """grpc.health.v1 Check of the whole server: (status name or error code, seconds)."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        stub = health_pb2_grpc.HealthStub(self.channel())
        start = time.perf_counter()
        try:
            resp = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
            status = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
        except grpc.RpcError as exc:
            status = exc.code().name if isinstance(exc, grpc.Call) else str(exc)
        return status, time.perf_counter() - start

    def engine_status(self, engine_id: str) -> Any | None:
        """The engine's EngineStatus in GetPolicy (None: not connected here)."""
        for status in self.get_policy().engine_status:
            if status.engine_id == engine_id:
                return status
        return None

    def close(self) -> None:
        """Stop it however it is (thawed first), and reap it."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.thaw()
            self.kill()
        self._close_channel()


# --- a proxy that cuts streams -------------------------------------------------------------------
class TcpProxy:
    """Listens on 127.0.0.1 (a free port) and forwards every connection to
    ``127.0.0.1:upstream_port``, a thread per direction. ``cut_mid_message`` arms a cut: the next
    chunk of at least ``min_bytes`` from a client (a report, not a ping or window update) is
    forwarded half, then both sides of that connection are closed."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._conns: list[tuple[socket.socket, socket.socket]] = []
        self._armed = 0  # min bytes of the chunk to cut (0: none armed)
        self.cut = threading.Event()
        self.cut_info: dict[str, int] = {}
        self.connections = 0
        self._closed = False
        threading.Thread(target=self._accept, daemon=True, name="fault-proxy").start()

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def cut_mid_message(self, min_bytes: int = 64) -> None:
        with self._lock:
            self.cut.clear()
            self.cut_info = {}
            self._armed = min_bytes

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.upstream_port), timeout=2)
                upstream.settimeout(None)
            except OSError:  # the controller is down: the client sees its connection closed
                client.close()
                continue
            for s in (client, upstream):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            pair = (client, upstream)
            with self._lock:
                self._conns.append(pair)
                self.connections += 1
            for src, dst, up in ((client, upstream, True), (upstream, client, False)):
                threading.Thread(target=self._pump, args=(src, dst, up, pair), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, upstream_bound: bool,
              pair: tuple[socket.socket, socket.socket]) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if upstream_bound and self._armed and len(data) >= self._armed:
                    with self._lock:
                        cut, self._armed = bool(self._armed), 0
                    if cut:
                        dst.sendall(data[:len(data) // 2])
                        self.cut_info = {"chunk_bytes": len(data), "forwarded": len(data) // 2}
                        self._close_pair(pair)
                        self.cut.set()
                        return
                dst.sendall(data)
        except OSError:
            pass
        self._close_pair(pair)

    def _close_pair(self, pair: tuple[socket.socket, socket.socket]) -> None:
        for s in pair:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                s.close()
        with self._lock:
            if pair in self._conns:
                self._conns.remove(pair)

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._listener.close()
        with self._lock:
            conns = list(self._conns)
        for pair in conns:
            self._close_pair(pair)


# --- the flood: synthetic engines, another process ----------------------------------------------
def flood_report(seq: int, draft: str, classes: int, rng: Any) -> Any:
    """A large valid report (the shape of ``benchmarks.ingest.realistic_report``, with the given
    draft): ``classes`` classes of K=4 histograms, 9 step-timing groups, 32 finished requests."""
    from specpilot.contract import engine_stream
    from specpilot.contract.records import (
        AcceptanceRecord,
        EngineReport,
        RequestSummaryRecord,
        StepTimingRecord,
    )
    from specpilot.v1 import engine_pb2

    k = 4
    names = [f"flood-{i}" for i in range(classes)]
    acceptance = tuple(
        AcceptanceRecord(c, draft, k, tuple(int(x) for x in rng.integers(0, 200, k + 1)))
        for c in names)
    finished = tuple(RequestSummaryRecord(names[i % classes], draft, 200, 100, 120, 80, 1.5)
                     for i in range(32))
    timings = tuple(StepTimingRecord(b, draft, k, 50, 50 * 2**b, 50 * 2**b * 5, 50 * 2**b * 4,
                                     50 * 0.02 * (1 + 0.1 * b)) for b in range(9))
    report = EngineReport(seq, 1.0, 0, acceptance, finished, timings, running_requests=16)
    return engine_pb2.ConnectRequest(report=engine_stream.report_to_proto(report))


def flood_hello(engine_id: str, draft: str) -> Any:
    from specpilot.contract import engine_stream
    from specpilot.contract.records import DraftKind, DraftSpec, EngineHello
    from specpilot.v1 import engine_pb2

    return engine_pb2.ConnectRequest(hello=engine_stream.hello_to_proto(EngineHello(
        engine_id, "flood-model", "flood-vocab", (DraftSpec(draft, DraftKind.MODEL, 4,
                                                            "flood-vocab"),), 4,
        engine_version="flood", plugin_version="flood", max_batch_size=512)))


async def _flood(target: str, streams: int, seconds: float, draft: str, classes: int,
                 nice: int) -> dict[str, Any]:
    import numpy as np

    from specpilot.controller.server.stubs import engine_stub

    stats: dict[str, Any] = {"streams": streams, "sent": 0, "accepted": 0, "shed": 0,
                             "rejected": 0, "stream_errors": [], "report_bytes": 0}
    shed = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]  # "overloaded: send it again later"
    rng = np.random.default_rng(0)
    # A few distinct reports, reused (building them would be the flood's bottleneck).
    templates = [flood_report(1, draft, classes, rng) for _ in range(4)]
    stats["report_bytes"] = templates[0].ByteSize()
    renice(0, nice)  # this thread, and gRPC's threads, all started after this
    print("ready", flush=True)
    deadline = time.monotonic() + seconds

    async def one(i: int) -> None:
        async with grpc.aio.insecure_channel(target) as channel:
            call = engine_stub(channel).Connect(None)  # written with call.write

            async def read() -> None:
                async for msg in call:
                    if msg.WhichOneof("message") != "report_result":
                        continue
                    result = msg.report_result
                    stats["accepted" if result.accepted else "shed" if result.code == shed
                          else "rejected"] += 1

            reader: asyncio.Task[None] | None = None
            try:
                await call.write(flood_hello(f"flood-{i}", draft))
                reader = asyncio.create_task(read())
                seq = 0
                while time.monotonic() < deadline:
                    seq += 1
                    msg = templates[seq % len(templates)]
                    msg.report.sequence = seq
                    await call.write(msg)
                    stats["sent"] += 1
            except grpc.RpcError as exc:
                code = exc.code().name if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
                stats["stream_errors"].append(code)
            finally:
                # At the deadline the streams end at once: what the controller has not read
                # yet is dropped with them.
                call.cancel()
                if reader is not None:
                    reader.cancel()
                    with contextlib.suppress(asyncio.CancelledError, grpc.RpcError):
                        await reader

    started = time.monotonic()
    await asyncio.gather(*(one(i) for i in range(streams)))
    stats["seconds"] = time.monotonic() - started
    stats["reports_per_second"] = stats["sent"] / max(stats["seconds"], 1e-9)
    return stats


@dataclass
class Flood:
    """A running flood process; ``result()`` waits for its end and returns its counts."""

    proc: subprocess.Popen[str]

    def result(self, timeout: float = 60.0) -> dict[str, Any]:
        out, err = self.proc.communicate(timeout=timeout)
        if self.proc.returncode != 0:
            raise RuntimeError(f"flood failed ({self.proc.returncode}): {err[-2000:]}")
        parsed: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
        return parsed

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def start_flood(target: str, streams: int, seconds: float, draft: str, classes: int = 8,
                nice: int = 0) -> Flood:
    """``streams`` synthetic engines sending large valid reports to ``target`` as fast as they
    can for ``seconds`` (from when this returns), from a child process (its own GIL) at CPU
    priority ``nice``."""
    args = [sys.executable, str(Path(__file__).resolve()), "flood", "--target", target,
            "--streams", str(streams), "--seconds", str(seconds), "--draft", draft,
            "--classes", str(classes), "--nice", str(nice)]
    proc = subprocess.Popen(args, cwd=ROOT, env=_child_env({}), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    ready = proc.stdout.readline().strip()  # once it imported and built its reports
    if ready != "ready":
        proc.kill()
        raise RuntimeError(f"the flood did not start: {ready!r} {proc.communicate()[1][-2000:]}")
    return Flood(proc)


# --- load on the engine --------------------------------------------------------------------------
def greedy_params(max_tokens: int, traffic_class: str | None = None) -> Any:
    from vllm import SamplingParams

    extra = {"traffic_class": traffic_class} if traffic_class else None
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                          extra_args=extra)


def reference_outputs(llm: Any, prompts: Sequence[str], max_tokens: int) -> list[list[int]]:
    """Greedy token ids of ``prompts`` on ``llm`` (an engine without speculation)."""
    outs = llm.generate(list(prompts), greedy_params(max_tokens), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@dataclass
class LoadCounts:
    batches: int = 0
    sent: int = 0
    completed: int = 0
    failed: int = 0
    mismatched: int = 0
    errors: list[str] = field(default_factory=list)

    def minus(self, other: LoadCounts) -> LoadCounts:
        return LoadCounts(self.batches - other.batches, self.sent - other.sent,
                          self.completed - other.completed, self.failed - other.failed,
                          self.mismatched - other.mismatched, self.errors[len(other.errors):])

    def as_dict(self) -> dict[str, Any]:
        return {"batches": self.batches, "sent": self.sent, "completed": self.completed,
                "failed": self.failed, "greedy_mismatches": self.mismatched,
                "errors": self.errors[:10]}


class Load:
    """A thread that serves ``prompts`` as one batch of greedy requests after another on ``llm``
    (classes alternating over ``CLASSES``) and checks each output against ``reference``. A
    request fails when ``generate`` raises or its output is not complete (``max_tokens`` tokens,
    finished by length); a completed one whose tokens differ from the reference is a mismatch."""

    def __init__(self, llm: Any, prompts: Sequence[str], reference: Sequence[Sequence[int]],
                 max_tokens: int) -> None:
        self._llm = llm
        self._prompts = list(prompts)
        self._reference = [list(r) for r in reference]
        self._max_tokens = max_tokens
        self._params = [greedy_params(max_tokens, CLASSES[i % len(CLASSES)])
                        for i in range(len(self._prompts))]
        self._counts = LoadCounts()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="fault-load")

    @property
    def batch_size(self) -> int:
        return len(self._prompts)

    def start(self) -> None:
        self._thread.start()

    def counts(self) -> LoadCounts:
        with self._lock:
            c = self._counts
            return LoadCounts(c.batches, c.sent, c.completed, c.failed, c.mismatched,
                              list(c.errors))

    def _run(self) -> None:
        while not self._stop.is_set():
            n = len(self._prompts)
            with self._lock:
                self._counts.sent += n
            try:
                outs = self._llm.generate(self._prompts, self._params, use_tqdm=False)
            except Exception as exc:  # counted, and the load goes on
                with self._lock:
                    self._counts.failed += n
                    self._counts.errors.append(f"{type(exc).__name__}: {exc}")
                time.sleep(0.1)
                continue
            done = failed = mismatched = 0
            for out, want in zip(outs, self._reference, strict=True):
                got = out.outputs[0] if out.outputs else None
                if (got is None or not out.finished or got.finish_reason != "length"
                        or len(got.token_ids) != self._max_tokens):
                    failed += 1
                    continue
                done += 1
                mismatched += list(got.token_ids) != want
            failed += n - len(outs)
            with self._lock:
                self._counts.batches += 1
                self._counts.completed += done
                self._counts.failed += failed
                self._counts.mismatched += mismatched

    def stop(self, timeout: float = 60.0) -> None:
        self._stop.set()
        self._thread.join(timeout)


# --- step times ----------------------------------------------------------------------------------
def install_step_recorder(llm: Any) -> Any:
    """A :class:`benchmarks.plugin_overhead.Recorder` on ``llm``'s scheduler and engine-core
    step (each step's wall time, scheduler time, batch size)."""
    from benchmarks.plugin_overhead import Recorder

    recorder = Recorder()
    recorder.install(llm)
    return recorder


@dataclass
class StepWindow:
    """The steps a recorder saw between ``open`` and ``close``."""

    recorder: Any
    start: int = 0
    end: int = -1
    started_at: float = 0.0
    seconds: float = 0.0

    @classmethod
    def open(cls, recorder: Any) -> StepWindow:
        return cls(recorder, len(recorder.steps), -1, time.monotonic())

    def close(self) -> StepWindow:
        self.end = len(self.recorder.steps)
        self.seconds = time.monotonic() - self.started_at
        return self

    def steps(self) -> list[dict[str, float]]:
        steps: list[dict[str, float]] = self.recorder.steps[self.start:self.end]
        return steps


def _quantile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def step_stats(windows: Sequence[StepWindow], batch: int) -> dict[str, float]:
    """Decode steps of the full batch in ``windows`` (pooled): their count, median and p99 wall
    time and scheduler time (``schedule`` + ``update_from_output`` + ``update_draft_token_ids``,
    the plugin's hooks inside), milliseconds, and steps of any kind per second."""
    every = [s for w in windows for s in w.steps()]
    seconds = sum(w.seconds for w in windows)
    steps = [s for s in every if s["batch"] == batch and s["tokens"] <= batch * 8]
    if not steps:
        return {"steps": 0.0}
    walls = [s["wall"] for s in steps]
    return {"steps": float(len(steps)),
            "steps_per_second": len(every) / max(seconds, 1e-9),
            "median_ms": 1e3 * statistics.median(walls),
            "p99_ms": 1e3 * _quantile(walls, 0.99),
            "sched_median_ms": 1e3 * statistics.median(s["sched"] for s in steps),
            "sched_p99_ms": 1e3 * _quantile([s["sched"] for s in steps], 0.99),
            "seconds": seconds}


def ratios(fault: Mapping[str, float], normal: Mapping[str, float]) -> dict[str, float]:
    """fault / normal for each timing both windows have."""
    return {k: fault[k] / normal[k] for k in ("median_ms", "p99_ms", "sched_median_ms",
                                              "sched_p99_ms", "steps_per_second")
            if k in fault and k in normal and normal[k] > 0}


# --- the link ------------------------------------------------------------------------------------
class SubmitTimer:
    """Times every ``link.submit`` the scheduler makes (an instance attribute wrapping the
    bound method): the one call of the plugin's hot path that touches the link."""

    def __init__(self, link: Any) -> None:
        self.seconds: list[float] = []
        submit = link.submit
        perf = time.perf_counter

        def timed(payload: Any) -> None:
            t0 = perf()
            submit(payload)
            self.seconds.append(perf() - t0)
        link.submit = timed

    def mark(self) -> int:
        return len(self.seconds)

    def stats(self, start: int, end: int | None = None) -> dict[str, float]:
        calls = self.seconds[start:end]
        return {"calls": float(len(calls)),
                "max_ms": 1e3 * max(calls, default=0.0),
                "median_ms": 1e3 * (statistics.median(calls) if calls else 0.0)}


def pilot_of(llm: Any) -> Any:
    pilot = llm.llm_engine.engine_core.engine_core.scheduler._pilot
    if pilot is None:
        raise RuntimeError("the engine runs no specpilot pilot")
    return pilot


def link_counters(link: Any) -> dict[str, int]:
    """The link's counters (``reports_shed``: answered "overloaded, send it again", and queued
    again), and ``submitted`` (every payload handed to the link is sent, dropped or still
    queued; a shed one is sent twice) and ``outstanding`` (messages sent with no answer yet,
    beside ``unanswered``: reports in flight on a stream that died, counted by the link)."""
    c = {name: int(getattr(link, name, 0)) for name in (
        "reports_sent", "heartbeats_sent", "reports_accepted", "reports_rejected",
        "reports_shed", "dropped", "unanswered", "records_dropped", "connects")}
    c["queued"] = int(link.queued)
    c["in_flight"] = int(link.in_flight)
    c["submitted"] = c["reports_sent"] - c["reports_shed"] + c["dropped"] + c["queued"]
    c["outstanding"] = (c["reports_sent"] + c["heartbeats_sent"] - c["reports_accepted"]
                        - c["reports_rejected"] - c["reports_shed"] - c["unanswered"])
    return c


def settled_counters(link: Any, timeout: float = 10.0) -> dict[str, int]:
    """``link_counters`` at a moment with nothing in flight on the live stream, so that
    ``outstanding`` holds only messages lost without being counted."""
    wait_until(lambda: link.in_flight == 0, timeout, "the link's messages to be answered",
               poll=0.002)
    return link_counters(link)


def diff(after: Mapping[str, int], before: Mapping[str, int]) -> dict[str, int]:
    return {k: after[k] - before[k] for k in after}


@contextlib.contextmanager
def health_sampler(controller: ControllerProcess, every: float = 0.2
                   ) -> Iterator[list[tuple[str, float]]]:
    """Health checks of ``controller`` every ``every`` seconds on a thread while the block runs:
    (status, seconds) each."""
    samples: list[tuple[str, float]] = []
    stop = threading.Event()

    def run() -> None:
        while not stop.is_set():
            samples.append(controller.health())
            stop.wait(every)

    thread = threading.Thread(target=run, daemon=True, name="fault-health")
    thread.start()
    try:
        yield samples
    finally:
        stop.set()
        thread.join(15)


def latency_stats(samples: Sequence[tuple[str, float]]) -> dict[str, Any]:
    lat = [s for _, s in samples]
    if not lat:
        return {"checks": 0}
    return {"checks": len(lat), "serving": sum(st == "SERVING" for st, _ in samples),
            "p50_ms": 1e3 * statistics.median(lat), "p99_ms": 1e3 * _quantile(lat, 0.99),
            "max_ms": 1e3 * max(lat)}


# --- the rig: engine, proxy, controller, load ----------------------------------------------------
@dataclass
class FaultRig:
    """A running engine with the plugin, connected through ``proxy`` to ``controller`` (replaced
    by each restart, on the same port), kept busy by ``load``; the fault procedures below each
    inject one fault under load and return what they measured (the caller judges it)."""

    llm: Any
    proxy: TcpProxy
    controller: ControllerProcess
    load: Load
    recorder: Any
    submits: SubmitTimer
    nice: int = 0
    settings: Mapping[str, object] = field(default_factory=lambda: dict(FAST_SETTINGS))
    pin_k: int = 4

    @property
    def pilot(self) -> Any:
        return pilot_of(self.llm)

    @property
    def link(self) -> Any:
        return self.pilot.link

    @property
    def engine_id(self) -> str:
        return str(self.pilot.link._engine_id)

    def start_controller(self, grpc_port: int = 0) -> ControllerProcess:
        """A new controller (on ``grpc_port``), every class pinned to ``pin_k``."""
        ctl = ControllerProcess(grpc_port, settings=self.settings, nice=self.nice)
        ctl.pin_all(self.pin_k)
        return ctl

    def policy_in_force(self) -> bool:
        """The engine runs the controller's current policy."""
        version = self.pilot.view.version
        try:
            return bool(version) and version == self.controller.get_policy(timeout=2).version
        except grpc.RpcError:
            return False

    def wait_policy(self, timeout: float = 20.0) -> float:
        return wait_until(self.policy_in_force, timeout, "the engine to run the controller's "
                          "policy", poll=0.05)

    def wait_accepted_after(self, accepted: int, timeout: float = 20.0) -> float:
        """Until the controller accepted a report past ``accepted`` (the link's count)."""
        return wait_until(lambda: self.link.reports_accepted > accepted, timeout,
                          "a report accepted by the controller")

    def steps(self, seconds: float) -> StepWindow:
        window = StepWindow.open(self.recorder)
        time.sleep(seconds)
        return window.close()

    # --- faults ----------------------------------------------------------------------------------
    def restart(self, graceful: bool, wait_fail_static: bool | None = None) -> dict[str, Any]:
        """SIGTERM (``graceful``) or SIGKILL the controller under load, wait for the engine's
        fail-static (``wait_fail_static``; default: after SIGKILL only), start a new controller on
        the same port and wait for the engine to reconnect, run its policy and have a report
        accepted."""
        link, view, old = self.link, self.pilot.view, self.controller
        self.wait_policy()
        load0, link0 = self.load.counts(), link_counters(link)
        old_version = int(old.get_policy().version)
        old_epoch = int(link.last_hello_ack.policy_epoch)
        t0 = time.monotonic()
        rc: int | None = None
        if graceful:
            rc = old.terminate()
        else:
            old.kill()
        stopped = time.monotonic() - t0
        fail_static_s: float | None = None
        if wait_fail_static if wait_fail_static is not None else not graceful:
            fail_static_s = wait_until(lambda: view.fail_static, 10.0,
                                       "the engine's fail-static") + stopped
        self.controller = new = self.start_controller(old.grpc_port)
        wait_until(lambda: link.connects > link0["connects"] and link.connected, 20.0,
                   "the engine's reconnect")
        reconnected = time.monotonic()
        policy_s = wait_until(lambda: self.policy_in_force() and view.version > old_version,
                              20.0, "the new controller's policy in force", poll=0.05)
        accepted_at = link.reports_accepted
        self.wait_accepted_after(accepted_at)

        def applied() -> bool:
            status = new.engine_status(self.engine_id)
            return status is not None and status.policy_version_applied > old_version

        applied_s = wait_until(applied, 20.0, "a report of the new policy's interval",
                               poll=0.05)
        status = new.engine_status(self.engine_id)
        return {
            "kind": "sigterm" if graceful else "sigkill",
            "exit_status": rc if graceful else -signal.SIGKILL,
            "fail_static_after_s": fail_static_s,
            "fail_static_timeout_s": float(view.fail_static_timeout_seconds),
            "controller_start_s": new.ready_at - new.started_at,
            "reconnect_after_start_s": reconnected - new.ready_at,
            "reconnect_after_fault_s": reconnected - t0,
            "policy_after_start_s": policy_s,
            "applied_version_reported_after_start_s": applied_s,
            "old_version": old_version,
            "old_epoch": old_epoch,
            "new_epoch": int(link.last_hello_ack.policy_epoch),
            "new_version_in_force": int(view.version),
            "new_version_reported": int(status.policy_version_applied) if status else 0,
            "engines_on_new_controller": list(new.get_policy().engines),
            "load": self.load.counts().minus(load0).as_dict(),
            "link": diff(link_counters(link), link0),
            "errors_logged_by_new_controller": new.error_lines(),
        }

    def freeze(self, seconds: float) -> dict[str, Any]:
        """The controller SIGSTOPped for ``seconds`` under load, then SIGCONT: the step times of
        that window against normal windows of the same length just before and after it, and the
        link's accounting once the controller caught up."""
        link, view, ctl = self.link, self.pilot.view, self.controller
        self.wait_policy()
        load0 = self.load.counts()
        before = self.steps(seconds)
        link0, mark = link_counters(link), self.submits.mark()
        ctl.freeze()
        try:
            frozen = self.steps(seconds)
            fail_static = bool(view.fail_static)
            link1, end = link_counters(link), self.submits.mark()
        finally:
            ctl.thaw()
        t_thaw = time.monotonic()
        accepted_s = wait_until(lambda: link.reports_accepted > link1["reports_accepted"], 20.0,
                                "a report accepted after SIGCONT")
        # Caught up: every message sent since (but one in flight) has its result.
        caught_up_s = wait_until(
            lambda: link_counters(link)["outstanding"] <= link0["outstanding"] + 1, 20.0,
            "the controller to answer the reports sent while it was frozen")
        self.wait_policy()
        policy_s = time.monotonic() - t_thaw
        d = diff(link_counters(link), link0)
        after = self.steps(seconds)
        return {
            "kind": "sigstop",
            "seconds": seconds,
            **self._versus_normal(before, frozen, after),
            "submit_while_frozen": self.submits.stats(mark, end),
            "fail_static_while_frozen": fail_static,
            "submitted_while_frozen": link1["submitted"] - link0["submitted"],
            "sent_while_frozen": (link1["reports_sent"] + link1["heartbeats_sent"]
                                  - link0["reports_sent"] - link0["heartbeats_sent"]),
            "queue_size": int(self.pilot.config.queue_size),
            "first_accepted_after_thaw_s": accepted_s,
            "caught_up_after_thaw_s": caught_up_s + accepted_s,
            "policy_after_thaw_s": policy_s,
            "link": d,
            "load": self.load.counts().minus(load0).as_dict(),
            "errors_logged": ctl.error_lines(since=t_thaw - seconds),
        }

    def _versus_normal(self, before: StepWindow, fault: StepWindow,
                       after: StepWindow) -> dict[str, Any]:
        """Step times of a fault's window against the normal windows just before and after."""
        batch = self.load.batch_size
        normal, faulty = step_stats([before, after], batch), step_stats([fault], batch)
        return {"normal": normal, "fault": faulty, "ratio": ratios(faulty, normal),
                "normal_before": step_stats([before], batch),
                "normal_after": step_stats([after], batch)}

    def cut(self) -> dict[str, Any]:
        """The stream cut through the proxy in the middle of a report: the engine reconnects."""
        link, ctl = self.link, self.controller
        self.wait_policy()
        load0, link0 = self.load.counts(), settled_counters(link)
        since = time.monotonic()
        self.proxy.cut_mid_message()
        wait_until(self.proxy.cut.is_set, 10.0, "the proxy to cut a report")
        t_cut = time.monotonic()
        reconnect_s = wait_until(lambda: link.connects > link0["connects"] and link.connected,
                                 20.0, "the engine's reconnect through the proxy")
        accepted = link.reports_accepted
        self.wait_accepted_after(accepted)
        self.wait_policy()
        flowing_s = time.monotonic() - t_cut
        time.sleep(0.3)  # anything the controller logs about the cut stream
        return {
            "kind": "cut",
            "cut": dict(self.proxy.cut_info),
            "reconnect_s": reconnect_s,
            "reports_flowing_s": flowing_s,
            "link": diff(settled_counters(link), link0),
            "load": self.load.counts().minus(load0).as_dict(),
            "errors_logged": ctl.error_lines(since=since),
            "controller_lines": [line for at, line in ctl.stderr if at >= since
                                 and "audit" not in line][:20],
        }

    def flood(self, seconds: float, streams: int = 16) -> dict[str, Any]:
        """``streams`` synthetic engines flooding the controller for ``seconds`` while the
        engine serves: its step times against normal windows of the same length just before and
        after, the controller's health checked throughout, and the engine's link once the flood
        is over (every report it sent answered)."""
        link, ctl = self.link, self.controller
        self.wait_policy()
        load0 = self.load.counts()
        with health_sampler(ctl) as quiet:
            before = self.steps(seconds)
        link0 = link_counters(link)
        flood = start_flood(ctl.grpc_target, streams, seconds + 1.0, self.pilot.engine.drafter,
                            nice=self.nice)
        try:
            with health_sampler(ctl) as loaded:
                time.sleep(0.5)  # the streams open
                mark = self.submits.mark()
                fault = self.steps(seconds)
                end = self.submits.mark()
                fail_static = bool(self.pilot.view.fail_static)
            flooded = flood.result()
        finally:
            flood.stop()
        t_end = time.monotonic()
        accepted = link.reports_accepted
        wait_until(lambda: link.connected and link.reports_accepted > accepted, 30.0,
                   "a report accepted after the flood")
        recovered_s = time.monotonic() - t_end
        caught_up_s = wait_until(
            lambda: link_counters(link)["outstanding"] <= link0["outstanding"] + 1, 30.0,
            "the controller to answer the engine's reports sent during the flood")
        self.wait_policy(30.0)
        d = diff(link_counters(link), link0)
        after = self.steps(seconds)
        return {
            "kind": "overload",
            "seconds": seconds,
            "streams": streams,
            **self._versus_normal(before, fault, after),
            "flood": flooded,
            "health_quiet": latency_stats(quiet),
            "health_flooded": latency_stats(loaded),
            "submit_during_flood": self.submits.stats(mark, end),
            "fail_static_during_flood": fail_static,
            "report_accepted_after_flood_s": recovered_s,
            "caught_up_after_flood_s": caught_up_s + recovered_s,
            "link": d,
            "load": self.load.counts().minus(load0).as_dict(),
            "errors_logged": ctl.error_lines(since=t_end - seconds - 2.0),
        }


@contextlib.contextmanager
def fault_rig(target: Path, draft: Path, reference: Sequence[Sequence[int]],
              prompts: Sequence[str] = PROMPTS, max_tokens: int = 32, nice: int = 0,
              settings: Mapping[str, object] = FAST_SETTINGS,
              plugin: Mapping[str, str] = FAST_PLUGIN) -> Iterator[FaultRig]:
    """The controller (a child process), the proxy in front of it, an engine on ``target`` with
    ``draft`` (K=4) and the plugin pointed at the proxy, the step recorder, and the load (started
    once the engine runs the controller's policy). ``reference``: the greedy outputs of
    ``prompts`` without speculation."""
    from benchmarks.demo.engine import SCHEDULER, llm_session, plugin_environment

    controller = ControllerProcess(settings=settings, nice=nice)
    proxy = TcpProxy(controller.grpc_port)
    rig: FaultRig | None = None
    try:
        controller.pin_all(4)
        spec = {"model": draft, "num_speculative_tokens": 4}
        with plugin_environment({"controller": proxy.target, **plugin}), llm_session(
                target, spec, SCHEDULER) as llm:
            recorder = install_step_recorder(llm)
            load = Load(llm, prompts, reference, max_tokens)
            rig = FaultRig(llm, proxy, controller, load, recorder,
                           SubmitTimer(pilot_of(llm).link), nice, settings)
            rig.wait_policy(30.0)
            load.start()
            wait_until(lambda: load.counts().batches >= 2, 60.0, "the first batches of the load")
            try:
                yield rig
            finally:
                load.stop()
    finally:
        proxy.close()
        if rig is not None:
            rig.controller.close()
        controller.close()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="the flood child of the fault injection")
    commands = parser.add_subparsers(dest="command", required=True)
    flood = commands.add_parser("flood", help="synthetic engine streams, reports as fast as "
                                "they go; prints its counts as JSON")
    flood.add_argument("--target", required=True)
    flood.add_argument("--streams", type=int, default=16)
    flood.add_argument("--seconds", type=float, default=10.0)
    flood.add_argument("--draft", default="draft")
    flood.add_argument("--classes", type=int, default=8)
    flood.add_argument("--nice", type=int, default=0, help="CPU priority to flood at")
    args = parser.parse_args(argv)
    stats = asyncio.run(_flood(args.target, args.streams, args.seconds, args.draft,
                               args.classes, args.nice))
    print(json.dumps(stats), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
