"""The policy commands at their edges, as real subprocesses against a real server: a pin above
what the engines offer, a pin before any engine, and a reader that stops reading early."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from specpilot.controller.server.app import RunningServer, start_server
from specpilot.controller.settings import load_settings
from tests.integration.conftest import FAST_SETTINGS, TOKEN, snapshot
from tests.integration.engine_client import EngineClient, acceptance, report

pytestmark = pytest.mark.integration
SPECPILOT = str(Path(sys.executable).with_name("specpilot"))
# What the CLI exits with when its reader left: 128 + SIGPIPE, as a shell reports it.
STDOUT_CLOSED = 141
# The smallest pipe Linux makes: the output below does not fit, so the CLI is still writing
# when the reader leaves (a 64 KiB default pipe would take it all before).
PIPE_BYTES = 4096


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("SPECPILOT_")}


async def _policy(server: RunningServer, *args: str) -> subprocess.CompletedProcess[str]:
    return await asyncio.to_thread(
        subprocess.run, [SPECPILOT, "policy", "--target", server.grpc_target, *args],
        env=_env(), capture_output=True, text=True, timeout=60)


async def test_pin_above_the_engines_largest_k_is_refused_and_before_any_engine_capped() -> None:
    """Control: `policy set --pin-k 6` beside an engine offering K up to 4 exited 0 ("override
    on chat: pin K=6"), and the policy then showed and ran K=4."""
    server = await start_server(load_settings(**{**FAST_SETTINGS, "declared_classes": ["chat"]}))
    try:
        early = await _policy(server, "--token", TOKEN, "set", "--class", "chat", "--pin-k", "6")
        assert early.returncode == 0, early.stderr
        assert early.stdout.startswith("override on chat: pin K=6; policy version")
        assert ("no engine is connected yet: K=6 is capped at the largest K an engine offers "
                "once one connects") in early.stdout
        async with grpc.aio.insecure_channel(server.grpc_target) as channel:
            engine = EngineClient(channel)
            await engine.connect()  # K up to 4
            assert (await engine.send(report(1))).accepted
            refused = await _policy(server, "--token", TOKEN, "set", "--class", "chat",
                                    "--pin-k", "6")
            assert refused.returncode == 1 and refused.stdout == ""
            (line,) = refused.stderr.splitlines()
            assert line.startswith(f"specpilot: the controller at {server.grpc_target} refused "
                                   "--pin-k: 6 is above 4, the largest K the connected engines "
                                   "offer: pin 4 or less"), line
            taken = await _policy(server, "--token", TOKEN, "set", "--class", "chat",
                                  "--pin-k", "4")
            assert taken.returncode == 0 and "capped" not in taken.stdout, taken
            assert [o.pin_k for o in snapshot(server).overrides] == [4]
            await engine.close()
    finally:
        await server.stop(grace_seconds=0.1)


def _read_one_line_then_close(fd: int) -> bytes:
    """Read up to the first newline, a byte at a time (nothing beyond it), and close."""
    line = b""
    try:
        while not line.endswith(b"\n") and (byte := os.read(fd, 1)):
            line += byte
    finally:
        os.close(fd)
    return line


def _small_pipe() -> tuple[int, int]:
    read, write = os.pipe()
    fcntl.fcntl(write, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
    return read, write


@contextlib.asynccontextmanager
async def _into_a_reader_that_leaves(server: RunningServer, *args: str
                                     ) -> AsyncIterator[tuple[subprocess.Popen[str], bytes]]:
    """``specpilot policy ARGS`` writing into a small pipe whose reader closes after the first
    line: the process and that line; the process is killed afterwards if still running."""
    read, write = _small_pipe()
    proc = subprocess.Popen([SPECPILOT, "policy", "--target", server.grpc_target, *args],
                            env=_env(), stdout=write, stderr=subprocess.PIPE, text=True)
    os.close(write)
    try:
        yield proc, await asyncio.to_thread(_read_one_line_then_close, read)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


async def _engine_with_two_classes(channel: grpc.aio.Channel) -> EngineClient:
    engine = EngineClient(channel)
    await engine.connect()
    assert (await engine.send(report(1, acceptance("chat"), acceptance("code")))).accepted
    return engine


async def test_policy_get_into_a_reader_that_leaves_early_exits_quietly(
        server: RunningServer, channel: grpc.aio.Channel) -> None:
    """`specpilot policy get --json | head -1`. Control: a BrokenPipeError traceback, exit 1."""
    engine = await _engine_with_two_classes(channel)
    async with _into_a_reader_that_leaves(server, "get", "--json") as (proc, first):
        assert first == b"{\n"
        _, err = await asyncio.to_thread(proc.communicate, timeout=60)
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
    assert err == "" and proc.returncode == STDOUT_CLOSED
    await engine.close()


async def test_policy_watch_into_a_reader_that_leaves_early_exits_quietly(
        server: RunningServer, channel: grpc.aio.Channel) -> None:
    """`specpilot policy watch | head -1`: ends at its next decision. Control: a
    BrokenPipeError traceback, exit 1."""
    engine = await _engine_with_two_classes(channel)
    async with _into_a_reader_that_leaves(server, "watch", "--json") as (proc, first):
        assert first.startswith(b"{") and first.endswith(b"}\n")
        # New decisions for the watch to write where nobody reads any more.
        set_ = await _policy(server, "--token", TOKEN, "set", "--class", "*", "--force-off")
        assert set_.returncode == 0, set_.stderr
        _, err = await asyncio.to_thread(proc.communicate, timeout=30)
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
    assert proc.returncode == STDOUT_CLOSED, err
    await engine.close()
