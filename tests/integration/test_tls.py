"""TLS on both listeners and mTLS for engine streams, against a real controller on loopback with
certificates made here (tests/certs.py): the policy API and health over TLS (and refused without
it or with the wrong CA), HTTPS /healthz and /metrics, engine streams that need a client
certificate (none: UNAUTHENTICATED; another CA's: refused at the handshake; the right one: the
hello accepted and reports accepted), the engine token on top, an engine id bound to its
certificate, the plugin's link over TLS and mTLS, the CLI's TLS options, and start-up errors
that name the setting."""

from __future__ import annotations

import logging
import random
import ssl
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from benchmarks.controller_thread import ControllerThread
from specpilot.controller.server.app import RunningServer, ServeError, start_server
from specpilot.controller.server.stubs import async_policy_stub
from specpilot.controller.settings import load_settings
from specpilot.engine_plugin.link import ControllerLink
from specpilot.engine_plugin.policy.view import PolicyView
from specpilot.v1 import policy_pb2
from tests.certs import PKI, KeyPair, make_pki
from tests.integration.conftest import FAST_SETTINGS
from tests.integration.engine_client import EngineClient, acceptance, hello, report
from tests.plugin.test_link import DRAFT, config, link_fixture, wait_for  # noqa: F401 (links)
from tests.plugin.test_link import hello as link_hello

pytestmark = pytest.mark.integration
SPECPILOT = str(Path(sys.executable).with_name("specpilot"))
ENGINE_TOKEN = "engine-token-0123456789"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> PKI:
    return make_pki(tmp_path_factory.mktemp("pki"))


def tls_settings(pki: PKI, **extra: Any) -> dict[str, Any]:
    return {**FAST_SETTINGS, "tls_cert_file": str(pki.server.cert),
            "tls_key_file": str(pki.server.key), **extra}


def mtls_settings(pki: PKI, **extra: Any) -> dict[str, Any]:
    return tls_settings(pki, **{"tls_client_ca_file": str(pki.ca), **extra})


def credentials(ca: Path, pair: KeyPair | None = None) -> grpc.ChannelCredentials:
    if pair is None:
        return grpc.ssl_channel_credentials(ca.read_bytes())
    return grpc.ssl_channel_credentials(ca.read_bytes(), pair.key.read_bytes(),
                                        pair.cert.read_bytes())


def channel(target: str, creds: grpc.ChannelCredentials | None) -> grpc.aio.Channel:
    if creds is None:
        return grpc.aio.insecure_channel(target)
    return grpc.aio.secure_channel(target, creds)


async def policy_code(target: str, creds: grpc.ChannelCredentials | None) -> grpc.StatusCode:
    """The status of one GetPolicy call (OK, or the failure's code)."""
    async with channel(target, creds) as ch:
        try:
            await async_policy_stub(ch).GetPolicy(policy_pb2.GetPolicyRequest(), timeout=5)
        except grpc.aio.AioRpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


async def engine_refusal(target: str, creds: grpc.ChannelCredentials | None,
                         metadata: tuple[tuple[str, str], ...] | None = None,
                         engine_id: str = "engine-1") -> grpc.aio.AioRpcError:
    async with channel(target, creds) as ch:
        client = EngineClient(ch, metadata)
        with pytest.raises(grpc.aio.AioRpcError) as failure:
            await client.connect(hello(engine_id))
        return failure.value


async def engine_accepted(target: str, creds: grpc.ChannelCredentials | None,
                          metadata: tuple[tuple[str, str], ...] | None = None,
                          engine_id: str = "engine-1") -> None:
    async with channel(target, creds) as ch:
        client = EngineClient(ch, metadata)
        ack = await client.connect(hello(engine_id))
        assert ack.controller_version
        assert (await client.send(report(1, acceptance("chat", (10, 20, 70))))).accepted
        await client.close()


def hello_count(server: RunningServer, outcome: str) -> float | None:
    return server.metrics.registry.get_sample_value("specpilot_engine_hellos_total",
                                                    {"outcome": outcome})


