"""One controller per port: a second ``specpilot serve`` on a port the first holds exits at once,
naming the port and the process that holds it. Control: grpcio's default SO_REUSEPORT let the
second start on the first's gRPC port (both listened, the kernel split the connections), and a
taken HTTP port was reported without its holder."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from specpilot.controller.server.ports import (
    Holder,
    PortUse,
    holding_inodes,
    in_use_message,
    taken_by,
)

pytestmark = pytest.mark.integration
SPECPILOT = str(Path(sys.executable).with_name("specpilot"))
STARTUP_SECONDS = 30.0


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("SPECPILOT_")}


@pytest.fixture(scope="module")
def first() -> Iterator[tuple[subprocess.Popen[str], int, int]]:
    """A real controller on free ports: (process, gRPC port, HTTP port)."""
    proc = subprocess.Popen([SPECPILOT, "serve", "--grpc-port", "0", "--http-port", "0"],
                            env=_env(), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True)
    try:
        assert proc.stdout is not None
        grpc_line, http_line = proc.stdout.readline(), proc.stdout.readline()
        assert "grpc listening on 127.0.0.1:" in grpc_line, grpc_line
        assert "http listening on http://127.0.0.1:" in http_line, http_line
        yield proc, int(grpc_line.rsplit(":", 1)[1]), int(http_line.rsplit(":", 1)[1])
    finally:
        proc.kill()
        proc.wait(10)


@pytest.mark.parametrize(("listener", "flag", "other"), [
    ("gRPC", "--grpc-port", "--http-port"),
    ("HTTP", "--http-port", "--grpc-port"),
])
def test_a_second_controller_on_a_taken_port_exits_naming_the_holder(
        first: tuple[subprocess.Popen[str], int, int], listener: str, flag: str,
        other: str) -> None:
    holder, grpc_port, http_port = first
    port = grpc_port if listener == "gRPC" else http_port
    second = subprocess.Popen([SPECPILOT, "serve", flag, str(port), other, "0"], env=_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = second.communicate(timeout=STARTUP_SECONDS)
    except subprocess.TimeoutExpired:
        second.kill()
        out, err = second.communicate()
        raise AssertionError(f"a second controller started on {listener} port {port}: "
                             f"{out!r}") from None
    assert second.returncode == 1, (out, err)
    assert "listening" not in out
    (line,) = err.splitlines()  # one line, and nothing from gRPC's own log
    assert line.startswith(f"specpilot: cannot listen for {listener} on 127.0.0.1:{port}: "
                           f"port {port} is in use by pid {holder.pid} ("), line
    assert "specpilot serve" in line and f"pass another port with {flag} N" in line, line
    assert "0 picks a free one" in line and "stop that process" in line, line
    assert holder.poll() is None  # the first one serves on


def test_the_holder_is_found_from_proc(first: tuple[subprocess.Popen[str], int, int]) -> None:
    holder, grpc_port, http_port = first
    for port in (grpc_port, http_port):
        use = taken_by(port)
        assert [h.pid for h in use.holders] == [holder.pid]
        assert "serve" in use.holders[0].command


def test_proc_tables_and_messages_without_a_holder() -> None:
    table = (
        "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  "
        "timeout inode\n"
        "   0: 0100007F:C351 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1000 "
        "       0 4242 1 0000000000000000 100 0 0 10 0\n"
        "   1: 0100007F:C351 0100007F:9C40 06 00000000:00000000 03:00000D5C 00000000     0 "
        "       0 0 3 0000000000000000\n"
        "   2: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0 "
        "       0 77 1 0000000000000000 100 0 0 10 0\n")
    assert holding_inodes(table, 50001) == {4242: 1000}  # TIME_WAIT holds nothing
    assert holding_inodes(table, 8080) == {77: 0}
    hidden = in_use_message("gRPC", "0.0.0.0:50001", 50001, "grpc_port", "--grpc-port N",
                            PortUse(("alice",), ()), own_pid=1)
    assert "by a process of alice that this user cannot see" in hidden
    assert "ss -ltnp 'sport = :50001'" in hidden and "--grpc-port N" in hidden
    unknown = in_use_message("HTTP", "0.0.0.0:9464", 9464, "http_port", "--http-port N",
                             PortUse((), ()), own_pid=1)
    assert "could not be found here" in unknown and "stop what holds it" in unknown
    shown = in_use_message("HTTP", "[::]:9464", 9464, "http_port", "--http-port N",
                           PortUse(("bob",), (Holder(7, "vllm\nserve"),)), own_pid=1)
    assert "by pid 7 ('vllm\\nserve')" in shown and "\n" not in shown
