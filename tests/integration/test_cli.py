"""The ``specpilot`` command: ``serve`` as a real subprocess, the policy commands against a real
server, and start-up with a bad setting."""

from __future__ import annotations

import asyncio
import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from benchmarks.redis_servers import RedisServer
from specpilot.controller import cli
from specpilot.controller.server.app import RunningServer, start_server
from specpilot.controller.settings import load_settings, settings_reference
from specpilot.controller.store.redis_store import RedisStore
from specpilot.v1 import common_pb2, engine_pb2
from tests.integration.conftest import FAST_SETTINGS, TOKEN, snapshot
from tests.integration.engine_client import DRAFT, EngineClient, acceptance, hello, report

pytestmark = pytest.mark.integration
SPECPILOT = str(Path(sys.executable).with_name("specpilot"))
STARTUP_SECONDS = 30.0


def _env(**extra: str) -> dict[str, str]:
    """The caller's environment without SPECPILOT_* settings, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECPILOT_")}
    return {**env, **extra}


class _Lines:
    """Lines of a subprocess's stdout, readable with a timeout."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self._queue: queue.Queue[str] = queue.Queue()
        assert proc.stdout is not None
        stdout = proc.stdout

        def pump() -> None:
            for line in stdout:
                self._queue.put(line)

        threading.Thread(target=pump, daemon=True).start()

    def next(self, timeout: float) -> str:
        try:
            return self._queue.get(timeout=timeout).rstrip("\n")
        except queue.Empty:
            raise AssertionError(f"no output within {timeout} s") from None