@pytest.fixture
async def tls_server(pki: PKI) -> AsyncIterator[RunningServer]:
    running = await start_server(load_settings(**tls_settings(pki)))
    try:
        yield running
    finally:
        await running.stop(grace_seconds=0.1)


# --- TLS ------------------------------------------------------------------------------------------
async def test_the_policy_api_and_health_answer_over_tls_only_with_the_right_ca(
        tls_server: RunningServer, pki: PKI) -> None:
    target = tls_server.grpc_target
    assert tls_server.tls and tls_server.engine_grpc_port is None
    assert await policy_code(target, credentials(pki.ca)) == grpc.StatusCode.OK
    async with channel(target, credentials(pki.ca)) as ch:
        status = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(),
                                                            timeout=5)
        assert status.status == health_pb2.HealthCheckResponse.SERVING
    # Plaintext against TLS, and a CA that did not sign the server's certificate.
    assert await policy_code(target, None) == grpc.StatusCode.UNAVAILABLE
    assert await policy_code(target, credentials(pki.other_ca)) == grpc.StatusCode.UNAVAILABLE
    # Without a client CA, engine streams need no client certificate (loopback, no token).
    await engine_accepted(target, credentials(pki.ca))


async def test_healthz_and_metrics_are_served_over_https(tls_server: RunningServer,
                                                         pki: PKI) -> None:
    assert tls_server.http_url.startswith("https://127.0.0.1:")
    trusted = ssl.create_default_context(cafile=str(pki.ca))
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{tls_server.http_url}/healthz", ssl=trusted) as resp:
            assert resp.status == 200 and (await resp.json())["status"] == "ok"
        async with session.get(f"{tls_server.http_url}/metrics", ssl=trusted) as resp:
            assert resp.status == 200
            assert "specpilot_engine_hellos_total" in await resp.text()
        with pytest.raises(aiohttp.ClientConnectorCertificateError):
            await session.get(f"{tls_server.http_url}/healthz",
                              ssl=ssl.create_default_context(cafile=str(pki.other_ca)))
        plain = tls_server.http_url.replace("https://", "http://")
        with pytest.raises(aiohttp.ClientError):
            await session.get(f"{plain}/healthz")


# --- mTLS for engines -----------------------------------------------------------------------------
async def test_engines_only_mtls_keeps_policy_clients_certificate_free(pki: PKI) -> None:
    """tls_client_auth "engines": grpc_port asks no client certificate (policy API, health) and
    refuses engine streams with UNAUTHENTICATED; engine_grpc_port requires one at the
    handshake: none or another CA's is refused there, the right one is accepted."""
    server = await start_server(load_settings(**mtls_settings(
        pki, tls_client_auth="engines", engine_grpc_port=0)))
    try:
        main, engines = server.grpc_target, server.engine_grpc_target
        assert server.engine_grpc_port not in (None, server.grpc_port)
        assert await policy_code(main, credentials(pki.ca)) == grpc.StatusCode.OK
        refused = await engine_refusal(main, credentials(pki.ca))
        assert refused.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "client certificate" in (refused.details() or "")
        assert "engine_grpc_port" in (refused.details() or "")
        assert hello_count(server, "unauthenticated") == 1
        # The engines' listener: the handshake itself refuses no certificate or a stranger's.
        for creds in (credentials(pki.ca), credentials(pki.ca, pki.stranger)):
            assert (await engine_refusal(engines, creds)).code() == grpc.StatusCode.UNAVAILABLE
        assert hello_count(server, "unauthenticated") == 1  # never reached the service
        await engine_accepted(engines, credentials(pki.ca, pki.engine))
        assert hello_count(server, "accepted") == 1
        # A policy client with a certificate may use the engines' listener too.
        assert await policy_code(engines, credentials(pki.ca, pki.engine)) == grpc.StatusCode.OK
    finally:
        await server.stop(grace_seconds=0.1)


