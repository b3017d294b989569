"""The controller as a sidecar process next to the demo's engine, read through its own API.

The demo and the benchmark run the engine in their own process; the controller runs as
``specpilot serve`` in a child process, as it does beside a real engine, so its decide rounds
never compete with the engine's Python thread for the interpreter lock. Everything the demo
shows about the controller comes from its HTTP endpoints (``/api/policy``, ``/metrics``), the
same ones an operator reads.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Mapping
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from benchmarks.demo.calibration import CalibrationRow, calibration_rows
from specpilot.contract.buckets import parse_batch

_LISTEN = re.compile(r"specpilot: (grpc|http) listening on (\S+)")
START_TIMEOUT_SECONDS = 30.0


class SidecarError(RuntimeError):
    pass


class Sidecar:
    """``specpilot serve`` in a child process on free loopback ports (or the ones given), with
    the policy token ``token`` (``SPECPILOT_POLICY_TOKEN`` where set, else a new one)."""

    def __init__(self, settings: Mapping[str, Any], grpc_port: int = 0,
                 http_port: int = 0) -> None:
        self.token = os.environ.get("SPECPILOT_POLICY_TOKEN") or secrets.token_urlsafe(24)
        command = [sys.executable, "-c", "import sys; from specpilot.controller.cli import main; "
                   "sys.exit(main())", "serve", "--grpc-port", str(grpc_port),
                   "--http-port", str(http_port), "--log-level", "warning"]
        for name, value in settings.items():
            command += ["--set", f"{name}={json.dumps(value)}"]
        # One BLAS thread: the controller's numpy work is small, and the engine needs the cores.
        env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
               "SPECPILOT_POLICY_TOKEN": self.token}
        self._process = subprocess.Popen(command, stdout=subprocess.PIPE,
                                         stderr=subprocess.STDOUT, text=True, env=env)
        self.target, self.http_url = self._wait_for_addresses()
        self._drain = threading.Thread(target=self._forward_output, daemon=True,
                                       name="sidecar-output")
        self._drain.start()

    def _wait_for_addresses(self) -> tuple[str, str]:
        found: dict[str, str] = {}
        lines: list[str] = []
        deadline = time.monotonic() + START_TIMEOUT_SECONDS
        assert self._process.stdout is not None
        while len(found) < 2 and time.monotonic() < deadline:
            line = self._process.stdout.readline()
            if not line:
                break
            lines.append(line.rstrip())
            match = _LISTEN.search(line)
            if match:
                found[match.group(1)] = match.group(2)
        if len(found) < 2:
            self.stop()
            raise SidecarError("the controller did not start:\n" + "\n".join(lines[-20:]))
        return found["grpc"], found["http"]

    def _forward_output(self) -> None:
        # Keep the pipe drained; warnings and errors of the controller reach the user (the
        # owner of this object prints the token itself, where it wants).
        assert self._process.stdout is not None
        for line in self._process.stdout:
            if "policy token" not in line:
                sys.stderr.write(f"[controller] {line}")

    def get(self, path: str, timeout: float = 5.0) -> bytes:
        with urllib.request.urlopen(self.http_url + path, timeout=timeout) as response:
            body: bytes = response.read()
        return body

    def policy(self) -> dict[str, Any]:
        """``/api/policy``: version, per-class decisions and estimates, engines."""
        data: dict[str, Any] = json.loads(self.get("/api/policy"))
        return data

    def version(self) -> int:
        return int(self.policy().get("version", 0))

    def metric(self, name: str) -> float:
        """The sum of a metric's samples named ``name`` in ``/metrics`` (0 when absent)."""
        return sum(self.labelled(name).values())

    def labelled(self, name: str, *labels: str) -> dict[tuple[str, ...], float]:
        """A metric's samples named ``name`` in ``/metrics``, by the values of ``labels``."""
        out: dict[tuple[str, ...], float] = {}
        for family in text_string_to_metric_families(self.get("/metrics").decode()):
            for s in family.samples:
                if s.name == name:
                    key = tuple(s.labels.get(label, "") for label in labels)
                    out[key] = out.get(key, 0.0) + s.value
        return out

    def cost_calibration(self) -> tuple[CalibrationRow, ...]:
        """The cost model's one-step-ahead counters (``specpilot_cost_model_*``), per batch
        range and K."""
        bounds = tuple(int(b) for b in self.policy().get("batch_bucket_upper_bounds", []))

        def counter(name: str) -> dict[tuple[int, int], float]:
            return {(parse_batch(bounds, b), int(k)): v for (b, k), v in self.labelled(
                f"specpilot_cost_model_{name}_total", "batch", "k").items()}

        return calibration_rows(counter("steps"), counter("predicted_seconds"),
                                counter("measured_seconds"), bounds)

    def stop(self) -> None:
        if self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