@pytest.fixture
def serve() -> Iterator[tuple[subprocess.Popen[str], _Lines]]:
    proc = subprocess.Popen(
        # "chat" declared: operators may override it before an engine reports it.
        [SPECPILOT, "serve", "--grpc-port", "0", "--http-port", "0"],
        env=_env(SPECPILOT_DECLARED_CLASSES='["chat"]'), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)
    try:
        yield proc, _Lines(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


def test_serve_prints_its_ports_answers_and_stops_on_sigterm(
    serve: tuple[subprocess.Popen[str], _Lines],
) -> None:
    proc, lines = serve
    grpc_line = lines.next(STARTUP_SECONDS)
    http_line = lines.next(5)
    dashboard_line = lines.next(5)
    token_line = lines.next(5)
    assert grpc_line.startswith("specpilot: grpc listening on 127.0.0.1:"), grpc_line
    assert http_line.startswith("specpilot: http listening on http://127.0.0.1:"), http_line
    assert dashboard_line.startswith(f"specpilot: dashboard at {http_line.rsplit(' ', 1)[1]}/")
    target = grpc_line.rsplit(" ", 1)[1]
    assert int(target.rsplit(":", 1)[1]) > 0
    assert "policy token" in token_line
    token = token_line.rsplit(" ", 1)[1]
    assert len(token) >= 24

    got = subprocess.run([SPECPILOT, "policy", "--target", target, "get"], env=_env(),
                         capture_output=True, text=True, timeout=30)
    assert got.returncode == 0, got.stderr
    # No decision yet: the version is the epoch's first (the start time in 0.1 s x 2^16).
    version = int(got.stdout.split("policy version ", 1)[1].split(";", 1)[0])
    assert version >> 16 > 17_000_000_000 and version & (2**16 - 1) == 0, got.stdout
    assert "engines: none" in got.stdout

    written = subprocess.run(
        [SPECPILOT, "policy", "--target", target, "set", "--class", "chat", "--force-off"],
        env=_env(SPECPILOT_POLICY_TOKEN=token), capture_output=True, text=True, timeout=30)
    assert written.returncode == 0, written.stderr
    assert written.stdout.startswith("override on chat: force off")

    proc.send_signal(signal.SIGTERM)
    assert proc.wait(15) == 0
    assert lines.next(5) == "specpilot: stopping"


async def test_a_sidecar_stopped_after_its_engine_left_publishes_what_it_learnt(
        redis: RedisServer) -> None:
    """A pod's stop order: the engine stops first, the sidecar (native, so last) gets SIGTERM
    after it. No fleet_model: the model is known from the engine's hello only."""
    proc = subprocess.Popen(
        [SPECPILOT, "serve", "--grpc-port", "0", "--http-port", "0"],
        env=_env(SPECPILOT_STATE_STORE=redis.url, SPECPILOT_SIDECAR_ID="pod-a",
                 SPECPILOT_FLEET_FLUSH_INTERVAL_SECONDS="60"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    store = RedisStore.from_url(redis.url)
    try:
        target = _Lines(proc).next(STARTUP_SECONDS).rsplit(" ", 1)[1]

        async def published_at() -> float:
            own = [ex for ex in await store.evidence("tiny-target", since=0.0)
                   if ex.sidecar == "pod-a"]
            assert not own or own[0].entries[0].accepts[0] == pytest.approx(450, rel=0.02)
            return own[0].at if own else 0.0

        async with grpc.aio.insecure_channel(target) as ch:
            engine = EngineClient(ch)
            await engine.connect(hello("pod-a"))
            for seq in range(1, 6):  # 100 steps, 90 accepted at position 1
                assert (await engine.send(report(seq, acceptance("chat", (10, 20, 70))))).accepted
            await engine.close()  # the engine container stopped
        deadline = time.monotonic() + 10.0
        while not await published_at():  # published when the engine left
            assert time.monotonic() < deadline, "nothing published after the engine left"
            await asyncio.sleep(0.05)
        stopped_at = time.time()
        proc.send_signal(signal.SIGTERM)  # then the sidecar
        assert proc.wait(15) == 0
        assert await published_at() >= stopped_at  # and once more at its graceful stop
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
        await store.close()


@pytest.mark.parametrize(("args", "env", "name"), [
    (["--grpc-port", "70000"], {}, "grpc_port"),
    (["--http-port", "not-a-port"], {}, "http_port"),
    (["--set", "warmup_k=99"], {}, "warmup_k"),
    (["--set", "no_such_setting=1"], {}, "no_such_setting"),
    ([], {"SPECPILOT_HALF_LIFE_SECONDS": "-5"}, "half_life_seconds"),
])
def test_a_bad_setting_exits_non_zero_with_one_line_naming_it(
    args: list[str], env: dict[str, str], name: str
) -> None:
    proc = subprocess.run([SPECPILOT, "serve", *args], env=_env(**env), capture_output=True,
                          text=True, timeout=30)
    assert proc.returncode == 2
    assert proc.stdout == ""
    (line,) = proc.stderr.splitlines()
    assert line.startswith(f"specpilot: bad setting {name}: "), line


def test_a_port_in_use_exits_non_zero_with_one_line() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run([SPECPILOT, "serve", "--grpc-port", "0", "--http-port", str(port)],
                              env=_env(), capture_output=True, text=True, timeout=30)
    assert proc.returncode == 1
    (line,) = proc.stderr.splitlines()
    assert line.startswith(f"specpilot: cannot listen for HTTP on 127.0.0.1:{port}"), line


# --- policy commands against the in-process server ---------------------------------------------
async def _cli(capsys: pytest.CaptureFixture[str], server: RunningServer,
               *args: str) -> tuple[int, str, str]:
    """Run ``specpilot policy --target <server> <args>`` in a thread (the server needs the loop)."""
    code = await asyncio.to_thread(cli.main, ["policy", "--target", server.grpc_target, *args])
    out, err = capsys.readouterr()
    return code, out, err


async def test_policy_commands(
    server: RunningServer, channel: grpc.aio.Channel, capsys: pytest.CaptureFixture[str]
) -> None:
    engine = EngineClient(channel)
    await engine.connect()
    assert (await engine.send(report(1))).accepted

    code, out, _ = await _cli(capsys, server, "get")
    assert code == 0
    assert "engines: engine-1" in out
    # Batch ranges by their sizes, as everywhere else: 1, 2, 3-4, ..., 129+.
    batches = {line.split()[1] for line in out.splitlines() if line.startswith("chat ")}
    assert {"1", "3-4", "17-32", "129+"} <= batches
    # The estimates table: position 1 of (10, 20, 70) was tried 100 times.
    (row,) = [cells for line in out.splitlines()
              if (cells := line.split())[:3] == ["chat", DRAFT, "100"]]
    assert float(row[4]) == pytest.approx(91 / 102, abs=0.005)

    code, out, _ = await _cli(capsys, server, "get", "--class", "chat", "--json")
    assert code == 0
    body = json.loads(out)
    assert [c["traffic_class"] for c in body["classes"]] == ["chat"]

    code, _, err = await _cli(capsys, server, "set", "--class", "chat", "--pin-k", "1")
    assert code == 1 and "pass --token TOKEN or set SPECPILOT_POLICY_TOKEN" in err
    code, out, _ = await _cli(capsys, server, "--token", TOKEN, "set", "--class", "chat",
                              "--pin-k", "1", "--note", "canary")
    assert code == 0 and out.startswith("override on chat: pin K=1 (canary); policy version")
    assert [(o.traffic_class, o.pin_k) for o in snapshot(server).overrides] == [("chat", 1)]

    code, out, _ = await _cli(capsys, server, "explain", "--class", "chat")
    assert code == 0
    assert "reason: override" in out and "E[TOKENS]" in out
    chosen = [line for line in out.splitlines() if line.startswith("*")]
    assert chosen == [next(line for line in out.splitlines() if f"{DRAFT} K=1 " in line)]

    # --batch takes a batch size or a range; both name the same bucket, anything else is refused.
    code, by_size, _ = await _cli(capsys, server, "explain", "--class", "chat", "--batch", "24")
    code2, by_range, _ = await _cli(capsys, server, "explain", "--class", "chat",
                                    "--batch", "17-32")
    assert code == code2 == 0 and "at batch size" in by_size
    assert by_size.split("\n\n")[1:] == by_range.split("\n\n")[1:]
    code, _, err = await _cli(capsys, server, "explain", "--class", "chat", "--batch", "5-9")
    assert code == 2 and "17-32" in err and "129+" in err

    code, out, _ = await _cli(capsys, server, "--token", TOKEN, "clear", "--class", "chat")
    assert code == 0 and "cleared" in out and snapshot(server).overrides == ()

    code, _, err = await _cli(capsys, server, "explain", "--class", "nope")
    assert code == 1 and "unknown class 'nope'" in err and "specpilot policy get" in err
    await engine.close()


async def test_policy_watch_prints_a_decision_after_an_override(
    server: RunningServer, channel: grpc.aio.Channel
) -> None:
    engine = EngineClient(channel)
    await engine.connect()
    assert (await engine.send(report(1))).accepted
    proc = subprocess.Popen(
        [SPECPILOT, "policy", "--target", server.grpc_target, "watch", "--class", "chat"],
        env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lines = _Lines(proc)
        # The replayed log comes first; the override's decision follows.
        first = await asyncio.to_thread(lines.next, STARTUP_SECONDS)
        assert "  chat  " in first
        # Batch ranges by their sizes, as policy get and the metrics name them.
        assert re.search(r"  batch (\d+|\d+-\d+|\d+\+)  ", first), first
        code = await asyncio.to_thread(cli.main, [
            "policy", "--target", server.grpc_target, "--token", TOKEN, "set",
            "--class", "chat", "--force-off"])
        assert code == 0
        deadline = time.monotonic() + 10
        while "(override" not in (line := await asyncio.to_thread(lines.next, 10)):
            assert time.monotonic() < deadline
        assert "-> off" in line
        proc.send_signal(signal.SIGINT)
        assert await asyncio.to_thread(proc.wait, 10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    await engine.close()


def test_settings_shows_the_reference_and_the_settings_in_effect(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert cli.main(["settings", "--markdown"]) == 0
    assert capsys.readouterr().out == settings_reference()

    monkeypatch.setenv("SPECPILOT_GRPC_PORT", "6000")
    monkeypatch.setenv("SPECPILOT_POLICY_TOKEN", "very-secret")
    assert cli.main(["settings"]) == 0
    out = capsys.readouterr().out
    assert "grpc_port: 6000\n" in out
    assert "very-secret" not in out


async def test_connection_options_work_after_the_action(
    server: RunningServer, capsys: pytest.CaptureFixture[str]
) -> None:
    # Before the action they are the defaults; after it they override them.
    args = ["policy", "--target", "127.0.0.1:9", "get", "--target", server.grpc_target,
            "--timeout", "5"]
    code = await asyncio.to_thread(cli.main, args)
    out, _ = capsys.readouterr()
    assert code == 0 and "policy version" in out
    code = await asyncio.to_thread(cli.main, ["policy", "get", "--target", "127.0.0.1:9",
                                              "--timeout", "1"])
    _, err = capsys.readouterr()
    assert code == 1 and "127.0.0.1:9" in err


async def test_check_waits_for_health_and_the_engines(server: RunningServer,
                                                      channel: grpc.aio.Channel) -> None:
    """`specpilot check` (the Helm chart's test hook): 1 while no engine is connected, 0 once
    one is."""
    args = ["check", "--target", server.grpc_target, "--expect-engines", "1", "--timeout", "0"]
    assert await asyncio.to_thread(cli.main, args) == 1
    engine = EngineClient(channel)
    await engine.connect()
    assert await asyncio.to_thread(cli.main, args) == 0
    await engine.close()


def test_tokens_are_refused_on_the_command_line() -> None:
    for name in ("policy_token", "engine_secret", "engine_token"):
        got = subprocess.run([SPECPILOT, "serve", "--set", f"{name}=s3cret"], env=_env(),
                             capture_output=True, text=True, timeout=60)
        assert got.returncode != 0
        assert f"{name} is a secret" in got.stderr and "s3cret" not in got.stderr
    got = subprocess.run([SPECPILOT, "serve", "--policy-token", "s3cret"], env=_env(),
                         capture_output=True, text=True, timeout=60)
    assert got.returncode != 0  # no such flag any more


async def test_engine_token_writes_the_token_a_controller_with_the_secret_takes_for_that_id(
        tmp_path: Path) -> None:
    secret = "engine-secret-0123456789abcdef-0123456789"
    path = tmp_path / "token"
    got = subprocess.run([SPECPILOT, "engine-token", "--id", "pod-a", "--output", str(path)],
                         env=_env(SPECPILOT_ENGINE_SECRET=secret), capture_output=True,
                         text=True, timeout=60)
    assert got.returncode == 0, got.stderr
    assert secret not in got.stdout + got.stderr
    assert path.stat().st_mode & 0o777 == 0o640
    auth = (("authorization", f"Bearer {path.read_text().strip()}"),)
    server = await start_server(load_settings(**FAST_SETTINGS, engine_secret=secret))
    try:
        async with grpc.aio.insecure_channel(server.grpc_target) as ch:
            await EngineClient(ch, auth).connect(hello("pod-a"))
            with pytest.raises(grpc.aio.AioRpcError) as other:
                await EngineClient(ch, auth).connect(hello("pod-b"))
            assert other.value.code() == grpc.StatusCode.PERMISSION_DENIED
    finally:
        await server.stop(grace_seconds=0.1)
    unset = subprocess.run([SPECPILOT, "engine-token", "--id", "pod-a"], env=_env(),
                           capture_output=True, text=True, timeout=60)
    assert unset.returncode == 2 and "SPECPILOT_ENGINE_SECRET" in unset.stderr


# --- failures say what to do next, in the command line's terms -----------------------------------
async def test_a_write_without_the_token_or_with_a_wrong_one_says_how_to_pass_it(
    server: RunningServer, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = await _cli(capsys, server, "set", "--class", "default", "--force-off")
    assert (code, out) == (1, "")
    assert err == ("specpilot: this command changes policy and needs the controller's policy "
                   "token: pass --token TOKEN or set SPECPILOT_POLICY_TOKEN (specpilot serve "
                   "prints it at start-up)\n")
    code, out, err = await _cli(capsys, server, "--token", "not-the-token", "clear",
                                "--class", "default")
    assert (code, out) == (1, "")
    assert err.startswith(f"specpilot: the controller at {server.grpc_target} refused this "
                          "policy token (--token or SPECPILOT_POLICY_TOKEN): pass its own")
    assert "Traceback" not in err and "not-the-token" not in err
    assert snapshot(server).overrides == ()


async def test_the_http_port_as_target_is_called_out(
    server: RunningServer, capsys: pytest.CaptureFixture[str]
) -> None:
    http = server.http_url.removeprefix("http://")
    code = await asyncio.to_thread(cli.main, ["policy", "--target", http, "get"])
    out, err = capsys.readouterr()
    assert (code, out) == (1, "")
    assert err == (f"specpilot: {http} answered, but not with gRPC: is it the controller's "
                   "HTTP port? The gRPC port is printed by specpilot serve (default "
                   "127.0.0.1:50051); pass --target HOST:GRPC_PORT\n")


def test_no_controller_at_the_target_says_how_to_start_or_find_one(
    capsys: pytest.CaptureFixture[str]
) -> None:
    with socket.socket() as free:  # a port nothing listens on once closed
        free.bind(("127.0.0.1", 0))
        target = f"127.0.0.1:{free.getsockname()[1]}"
    for argv in (["policy", "--target", target, "get"],
                 ["policy", "--target", target, "--token", TOKEN, "set", "--class", "c",
                  "--force-off"]):
        assert cli.main(argv) == 1
        out, err = capsys.readouterr()
        assert out == ""
        assert err == (f"specpilot: no controller at {target}: start one with specpilot serve, "
                       "or pass --target HOST:PORT (or set SPECPILOT_TARGET)\n")
    assert cli.main(["check", "--target", target, "--timeout", "0"]) == 1
    assert f"not ready after 0 s: no controller at {target}" in capsys.readouterr().err


async def test_a_forced_draft_must_be_offered_or_declared_with_or_without_engines(
    channel: grpc.aio.Channel, server: RunningServer, capsys: pytest.CaptureFixture[str]
) -> None:
    async def force(srv: RunningServer, draft: str) -> tuple[int, str, str]:
        return await _cli(capsys, srv, "--token", TOKEN, "set", "--class", "default",
                          "--force-draft", draft)

    code, out, err = await force(server, "nonexistent")  # no engine yet: refused all the same
    assert (code, out) == (1, "")
    assert err == (
        f"specpilot: the controller at {server.grpc_target} refused --force-draft: "
        "'nonexistent' is neither a draft a connected engine offers nor a declared one (known: "
        "none); declare it in the controller's settings and restart it (declared_drafts: "
        "[\"nonexistent\"] in the settings file, or SPECPILOT_DECLARED_DRAFTS="
        "'[\"nonexistent\"]'), or connect an engine that offers it\n")
    engine = EngineClient(channel)
    await engine.connect()
    code, _, err = await force(server, "nonexistent")
    assert code == 1 and f"(known: {DRAFT}, ngram)" in err
    code, out, _ = await force(server, DRAFT)
    assert code == 0 and out.startswith(f"override on default: force draft {DRAFT}")
    await engine.close()

    declared = await start_server(load_settings(**{**FAST_SETTINGS,
                                                   "declared_drafts": ["ngram"]}))
    try:
        code, _, err = await force(declared, "nonexistent")
        assert code == 1 and "(known: ngram)" in err
        code, out, _ = await force(declared, "ngram")
        assert code == 0 and out.startswith("override on default: force draft ngram")
    finally:
        await declared.stop(grace_seconds=0.1)


async def test_an_override_of_an_unknown_class_says_how_to_declare_it(
    server: RunningServer, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = await _cli(capsys, server, "--token", TOKEN, "set", "--class", "batch",
                                "--force-off")
    assert (code, out) == (1, "")
    assert err == (
        f"specpilot: the controller at {server.grpc_target} refused --class: 'batch' is neither "
        "a class an engine has reported nor a declared one; declare it in the controller's "
        "settings and restart it (declared_classes: [\"batch\"] in the settings file, or "
        "SPECPILOT_DECLARED_CLASSES='[\"batch\"]'), or send a request of that class first\n")


async def test_policy_watch_says_it_is_connected_and_then_keeps_quiet(
    server: RunningServer,
) -> None:
    proc = subprocess.Popen([SPECPILOT, "policy", "--target", server.grpc_target, "watch"],
                            env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        first = await asyncio.to_thread(proc.stderr.readline)
        assert first == (f"specpilot: watching decisions at {server.grpc_target} (Ctrl-C to "
                         "stop); none yet\n")
        await asyncio.sleep(1.0)  # idle: nothing more
        proc.send_signal(signal.SIGINT)
        out, err = await asyncio.to_thread(proc.communicate, timeout=10)
        assert (proc.returncode, out, err) == (0, "", "")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_a_settings_file_with_three_mistakes_reports_each_and_starts_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in [k for k in os.environ if k.startswith("SPECPILOT_")]:
        monkeypatch.delenv(name)
    bad = tmp_path / "bad.yaml"
    bad.write_text("grpc_port: 0\nhttp_port: 0\nhalf_life_secnds: 120\ndwell_seconds: soon\n"
                   "max_k: 0\n")
    assert cli.main(["serve", "--config", str(bad)]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.splitlines() == [
        f"specpilot: {bad}:3: bad setting half_life_secnds: not a setting; did you mean "
        "half_life_seconds?",
        f"specpilot: {bad}:4: bad setting dwell_seconds: should be a valid number, unable to "
        "parse string as a number, got 'soon'",
        f"specpilot: {bad}:5: bad setting max_k: should be greater than or equal to 1, got 0",
        "specpilot: 3 problems in the settings; nothing started",
    ]


def test_a_misspelt_variable_is_named_at_start_up(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    warning = ("specpilot: warning: SPECPILOT_HALF_LIFE_SECOND is not a specpilot setting or "
               "variable, so it is ignored; did you mean SPECPILOT_HALF_LIFE_SECONDS?")
    # serve: the warning, then the bad flag that stops it before it listens.
    got = subprocess.run([SPECPILOT, "serve", "--grpc-port", "70000"],
                         env=_env(SPECPILOT_HALF_LIFE_SECOND="120", SPECPILOT_TARGET="h:1",
                                  SPECPILOT_PLUGIN_K_MODE="batch"),
                         capture_output=True, text=True, timeout=60)
    assert got.returncode == 2
    assert got.stderr.splitlines() == [
        warning, "specpilot: bad setting grpc_port: should be less than or equal to 65535, "
        "got '70000' (from --grpc-port)"]
    # settings: warned too, and shown all the same.
    for name in [k for k in os.environ if k.startswith("SPECPILOT_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("SPECPILOT_HALF_LIFE_SECOND", "120")
    assert cli.main(["settings"]) == 0
    out, err = capsys.readouterr()
    assert err == warning + "\n" and "\nhalf_life_seconds: 300.0\n" in out


async def test_names_an_engine_chose_reach_the_terminal_escaped(
    server: RunningServer, channel: grpc.aio.Channel, capsys: pytest.CaptureFixture[str]
) -> None:
    """An engine id or draft name with an ANSI escape or a line break is printed escaped, so
    it cannot clear an operator's terminal or forge a line. Control: printed raw."""
    msg = hello("e1\x1b[2J\ncleared")
    msg.drafts[0].name = "d\x1b[31m"
    engine = EngineClient(channel)
    await engine.connect(msg)
    assert (await engine.send(report(1, acceptance(draft="d\x1b[31m")))).accepted
    code, out, _ = await _cli(capsys, server, "get")
    assert code == 0 and "\x1b" not in out and "cleared\n" not in out
    assert "'e1\\x1b[2J\\ncleared'" in out and "'d\\x1b[31m'" in out


# --- plausible figures or none ---------------------------------------------------------------
# A CPU n-gram engine's start-up profile, timed while other work shared its cores and cut short
# by its budget: (batch size, verified tokens, context tokens, milliseconds).
_NOISY_PROFILE = ((1, 1, 0, 20.5), (16, 16, 0, 42.7), (32, 32, 0, 71.7), (1, 5, 0, 15.6),
                  (1, 1, 512, 28.0), (16, 16, 512, 33.9), (32, 32, 512, 71.6),
                  (1, 5, 512, 22.4), (1, 2, 0, 30.2), (16, 32, 0, 112.8))


async def _cpu_ngram_engine(channel: grpc.aio.Channel) -> EngineClient:
    """An n-gram engine with that profile, after one request of class chat at batch 4, K=4."""
    msg = engine_pb2.EngineHello(
        engine_id="engine-1", model="smollm2", target_vocab_hash="vocab-0001", max_k=4,
        drafts=[engine_pb2.DraftInfo(name="ngram", kind=common_pb2.DRAFT_KIND_NGRAM, max_k=4)],
        capabilities=engine_pb2.EngineCapabilities(batch_wide_k=True,
                                                   ngram_counterfactual=True),
        engine_version="test", plugin_version="test", max_batch_size=256,
        step_profile=[engine_pb2.StepProfile(batch_size=b, verified_tokens=t, seconds=ms / 1e3,
                                             context_tokens=c)
                      for b, t, c, ms in _NOISY_PROFILE])
    engine = EngineClient(channel)
    await engine.connect(msg)
    result = await engine.send(engine_pb2.EngineReport(
        sequence=1, interval_seconds=2.0, running_requests=4,
        acceptance=[acceptance("chat", (10, 10, 10, 10, 10), draft="ngram")],
        step_timings=[engine_pb2.StepTiming(batch_bucket=2, draft="ngram", k=4, steps=20,
                                            sum_batch_size=80, sum_verified_tokens=400,
                                            sum_step_seconds=20 * 0.0849,
                                            sum_context_tokens=80 * 1365)]))
    assert result.accepted, result
    return engine


def _speedup_cells(out: str, cls: str) -> list[str]:
    """The SPEEDUP column of ``cls``'s rows of ``policy get``'s table."""
    lines = out.splitlines()
    top = next(i for i, line in enumerate(lines) if line.startswith("CLASS ") and "SPEEDUP" in line)
    header, rows = lines[top], lines[top + 1:]
    rows = rows[:rows.index("")] if "" in rows else rows
    start, end = header.index("SPEEDUP"), header.index("PROBE")
    return [row[start:end].strip() for row in rows if row.startswith(f"{cls} ")]


async def test_policy_get_shows_a_pinned_speedup_a_step_can_deliver(
    server: RunningServer, channel: grpc.aio.Channel, capsys: pytest.CaptureFixture[str]
) -> None:
    engine = await _cpu_ngram_engine(channel)
    code, _, _ = await _cli(capsys, server, "--token", TOKEN, "set", "--class", "chat",
                            "--pin-k", "2")
    assert code == 0
    code, out, _ = await _cli(capsys, server, "get", "--class", "chat")
    assert code == 0
    cells = _speedup_cells(out, "chat")
    assert len(cells) == 9, out
    for cell in cells:
        # A ratio a step of K=2 can deliver (at most 3 tokens a step, never a hundred plain
        # steps' time), or no ratio at all.
        if cell not in ("too little evidence", "slows the batch"):
            assert re.fullmatch(r"\d+\.\d\dx", cell), (cell, out)
            assert 0.01 <= float(cell[:-1]) <= 3.0, (cell, out)
    await engine.close()


async def test_policy_watch_prints_changes_only(
    server: RunningServer, channel: grpc.aio.Channel
) -> None:
    """Each line is a change of (draft, K), "<before> -> <after>" with two different arms, or a
    bucket's first decision, "first: <after>": never "off -> off"."""
    engine = await _cpu_ngram_engine(channel)
    logged = len(snapshot(server).log)
    assert logged > 0
    proc = subprocess.Popen(
        [SPECPILOT, "policy", "--target", server.grpc_target, "watch"],
        env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lines = _Lines(proc)
        replayed = [await asyncio.to_thread(lines.next, STARTUP_SECONDS)
                    for _ in range(logged)]
        firsts = 0
        for line in replayed:
            change = re.search(r"  batch \S+  (first: (\S.*?)|(\S.*?) -> (\S.*?))  \S", line)
            assert change, line
            if change.group(2) is not None:
                firsts += 1
            else:
                assert change.group(3) != change.group(4), line
        assert firsts >= 9, replayed  # every bucket of class chat, at least
        proc.send_signal(signal.SIGINT)
        assert await asyncio.to_thread(proc.wait, 10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    await engine.close()