async def test_mtls_for_all_clients_refuses_any_without_a_certificate_at_the_handshake(
        pki: PKI) -> None:
    server = await start_server(load_settings(**mtls_settings(pki)))  # tls_client_auth "all"
    try:
        target = server.grpc_target
        assert await policy_code(target, credentials(pki.ca)) == grpc.StatusCode.UNAVAILABLE
        assert await policy_code(target, credentials(pki.ca, pki.stranger)) \
            == grpc.StatusCode.UNAVAILABLE
        assert await policy_code(target, credentials(pki.ca, pki.engine)) == grpc.StatusCode.OK
        assert (await engine_refusal(target, credentials(pki.ca, pki.stranger))).code() \
            == grpc.StatusCode.UNAVAILABLE
        assert (await engine_refusal(target, None)).code() == grpc.StatusCode.UNAVAILABLE
        await engine_accepted(target, credentials(pki.ca, pki.engine))
    finally:
        await server.stop(grace_seconds=0.1)


async def test_the_engine_token_still_counts_with_mtls(pki: PKI) -> None:
    server = await start_server(load_settings(**mtls_settings(pki, engine_token=ENGINE_TOKEN)))
    try:
        target, good = server.grpc_target, credentials(pki.ca, pki.engine)
        assert (await engine_refusal(target, good)).code() == grpc.StatusCode.UNAUTHENTICATED
        wrong = (("authorization", "Bearer nope"),)
        assert (await engine_refusal(target, good, wrong)).code() \
            == grpc.StatusCode.PERMISSION_DENIED
        await engine_accepted(target, good, (("authorization", f"Bearer {ENGINE_TOKEN}"),))
        assert (hello_count(server, "unauthenticated"), hello_count(server, "permission_denied"),
                hello_count(server, "accepted")) == (1, 1, 1)
    finally:
        await server.stop(grace_seconds=0.1)


async def test_an_engine_id_bound_to_its_certificate_cannot_be_taken_over(pki: PKI) -> None:
    server = await start_server(load_settings(**mtls_settings(pki, tls_bind_engine_id=True)))
    try:
        target = server.grpc_target
        # engine-2's certificate cannot open engine-1's stream; its own id is fine.
        refused = await engine_refusal(target, credentials(pki.ca, pki.engine_two), None,
                                       "engine-1")
        assert refused.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "engine-1" in (refused.details() or "")
        assert hello_count(server, "permission_denied") == 1
        await engine_accepted(target, credentials(pki.ca, pki.engine_two), None, "engine-2")
        await engine_accepted(target, credentials(pki.ca, pki.engine), None, "engine-1")
    finally:
        await server.stop(grace_seconds=0.1)


async def test_with_mtls_engine_streams_may_listen_beyond_loopback_without_a_token(
        pki: PKI) -> None:
    wide = {"grpc_host": "0.0.0.0"}
    with pytest.raises(ServeError, match="tls_client_ca_file"):
        await start_server(load_settings(**tls_settings(pki, **wide)))  # TLS alone is not auth
    server = await start_server(load_settings(**mtls_settings(pki, **wide)))
    try:
        await engine_accepted(f"127.0.0.1:{server.grpc_port}", credentials(pki.ca, pki.engine))
    finally:
        await server.stop(grace_seconds=0.1)


# --- start-up errors ------------------------------------------------------------------------------
@pytest.mark.parametrize(("change", "message"), [
    ({"tls_cert_file": "/nonexistent/server.crt"}, "tls_cert_file '/nonexistent/server.crt': "),
    ({"tls_key_file": "OTHER_KEY"}, "does not match tls_cert_file"),
    ({"tls_key_file": ""}, "tls_cert_file is set but tls_key_file is not"),
    ({"tls_cert_file": "", "tls_key_file": ""}, "needs tls_cert_file and tls_key_file"),
    ({"tls_client_ca_file": "NOT_PEM"}, "tls_client_ca_file"),
    ({"tls_client_auth": "engines"}, "needs engine_grpc_port"),
    ({"tls_client_auth": "all", "engine_grpc_port": 0}, "engine_grpc_port is the engines'"),
    ({"tls_client_ca_file": "", "tls_bind_engine_id": True}, "tls_bind_engine_id needs"),
])
async def test_tls_settings_that_cannot_work_stop_start_up_naming_the_setting(
        pki: PKI, tmp_path: Path, change: dict[str, Any], message: str) -> None:
    not_pem = tmp_path / "not.pem"
    not_pem.write_text("hello\n")
    files = {"OTHER_KEY": str(pki.other_key), "NOT_PEM": str(not_pem)}
    settings = mtls_settings(pki, **{k: files.get(v, v) if isinstance(v, str) else v
                                     for k, v in change.items()})
    with pytest.raises(ServeError) as failure:
        await start_server(load_settings(**settings))
    assert message in str(failure.value)


