"""The dashboard's HTTP API on a real controller: its state is GetPolicy's JSON, the log pages
from the newest with plain-language lines, the event stream delivers decisions and audit
entries, and writes take the policy token (the same path and audit log as gRPC writes)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import grpc
import pytest

from specpilot.controller.server import http as http_module
from specpilot.controller.server.app import RunningServer
from specpilot.controller.server.stubs import async_policy_stub
from specpilot.controller.server.views import to_json_dict
from specpilot.v1 import policy_pb2
from tests.integration.conftest import TOKEN
from tests.integration.engine_client import EngineClient, acceptance, report

pytestmark = pytest.mark.integration
AUTH = {"Authorization": f"Bearer {TOKEN}"}


async def _get(server: RunningServer, path: str) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as http, http.get(server.http_url + path) as resp:
        return resp.status, (await resp.json() if resp.content_type == "application/json"
                             else await resp.text())


async def _post(server: RunningServer, path: str, body: Any,
                headers: dict[str, str] | None = None) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as http, http.post(
            server.http_url + path, data=body if isinstance(body, str) else json.dumps(body),
            headers={"Content-Type": "application/json", **(headers or {})}) as resp:
        return resp.status, await resp.json()


@pytest.fixture
async def engine(channel: grpc.aio.Channel) -> AsyncIterator[EngineClient]:
    client = EngineClient(channel)
    await client.connect()
    await client.send(report(1, acceptance("chat", (10, 20, 70)),
                             acceptance("code", (60, 30, 10))))
    yield client
    await client.close()


async def test_the_state_carries_getpolicys_json_and_the_engines(
        server: RunningServer, channel: grpc.aio.Channel, engine: EngineClient) -> None:
    status, state = await _get(server, "/api/dashboard")
    assert status == 200
    grpc_policy = await async_policy_stub(channel).GetPolicy(policy_pb2.GetPolicyRequest())
    want = to_json_dict(grpc_policy)  # one message, one schema; estimates and report ages
    # move with the clock between the two reads, decisions do not
    assert state["policy"].keys() == want.keys()
    assert [(c["traffic_class"], c["decisions"], c["overrides"])
            for c in state["policy"]["classes"]] == [
        (c["traffic_class"], c["decisions"], c["overrides"]) for c in want["classes"]]
    engines = state["policy"]["engine_status"]
    assert [e["engine_id"] for e in engines] == ["engine-1"]
    assert engines[0]["report_age_seconds"] >= 0
    chat = next(c for c in state["policy"]["classes"] if c["traffic_class"] == "chat")
    assert 0 < chat["batch_share"] <= 1 and chat["measured_tokens_per_step"] > 1
    assert state["fleet"] is None and state["controller"]["instance"]


async def test_the_log_pages_from_the_newest_with_plain_language_lines(
        server: RunningServer, engine: EngineClient) -> None:
    status, all_ = await _get(server, "/api/decisions")
    total = all_["total"]
    assert status == 200 and total == len(all_["events"]) > 4
    _, newest = await _get(server, "/api/decisions?limit=3&text=1")
    _, older = await _get(server, "/api/decisions?limit=3&offset=3&text=1")
    assert newest["events"] == [
        {**e, "text": newest["events"][i]["text"]} for i, e in enumerate(all_["events"][-3:])]
    assert [e["unix_seconds"] for e in older["events"]] == [
        e["unix_seconds"] for e in all_["events"][-6:-3]]
    assert all(e["text"].startswith(e["decision"]["traffic_class"] + ": ")
               for e in newest["events"] + older["events"])
    _, chat = await _get(server, "/api/decisions?class=chat&text=1")
    assert chat["events"] and all(e["decision"]["traffic_class"] == "chat"
                                  for e in chat["events"])
    assert (await _get(server, "/api/decisions?offset=x"))[0] == 400


async def test_a_read_of_the_log_is_one_bounded_page(
        server: RunningServer, engine: EngineClient, monkeypatch: pytest.MonkeyPatch) -> None:
    # The whole log holds up to decision_log_size events and each rendered line costs the
    # loop milliseconds: one answer is capped, and says so; older events are paged to.
    _, whole = await _get(server, "/api/decisions")
    total = whole["total"]
    assert total > 4 and len(whole["events"]) == total  # the control: under the caps
    monkeypatch.setattr(http_module, "DECISIONS_PAGE_MAX", 4)
    monkeypatch.setattr(http_module, "DECISIONS_TEXT_PAGE_MAX", 2)
    _, page = await _get(server, "/api/decisions")
    assert page["total"] == total and page["limit"] == 4 and page["events"] == whole["events"][-4:]
    _, asked = await _get(server, "/api/decisions?limit=1000")
    assert asked["limit"] == 4 and len(asked["events"]) == 4
    _, text = await _get(server, "/api/decisions?limit=1000&text=1")
    assert text["limit"] == 2 and len(text["events"]) == 2
    _, back = await _get(server, "/api/decisions?offset=4")
    assert back["events"] == whole["events"][-8:-4]


async def _events(server: RunningServer, want: int, after: Any) -> list[tuple[str, Any]]:
    """The first ``want`` events of the stream (after its hello, once ``after`` ran)."""
    got: list[tuple[str, Any]] = []
    async with aiohttp.ClientSession() as http, http.get(server.http_url + "/api/events") as r:
        assert r.headers["Content-Type"].startswith("text/event-stream")
        name = ""
        async for raw in r.content:
            line = raw.decode().rstrip("\n")
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                got.append((name, json.loads(line[len("data: "):])))
                if name == "hello":
                    await after()
                if len(got) > want:
                    break
    return got[1:]


async def test_the_event_stream_carries_new_decisions_and_audit_entries(
        server: RunningServer, engine: EngineClient) -> None:
    async def act() -> None:
        await engine.send(report(2, acceptance("docs", (5, 5, 90))))  # a new class: decisions
        await _post(server, "/api/overrides", {"override": {"traffic_class": "chat",
                                                            "force_off": True}})  # refused

    events = await asyncio.wait_for(_events(server, 10, act), 10)
    names = [n for n, _ in events]
    docs = [d for n, d in events if n == "decision" and d["decision"]["traffic_class"] == "docs"]
    assert docs and all(d["text"].startswith("docs: ") for d in docs)
    audit = [d for n, d in events if n == "audit"]
    assert "audit" in names and audit[0]["outcome"] == "unauthenticated"


async def test_writes_take_the_token_and_every_attempt_is_audited(
        server: RunningServer, channel: grpc.aio.Channel, engine: EngineClient) -> None:
    body = {"override": {"traffic_class": "chat", "pin_k": 1, "note": "from the page"}}
    status, answer = await _post(server, "/api/overrides", body)
    assert (status, answer["kind"]) == (401, "unauthenticated")
    status, answer = await _post(server, "/api/overrides", body, {"Authorization": "Bearer no"})
    assert (status, answer["kind"]) == (403, "permission_denied")
    status, answer = await _post(server, "/api/overrides", "{not json", AUTH)
    assert status == 400 and answer["error"].startswith("body: ")
    status, answer = await _post(server, "/api/overrides",
                                 {"override": {"traffic_class": "chat"}}, AUTH)
    assert status == 400 and "action" in answer["error"]
    assert not server.core.snapshot(0.0).overrides  # nothing refused changed anything
    status, answer = await _post(server, "/api/overrides", body, AUTH)
    assert status == 200 and int(answer["policy_version"]) >= 1
    assert [(o.traffic_class, o.pin_k) for o in server.core.snapshot(0.0).overrides] == [
        ("chat", 1)]
    # A gRPC write takes the same path into the same audit log.
    await async_policy_stub(channel).ClearOverride(
        policy_pb2.ClearOverrideRequest(traffic_class="chat"),
        metadata=(("authorization", f"Bearer {TOKEN}"),))
    status, answer = await _post(server, "/api/overrides/clear", {"traffic_class": "chat"},
                                 AUTH)
    assert status == 200 and answer["cleared"] is False
    _, state = await _get(server, "/api/dashboard")
    log = [(a["action"], a["outcome"], a["actor"].split()[0]) for a in state["audit"]]
    assert log == [("set_override", "unauthenticated", "http"),
                   ("set_override", "permission_denied", "http"),
                   ("set_override", "invalid", "http"),
                   ("set_override", "ok", "http"),
                   ("clear_override", "ok", "grpc"),
                   ("clear_override", "ok", "http")]
    assert state["audit"][3]["note"] == "from the page" and state["audit"][3]["what"] == "pin_k=1"
    assert state["audit"][-1]["reason"] == "nothing to clear"


async def test_the_page_and_only_its_own_files_are_served(server: RunningServer) -> None:
    status, page = await _get(server, "/")
    assert status == 200 and "/static/dashboard.js" in page and "https://" not in page
    for name in ("dashboard.js", "dashboard.css"):
        status, text = await _get(server, f"/static/{name}")
        assert status == 200 and "http://" not in text.replace("http://www.w3.org", "")
    for path in ("/static/index.html.bak", "/static/..%2Froutes.py", "/static/%2e%2e/routes.py"):
        assert (await _get(server, path))[0] == 404


async def test_with_a_shared_store_the_state_shows_the_fleet(redis: Any) -> None:
    from specpilot.controller.server.app import start_server
    from specpilot.controller.settings import load_settings
    from tests.integration.conftest import FAST_SETTINGS

    servers = [await start_server(load_settings(**{
        **FAST_SETTINGS, "state_store": redis.url, "sidecar_id": name, "fleet_model": "tiny-target",
        "fleet_flush_interval_seconds": 0.1})) for name in ("sidecar-a", "sidecar-b")]
    try:
        async with grpc.aio.insecure_channel(servers[0].grpc_target) as ch:
            client = EngineClient(ch)
            await client.connect()
            await client.send(report(1, acceptance("chat", (10, 20, 70))))
            deadline = asyncio.get_running_loop().time() + 10
            while True:
                _, state = await _get(servers[0], "/api/dashboard")
                _, log = await _get(servers[1], "/api/fleet/decisions?limit=50")
                fleet = state["fleet"]
                if (fleet["store_up"] and [p["sidecar"] for p in fleet["peers"]] == ["sidecar-b"]
                        and any(e["sidecar"] == "sidecar-a" for e in log["events"])):
                    break
                assert asyncio.get_running_loop().time() < deadline, (fleet, log)
                await asyncio.sleep(0.1)
            assert fleet["sidecar"] == "sidecar-a" and fleet["model"] == "tiny-target"
            await client.close()
    finally:
        for s in servers:
            await s.stop(grace_seconds=0.1)


async def test_without_a_shared_store_there_is_no_fleet_log(server: RunningServer) -> None:
    status, answer = await _get(server, "/api/fleet/decisions")
    assert status == 404 and "state store" in answer["error"]
