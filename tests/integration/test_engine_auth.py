"""Engine streams need the engine token when one is set: without it UNAUTHENTICATED, with a
wrong one PERMISSION_DENIED, before anything of the stream is read, so no one without it can
register an engine, take over a connected engine's id or move an estimate. Unauthenticated
engine streams are possible only on a loopback listener or by an explicit setting."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from specpilot.controller.server.app import ServeError, start_server
from specpilot.controller.settings import load_settings
from tests.integration.conftest import FAST_SETTINGS, snapshot
from tests.integration.engine_client import EngineClient, acceptance, hello, report

pytestmark = pytest.mark.integration
TOKEN = "engine-token-0123456789"


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
    with pytest.raises(ServeError, match="set engine_token"):
        await start_server(load_settings(**wide))
    for extra in ({"engine_token": TOKEN}, {"allow_unauthenticated_engines": True}):
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
