"""Engine streams and their credentials. With engine_secret each engine presents its own token,
bound to its id: another engine's token opens neither its id nor a takeover of it. With the shared
engine_token or with none (loopback), a stream proves no identity, so it can never replace a
connected engine's stream; the rightful engine reconnects with its own token at once, and anyone
once the old stream has ended. A missing token is UNAUTHENTICATED, a wrong one PERMISSION_DENIED,
so no one without it can register an engine or move an estimate. Credential-free engine streams
are possible only on a loopback listener or by an explicit setting, and said at start-up."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import grpc
import pytest

from specpilot.controller.server.app import RunningServer, ServeError, start_server
from specpilot.controller.server.auth import engine_token
from specpilot.controller.settings import load_settings
from tests.integration.conftest import FAST_SETTINGS, snapshot
from tests.integration.engine_client import EngineClient, acceptance, hello, report

pytestmark = pytest.mark.integration
TOKEN = "engine-token-0123456789"
SECRET = "engine-secret-0123456789abcdef-0123456789"


def _bearer(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


def _own(engine_id: str) -> tuple[tuple[str, str], ...]:
    """Engine ``engine_id``'s own credential under SECRET."""
    return _bearer(engine_token(SECRET, engine_id))


async def _refusal(server: RunningServer, engine_id: str,
                   metadata: tuple[tuple[str, str], ...] | None) -> grpc.aio.AioRpcError:
    async with grpc.aio.insecure_channel(server.grpc_target) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as failure:
            await EngineClient(ch, metadata).connect(hello(engine_id))
        return failure.value


def _mean_accept(server: RunningServer) -> float:
    """Position-1 acceptance of class chat, draft-s: what a rogue's reports would move."""
    est = server.core.estimate("chat", "draft-s", 0.0)
    return float(est.alpha[0] / (est.alpha[0] + est.beta[0]))


# A stream's settings and the credential a rogue holds: none, the shared token, or another
# engine's own token; and the code it is refused with when it names the connected engine's id.
HIJACKS = {
    "loopback, no credential": ({}, None, None, grpc.StatusCode.ALREADY_EXISTS),
    "shared engine_token": ({"engine_token": TOKEN}, _bearer(TOKEN), _bearer(TOKEN),
                            grpc.StatusCode.ALREADY_EXISTS),
    "engine_secret, another engine's token": ({"engine_secret": SECRET}, _own("engine-1"),
                                              _own("engine-2"),
                                              grpc.StatusCode.PERMISSION_DENIED),
}


@pytest.mark.parametrize("case", HIJACKS)
async def test_a_connected_engine_cannot_be_taken_over(case: str) -> None:
    settings, victim_auth, rogue_auth, code = HIJACKS[case]
    server = await start_server(load_settings(**FAST_SETTINGS, **settings))
    try:
        async with grpc.aio.insecure_channel(server.grpc_target) as ch:
            victim = EngineClient(ch, victim_auth)
            await victim.connect(hello("engine-1"))
            for seq in range(1, 6):  # every draft token accepted
                assert (await victim.send(report(seq, acceptance("chat", (0, 0, 100))))).accepted
            learnt = _mean_accept(server)
            assert learnt > 0.9
            refused = await _refusal(server, "engine-1", rogue_auth)
            assert refused.code() == code, refused.details()
            # The victim's stream is intact: its reports are still answered and applied, no
            # rogue report moved its estimate, and it is still the one engine-1.
            assert (await victim.send(report(6, acceptance("chat", (0, 0, 100))))).accepted
            assert _mean_accept(server) >= learnt
            assert [e.engine_id for e in snapshot(server).engines] == ["engine-1"]
            outcome = ("already_connected" if code == grpc.StatusCode.ALREADY_EXISTS
                       else "permission_denied")
            assert f'specpilot_engine_hellos_total{{outcome="{outcome}"}} 1.0'.encode() \
                in server.metrics.render()
            await victim.close()
    finally:
        await server.stop(grace_seconds=0.1)


async def test_the_rightful_engine_reconnects_over_its_old_stream_and_others_only_their_own(
        ) -> None:
    server = await start_server(load_settings(**FAST_SETTINGS, engine_secret=SECRET))
    try:
        async with grpc.aio.insecure_channel(server.grpc_target) as ch:
            old = EngineClient(ch, _own("engine-1"))
            await old.connect(hello("engine-1"))
            # Restarted after a crash, its old stream not yet seen dead: its own token replaces
            # the old stream at once.
            new = EngineClient(ch, _own("engine-1"))
            await new.connect(hello("engine-1"))
            assert await asyncio.wait_for(old.call.code(), 5) == grpc.StatusCode.ABORTED
            # The old stream's end does not unregister the engine the new stream registered.
            await asyncio.sleep(0.05)
            assert [e.engine_id for e in snapshot(server).engines] == ["engine-1"]
            assert (await new.send(report(1))).accepted
            # Another engine's token opens its own id, and no id without a token.
            other = EngineClient(ch, _own("engine-2"))
            await other.connect(hello("engine-2"))
            assert {e.engine_id for e in snapshot(server).engines} == {"engine-1", "engine-2"}
            assert (await _refusal(server, "engine-3", _own("engine-2"))).code() \
                == grpc.StatusCode.PERMISSION_DENIED
            assert (await _refusal(server, "engine-3", None)).code() \
                == grpc.StatusCode.UNAUTHENTICATED
            await new.close()
            await other.close()
    finally:
        await server.stop(grace_seconds=0.1)