def _serve_env(**extra: str) -> dict[str, str]:
    import os
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECPILOT_")}
    return {**env, "SPECPILOT_POLICY_TOKEN": "test-token-0123456789", **extra}


@pytest.mark.parametrize(("which", "message"), [
    ("missing", "tls_cert_file '/nonexistent/server.crt': No such file or directory"),
    ("mismatch", "does not match tls_cert_file"),
])
def test_serve_refuses_to_start_with_a_missing_certificate_or_a_key_that_does_not_match(
        pki: PKI, which: str, message: str) -> None:
    cert = "/nonexistent/server.crt" if which == "missing" else str(pki.server.cert)
    key = str(pki.other_key if which == "mismatch" else pki.server.key)
    got = subprocess.run([SPECPILOT, "serve", "--grpc-port", "0", "--http-port", "0"],
                         env=_serve_env(SPECPILOT_TLS_CERT_FILE=cert, SPECPILOT_TLS_KEY_FILE=key),
                         capture_output=True, text=True, timeout=60)
    assert got.returncode == 1, got.stdout + got.stderr
    assert message in got.stderr


# --- the engine plugin's link ---------------------------------------------------------------------


def link_to(links: list[ControllerLink], target: str, **overrides: Any) -> ControllerLink:
    # An id of its own: a stream proving no identity cannot replace another's.
    link = ControllerLink(target, link_hello(f"engine-{len(links)}"), PolicyView(4, DRAFT, 30.0),
                          config(target, **overrides), rng=random.Random(0))
    links.append(link)
    return link


@pytest.fixture(scope="module")
def mtls_controller(pki: PKI) -> Iterator[ControllerThread]:
    """TLS on grpc_port, engines with a client certificate on engine_grpc_port."""
    controller = ControllerThread(**{**mtls_settings(pki), "report_interval_seconds": 0.05,
                                     "tls_client_auth": "engines", "engine_grpc_port": 0})
    try:
        yield controller
    finally:
        controller.stop()


def test_the_link_connects_over_tls_and_mtls(mtls_controller: ControllerThread, pki: PKI,
                                            links: list[ControllerLink]) -> None:
    port = mtls_controller.server.engine_grpc_port
    ca = str(pki.ca)
    mtls = link_to(links, f"127.0.0.1:{port}", tls_ca_file=ca,
                   tls_cert_file=str(pki.engine.cert), tls_key_file=str(pki.engine.key))
    # The certificate names localhost and 127.0.0.1, not this name: the override is checked.
    named = link_to(links, f"localhost:{port}", tls_ca_file=ca, tls_server_name="controller.test",
                    tls_cert_file=str(pki.engine.cert), tls_key_file=str(pki.engine.key))
    wait_for(lambda: mtls.connected and named.connected, "the links over mTLS", timeout=10)
    assert mtls.last_hello_ack is not None and list(mtls.last_hello_ack.accepted_drafts)


def test_tls_failures_are_logged_once_and_never_reach_the_caller(
        mtls_controller: ControllerThread, pki: PKI, links: list[ControllerLink],
        caplog: pytest.LogCaptureFixture) -> None:
    engines = f"127.0.0.1:{mtls_controller.server.engine_grpc_port}"
    main = mtls_controller.target
    with caplog.at_level(logging.DEBUG, logger="specpilot.engine_plugin.link"):
        cases = {
            "wrong CA": link_to(links, engines, tls_ca_file=str(pki.other_ca)),
            "no client certificate": link_to(links, engines, tls_ca_file=str(pki.ca)),
            "plaintext": link_to(links, engines),
            "main port": link_to(links, main, tls_ca_file=str(pki.ca)),
            "missing CA file": link_to(links, engines, tls_ca_file="/nonexistent/ca.crt"),
        }
        for link in cases.values():
            link.submit(link_payload())  # never blocks, never raises
        wait_for(lambda: sum("still unreachable" in r.message or "still unusable" in r.message
                             for r in caplog.records) >= 2 * len(cases), "retries", timeout=15)
    assert not any(link.connected for link in cases.values())
    loud = [r for r in caplog.records if r.levelno >= logging.WARNING]
    by_link = {name: [r.getMessage() for r in loud if f"{link.target}:" in r.getMessage()
                      and _mentions(r.getMessage(), name)] for name, link in cases.items()}
    # One line per outage each, saying where to look.
    assert all(len(lines) == 1 for lines in by_link.values()), by_link
    assert "TLS handshake failed" in by_link["wrong CA"][0]
    assert "SPECPILOT_PLUGIN_TLS_CERT_FILE" in by_link["no client certificate"][0]
    assert "set SPECPILOT_PLUGIN_TLS_CA_FILE" in by_link["plaintext"][0]
    assert "UNAUTHENTICATED" in by_link["main port"][0]
    assert "/nonexistent/ca.crt" in by_link["missing CA file"][0]
    errors = {r.getMessage() for r in loud if r.levelno == logging.ERROR}
    assert {by_link[n][0] for n in ("wrong CA", "main port", "missing CA file")} <= errors


def _mentions(line: str, case: str) -> bool:
    """Which case a warning belongs to (several links share a target)."""
    return {
        "wrong CA": "handshake failed" in line.lower(),
        "no client certificate": "SPECPILOT_PLUGIN_TLS_CERT_FILE" in line,
        "plaintext": "set SPECPILOT_PLUGIN_TLS_CA_FILE" in line,
        "main port": "UNAUTHENTICATED" in line,
        "missing CA file": "/nonexistent/ca.crt" in line,
    }[case]


def link_payload() -> Any:
    from specpilot.engine_plugin.policy.stats import StatsAggregator
    agg = StatsAggregator()
    agg.record_verification("chat", DRAFT, 2, 1)
    return agg.drain(running_requests=1)


# --- the CLI --------------------------------------------------------------------------------------
def test_the_cli_talks_tls_with_its_options(mtls_controller: ControllerThread,
                                           pki: PKI) -> None:
    target = mtls_controller.target

    def run(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([SPECPILOT, *args], env=_serve_env(**env), capture_output=True,
                              text=True, timeout=60)

    got = run("policy", "--target", target, "--tls-ca", str(pki.ca), "get")
    assert got.returncode == 0 and "policy version" in got.stdout, got.stderr
    got = run("policy", "get", "--target", target, SPECPILOT_TARGET_TLS_CA=str(pki.ca))
    assert got.returncode == 0, got.stderr
    got = run("check", "--target", target, "--tls-ca", str(pki.ca), "--timeout", "5")
    assert got.returncode == 0 and "serving" in got.stdout, got.stderr
    # The engines' listener wants a client certificate: the CLI presents one.
    engines = f"127.0.0.1:{mtls_controller.server.engine_grpc_port}"
    got = run("check", "--target", engines, "--tls-ca", str(pki.ca), "--tls-cert",
              str(pki.engine.cert), "--tls-key", str(pki.engine.key), "--tls-server-name",
              "controller.test", "--timeout", "5")
    assert got.returncode == 0, got.stderr
    # Plaintext against TLS: the CLI says what to pass (--tls-ca); bad options are named.
    got = run("policy", "--target", target, "--timeout", "2", "get")
    assert got.returncode == 1 and "closed the connection" in got.stderr, got.stderr
    assert "pass --tls-ca FILE" in got.stderr and "UNAVAILABLE" not in got.stderr
    got = run("policy", "--target", target, "get", "--tls-cert", str(pki.engine.cert))
    assert got.returncode == 2 and "need --tls-ca" in got.stderr
    got = run("check", "--target", target, "--tls-ca", "/nonexistent/ca.crt")
    assert got.returncode == 2 and "--tls-ca '/nonexistent/ca.crt'" in got.stderr