async def test_without_credentials_an_id_is_taken_again_once_its_stream_ended() -> None:
    server = await start_server(load_settings(**FAST_SETTINGS))
    try:
        async with grpc.aio.insecure_channel(server.grpc_target) as ch:
            first = EngineClient(ch)
            await first.connect(hello("engine-1"))
            await first.close()
            async def reconnected() -> bool:
                try:
                    again = EngineClient(ch)
                    await again.connect(hello("engine-1"))
                except grpc.aio.AioRpcError as exc:  # the old stream's end not yet processed
                    assert exc.code() == grpc.StatusCode.ALREADY_EXISTS
                    return False
                assert (await again.send(report(1))).accepted
                await again.close()
                return True
            for _ in range(50):
                if await reconnected():
                    break
                await asyncio.sleep(0.05)
            else:
                raise AssertionError("engine-1 could not reconnect after its stream ended")
    finally:
        await server.stop(grace_seconds=0.1)


async def test_credential_free_engine_streams_are_said_in_one_line_at_start_up(
        caplog: pytest.LogCaptureFixture) -> None:
    said = "engine streams need no credential: every local process"
    with caplog.at_level(logging.WARNING):
        server = await start_server(load_settings(**FAST_SETTINGS))
        await server.stop(grace_seconds=0.1)
    lines = [r.getMessage() for r in caplog.records if said in r.getMessage()]
    assert len(lines) == 1 and "set engine_secret" in lines[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        server = await start_server(load_settings(**FAST_SETTINGS, engine_secret=SECRET))
        await server.stop(grace_seconds=0.1)
    assert not [r for r in caplog.records if "need no credential" in r.getMessage()]


@pytest.mark.parametrize(("extra", "says"), [
    ({"engine_secret": "short"}, "fewer than 32"),
    ({"engine_secret": SECRET, "engine_token": TOKEN}, "both set"),
])
async def test_an_unusable_engine_secret_is_refused_at_start_up(extra: dict[str, Any],
                                                               says: str) -> None:
    with pytest.raises(ServeError, match=says) as refused:
        await start_server(load_settings(**FAST_SETTINGS, **extra))
    assert SECRET not in str(refused.value) and "short" not in str(refused.value)


async def _refused(target: str, metadata: tuple[tuple[str, str], ...] | None
                   ) -> grpc.StatusCode:
    async with grpc.aio.insecure_channel(target) as ch:
        client = EngineClient(ch, metadata)
        with pytest.raises(grpc.aio.AioRpcError) as failure:
            await client.connect(hello("engine-1"))
        return failure.value.code()


async def test_an_engine_needs_the_token_and_cannot_be_taken_over_without_it() -> None:
    server = await start_server(load_settings(**FAST_SETTINGS, engine_token=TOKEN))
    try:
        async with grpc.aio.insecure_channel(server.grpc_target) as ch:
            real = EngineClient(ch, (("authorization", f"Bearer {TOKEN}"),))
            await real.connect(hello("engine-1"))
            assert (await real.send(report(1, acceptance("chat", (10, 20, 70))))).accepted
            before = server.core.estimate("chat", "draft-s", 0.0).alpha
            # A rogue without the token, or with a wrong one, reusing the real engine's id.
            assert await _refused(server.grpc_target, None) == grpc.StatusCode.UNAUTHENTICATED
            assert await _refused(server.grpc_target, (("authorization", "Bearer nope"),)) \
                == grpc.StatusCode.PERMISSION_DENIED
            # The real engine's stream is untouched and its estimate unmoved.
            assert (await real.send(report(2))).accepted
            assert [e.engine_id for e in snapshot(server).engines] == ["engine-1"]
            assert server.core.estimate("chat", "draft-s", 0.0).alpha[0] >= before[0]
            rendered = server.metrics.render()
            assert b'specpilot_engine_hellos_total{outcome="unauthenticated"} 1.0' in rendered
            assert b'specpilot_engine_hellos_total{outcome="permission_denied"} 1.0' in rendered
            await real.close()
    finally:
        await server.stop(grace_seconds=0.1)


async def test_open_engine_streams_only_on_loopback_or_when_allowed() -> None:
    wide = {**FAST_SETTINGS, "grpc_host": "0.0.0.0"}
    with pytest.raises(ServeError, match="set engine_secret"):
        await start_server(load_settings(**wide))
    for extra in ({"engine_secret": SECRET}, {"engine_token": TOKEN},
                  {"allow_unauthenticated_engines": True}):
        server = await start_server(load_settings(**wide, **extra))
        await server.stop(grace_seconds=0.1)
    # The default loopback listener needs none (the sidecar's own pod).
    server = await start_server(load_settings(**FAST_SETTINGS))
    try:
        async with grpc.aio.insecure_channel(server.grpc_target) as ch:
            await EngineClient(ch).connect(hello("engine-1"))
    finally:
        await server.stop(grace_seconds=0.1)


async def test_a_generated_policy_token_kept_in_its_file_survives_a_restart(
        tmp_path: Path) -> None:
    path = tmp_path / "policy-token"
    settings = {**FAST_SETTINGS, "policy_token": None, "policy_token_file": str(path)}
    first = await start_server(load_settings(**settings))
    await first.stop(grace_seconds=0.1)
    assert first.token_generated and path.read_text().strip() == first.token
    assert path.stat().st_mode & 0o077 == 0  # readable by its owner only
    again = await start_server(load_settings(**settings))
    await again.stop(grace_seconds=0.1)
    assert again.token == first.token and not again.token_generated
    path.write_text("")
    with pytest.raises(ServeError, match="is empty"):
        await start_server(load_settings(**settings))
