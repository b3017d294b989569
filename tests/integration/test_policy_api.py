"""PolicyService over a real channel: reads, authenticated writes, watch and explain."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable
from pathlib import Path
from typing import Any

import grpc
import pytest

from specpilot.contract.records import DecisionEvent
from specpilot.controller.server import hub as hub_module
from specpilot.controller.server.app import RunningServer, start_server
from specpilot.controller.server.stubs import AsyncPolicyStub, async_policy_stub
from specpilot.controller.settings import load_settings
from specpilot.controller.wire import event_to_proto
from specpilot.v1 import common_pb2, engine_pb2, policy_pb2
from tests.integration.conftest import FAST_SETTINGS, TOKEN, snapshot
from tests.integration.engine_client import DRAFT, EngineClient, acceptance, hello, report

pytestmark = pytest.mark.integration
AUTH = (("authorization", f"Bearer {TOKEN}"),)


@pytest.fixture
async def engine(channel: grpc.aio.Channel) -> AsyncIterator[EngineClient]:
    """One engine connected, with one accepted report for class "chat"."""
    client = EngineClient(channel)
    await client.connect()
    assert (await client.send(report(1))).accepted
    yield client
    await client.close()


@pytest.fixture
def policy(channel: grpc.aio.Channel) -> AsyncPolicyStub:
    return async_policy_stub(channel)


def _pin(cls: str, k: int, note: str = "") -> policy_pb2.SetOverrideRequest:
    return policy_pb2.SetOverrideRequest(
        override=policy_pb2.Override(traffic_class=cls, pin_k=k, note=note))


async def _code(call: Awaitable[object]) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call
    return err.value.code(), err.value.details() or ""


async def test_get_policy_returns_decisions_and_estimates(
    server: RunningServer, policy: AsyncPolicyStub, engine: EngineClient
) -> None:
    resp = await policy.GetPolicy(policy_pb2.GetPolicyRequest())
    assert resp.version == server.core.version
    assert list(resp.engines) == ["engine-1"]
    assert {c.traffic_class for c in resp.classes} == {"default", "chat"}

    only = await policy.GetPolicy(policy_pb2.GetPolicyRequest(traffic_class="chat"))
    (chat,) = only.classes
    assert len(chat.decisions) == server.core.config.n_buckets
    est = {e.draft: e for e in chat.estimates}
    assert set(est) == {DRAFT, "ngram"}  # the refused draft has no estimate
    p1, p2 = est[DRAFT].positions[:2]
    # Histogram (10, 20, 70): position 1 tried 100, accepted 90; position 2 tried 90, accepted 70.
    assert (p1.effective_tries, p2.effective_tries) == pytest.approx((100, 90), rel=1e-3)
    assert p1.mean == pytest.approx(91 / 102, rel=1e-3)
    assert p1.lower < p1.mean < p1.upper
    # E(0) = 1 and E(K) grows with K.
    curve = list(est[DRAFT].expected_tokens)
    assert curve[0] == 1.0 and curve == sorted(curve)

    missing = await _code(policy.GetPolicy(policy_pb2.GetPolicyRequest(traffic_class="nope")))
    assert missing == (grpc.StatusCode.NOT_FOUND, "unknown class 'nope'")


async def test_writes_need_the_bearer_token(
    server: RunningServer, policy: AsyncPolicyStub, engine: EngineClient
) -> None:
    code, details = await _code(policy.SetOverride(_pin("chat", 1)))
    assert code == grpc.StatusCode.UNAUTHENTICATED and "authorization" in details
    code, _ = await _code(policy.SetOverride(
        _pin("chat", 1), metadata=(("authorization", "Bearer wrong-token"),)))
    assert code == grpc.StatusCode.PERMISSION_DENIED
    code, _ = await _code(policy.SetOverride(
        _pin("chat", 1), metadata=(("authorization", f"Basic {TOKEN}"),)))
    assert code == grpc.StatusCode.PERMISSION_DENIED
    code, _ = await _code(policy.ClearOverride(
        policy_pb2.ClearOverrideRequest(traffic_class="chat")))
    assert code == grpc.StatusCode.UNAUTHENTICATED
    assert snapshot(server).overrides == ()

    registry = server.metrics.registry
    assert registry.get_sample_value("specpilot_policy_writes_total",
                                     {"outcome": "unauthenticated"}) == 2
    assert registry.get_sample_value("specpilot_policy_writes_total",
                                     {"outcome": "permission_denied"}) == 2


async def test_set_and_clear_an_override(
    server: RunningServer, policy: AsyncPolicyStub, engine: EngineClient
) -> None:
    version = server.core.version
    resp = await policy.SetOverride(_pin("chat", 1, note="incident 42"), metadata=AUTH)
    assert resp.policy_version > version
    decisions = snapshot(server).class_view("chat").decisions
    assert all(d.k == 1 and d.draft == DRAFT and d.reason.value == "override" for d in decisions)
    # The engine hears about it (after any update that was already on its way; a decide round
    # of the server's own may have made a later version, which still carries the override).
    while (update := await engine.next_policy()).version < resp.policy_version:
        pass
    assert all(d.k == 1 for d in update.decisions if d.traffic_class == "chat")

    (chat,) = (await policy.GetPolicy(policy_pb2.GetPolicyRequest(traffic_class="chat"))).classes
    (ov,) = chat.overrides
    assert (ov.traffic_class, ov.WhichOneof("action"), ov.pin_k, ov.note) == (
        "chat", "pin_k", 1, "incident 42")
    assert ov.set_unix_seconds > 0

    cleared = await policy.ClearOverride(policy_pb2.ClearOverrideRequest(traffic_class="chat"),
                                         metadata=AUTH)
    assert cleared.cleared and snapshot(server).overrides == ()
    again = await policy.ClearOverride(policy_pb2.ClearOverrideRequest(traffic_class="chat"),
                                       metadata=AUTH)
    assert not again.cleared


async def test_without_a_shared_store_overrides_are_the_pods_and_fleet_scope_is_refused(
    server: RunningServer, policy: AsyncPolicyStub, engine: EngineClient
) -> None:
    await policy.SetOverride(_pin("chat", 2), metadata=AUTH)  # unspecified scope: the pod's
    (chat,) = (await policy.GetPolicy(policy_pb2.GetPolicyRequest(traffic_class="chat"))).classes
    (ov,) = chat.overrides
    assert ov.scope == policy_pb2.OVERRIDE_SCOPE_POD and ov.set_by
    fleet = _pin("chat", 3)
    fleet.override.scope = policy_pb2.OVERRIDE_SCOPE_FLEET
    code, details = await _code(policy.SetOverride(fleet, metadata=AUTH))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("scope:")
    code, details = await _code(policy.ClearOverride(policy_pb2.ClearOverrideRequest(
        traffic_class="chat", scope=policy_pb2.OVERRIDE_SCOPE_FLEET), metadata=AUTH))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("scope:")
    assert [o.pin_k for o in snapshot(server).overrides] == [2]  # nothing changed


async def test_force_off_for_all_classes(
    server: RunningServer, policy: AsyncPolicyStub, engine: EngineClient
) -> None:
    await policy.SetOverride(policy_pb2.SetOverrideRequest(
        override=policy_pb2.Override(traffic_class="*", force_off=True)), metadata=AUTH)
    for name in ("default", "chat"):
        assert all(d.k == 0 for d in snapshot(server).class_view(name).decisions), name


@pytest.mark.parametrize(("override", "field"), [
    (policy_pb2.Override(traffic_class="chat"), "override.action"),
    (policy_pb2.Override(traffic_class="chat", force_off=False), "override.force_off"),
    (policy_pb2.Override(traffic_class="bad class!", pin_k=1), "override.traffic_class"),
    (policy_pb2.Override(traffic_class="", pin_k=1), "override.traffic_class"),
])
async def test_bad_override_is_invalid_argument(
    server: RunningServer, policy: AsyncPolicyStub, override: policy_pb2.Override, field: str
) -> None:
    code, details = await _code(policy.SetOverride(
        policy_pb2.SetOverrideRequest(override=override), metadata=AUTH))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert field in details
    assert snapshot(server).overrides == ()


async def test_watch_replays_then_streams_new_decisions(
    server: RunningServer, policy: AsyncPolicyStub, engine: EngineClient
) -> None:
    replayed = snapshot(server).events("chat")
    assert replayed
    call = policy.WatchDecisions(policy_pb2.WatchDecisionsRequest(traffic_class="chat"))
    stream = aiter(call)
    for expected in replayed:
        event = (await asyncio.wait_for(anext(stream), 5)).event
        assert (event.policy_version, event.decision.batch_bucket) == (
            expected.policy_version, expected.decision.bucket)

    before = {d.bucket: d.k for d in snapshot(server).class_view("chat").decisions}
    await policy.SetOverride(_pin("default", 0), metadata=AUTH)  # filtered out
    await policy.SetOverride(_pin("chat", 3), metadata=AUTH)
    event = (await asyncio.wait_for(anext(stream), 5)).event
    assert event.decision.traffic_class == "chat"
    assert event.decision.k == 3
    assert event.decision.reason == common_pb2.DECISION_REASON_OVERRIDE
    assert event.previous_k == before[event.decision.batch_bucket] != 3
    call.cancel()


async def test_watchers_get_the_same_messages_each_serialized_once(
    server: RunningServer, policy: AsyncPolicyStub, engine: EngineClient,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Many watchers of a burst of decisions cost one conversion an event, not one a watcher
    # (150 watchers kept a core busy for seconds after a burst when each serialized its own).
    converted: list[DecisionEvent] = []

    def counting(e: DecisionEvent) -> common_pb2.DecisionEvent:
        converted.append(e)
        return event_to_proto(e)

    monkeypatch.setattr(hub_module, "event_to_proto", counting)
    calls = [policy.WatchDecisions(policy_pb2.WatchDecisionsRequest()) for _ in range(4)]
    streams = [aiter(c) for c in calls]
    replayed = len(snapshot(server).events(""))
    got: list[list[bytes]] = [[] for _ in calls]
    for stream, messages in zip(streams, got, strict=True):
        for _ in range(replayed):
            messages.append((await asyncio.wait_for(anext(stream), 5)).SerializeToString())
    await policy.SetOverride(_pin("chat", 3), metadata=AUTH)
    for stream, messages in zip(streams, got, strict=True):
        event = (await asyncio.wait_for(anext(stream), 5)).event
        assert event.decision.k == 3
        messages.append(event.SerializeToString())
    assert got[0] and all(m == got[0] for m in got)  # every watcher, the same messages
    # Each event converted once (the replay's and the override's), not once a watcher.
    assert len(converted) == len(set(map(id, converted))) > replayed
    for c in calls:
        c.cancel()


async def _watchers_then_refused(policy: Any, served: int, setting: str) -> list[Any]:
    """``served`` watchers opened and served (no log yet to replay), then one more refused
    naming ``setting``; the served calls."""
    calls = [policy.WatchDecisions(policy_pb2.WatchDecisionsRequest()) for _ in range(served)]
    await asyncio.sleep(0.2)
    assert not any(c.done() for c in calls)
    refused = policy.WatchDecisions(policy_pb2.WatchDecisionsRequest())
    code, details = await _code(anext(aiter(refused)))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert setting in details
    return calls


async def test_watchers_beyond_the_limit_are_refused_until_one_ends() -> None:
    # Each watcher costs the loop its replay and every event after: a bounded number at once.
    server = await start_server(load_settings(**{**FAST_SETTINGS, "max_watch_streams": 2}))
    try:
        async with grpc.aio.insecure_channel(server.grpc_target) as channel:
            policy = async_policy_stub(channel)
            calls = await _watchers_then_refused(policy, 2, "max_watch_streams")
            calls[0].cancel()
            for _ in range(50):  # once the server has seen the cancel, a slot is free
                again = policy.WatchDecisions(policy_pb2.WatchDecisionsRequest())
                await asyncio.sleep(0.1)
                if not again.done():  # open: served (a refused one ends at once)
                    break
            else:
                raise AssertionError("no watcher served after one ended")
            again.cancel()
            calls[1].cancel()
    finally:
        await server.stop(grace_seconds=0.1)


async def test_explain(
    server: RunningServer, policy: AsyncPolicyStub, engine: EngineClient
) -> None:
    resp = await policy.ExplainDecision(
        policy_pb2.ExplainDecisionRequest(traffic_class="chat", batch_bucket=0))
    assert "class 'chat' at batch 1" in resp.text
    assert resp.batch_size == 1
    decision = snapshot(server).class_view("chat").decisions[0]
    assert (resp.decision.k, resp.decision.draft) == (decision.k, decision.draft)
    arms = {(a.draft, a.k) for a in resp.arms}
    assert ("", 0) in arms and (DRAFT, 4) in arms
    off = next(a for a in resp.arms if a.k == 0)
    assert off.speedup == pytest.approx(1.0)

    beyond = server.core.config.n_buckets
    code, details = await _code(policy.ExplainDecision(
        policy_pb2.ExplainDecisionRequest(traffic_class="chat", batch_bucket=beyond)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "batch_bucket" in details
    missing = await _code(policy.ExplainDecision(
        policy_pb2.ExplainDecisionRequest(traffic_class="nope")))
    assert missing == (grpc.StatusCode.NOT_FOUND, "unknown class 'nope'")


async def test_a_benchmark_logs_each_class_decision_and_its_arms_while_labelled(
        server: RunningServer, engine: EngineClient, tmp_path: Path) -> None:
    """``bench real --explain-every``: a client thread of the real server, polling only while
    the benchmark labels a phase, one line per poll with every class in every measured bucket."""
    from benchmarks.real.explain import ExplanationLog

    timed = report(2)
    timed.step_timings.append(engine_pb2.StepTiming(
        batch_bucket=0, steps=10, sum_batch_size=10, sum_verified_tokens=10,
        sum_step_seconds=0.3))
    assert (await engine.send(timed)).accepted
    path = tmp_path / "explanations.jsonl"
    log = ExplanationLog(f"{server.grpc_host}:{server.grpc_port}", path, 0.05)
    try:
        await asyncio.sleep(0.3)
        assert not path.exists() or not path.read_text()  # no label: nothing polled
        log.label = "rep 0 light"
        for _ in range(100):
            await asyncio.sleep(0.05)
            if path.exists() and path.read_text():
                break
    finally:
        await asyncio.to_thread(log.stop)
    line = json.loads(path.read_text().splitlines()[0])
    assert line["label"] == "rep 0 light" and line["version"] > 0
    chat = line["classes"]["chat"]["0"]
    assert chat["batch_size"] == 1 and chat["k"] in range(5)
    assert {(draft, k) for draft, k, *_ in chat["arms"]} >= {("", 0), (DRAFT, 4)}


async def test_override_values_beyond_what_the_engines_can_run_are_refused(
        server: RunningServer, channel: grpc.aio.Channel) -> None:
    engine = EngineClient(channel)
    await engine.connect()
    stub = async_policy_stub(channel)
    auth = (("authorization", f"Bearer {TOKEN}"),)
    for override, field in (
            (policy_pb2.Override(traffic_class="chat", pin_k=9), "pin_k"),
            (policy_pb2.Override(traffic_class="chat", pin_k=2**32 - 1), "pin_k"),
            (policy_pb2.Override(traffic_class="chat", force_draft="no-such-draft"),
             "force_draft"),
            (policy_pb2.Override(traffic_class="chat", force_off=True, note="x" * 2_000),
             "note")):
        with pytest.raises(grpc.aio.AioRpcError) as failure:
            await stub.SetOverride(policy_pb2.SetOverrideRequest(override=override),
                                   metadata=auth)
        assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"override.{field}" in (failure.value.details() or "")
        assert len(failure.value.details() or "") < 500  # nothing echoed back whole
    with pytest.raises(grpc.aio.AioRpcError) as failure:
        await stub.ClearOverride(policy_pb2.ClearOverrideRequest(traffic_class="x" * 10_000),
                                 metadata=auth)
    assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert len(failure.value.details() or "") < 500
    # A class no engine reported and none declared: refused, and no slot taken (overrides for
    # made-up classes used to fill the class table until real classes folded into "other").
    for n in range(2 * FAST_SETTINGS["max_classes"]):
        with pytest.raises(grpc.aio.AioRpcError) as failure:
            await stub.SetOverride(policy_pb2.SetOverrideRequest(override=policy_pb2.Override(
                traffic_class=f"made-up-{n}", force_off=True)), metadata=auth)
        assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "override.traffic_class" in (failure.value.details() or "")
    assert not server.core.snapshot(0.0).overrides
    assert [c.name for c in server.core.snapshot(0.0).classes] == ["default"]
    assert (await engine.send(report(1, acceptance("chat")))).accepted
    assert server.core.canonical_class("chat") == "chat"
    await engine.close()


async def test_a_pin_above_the_largest_k_the_engines_offer_is_refused_naming_it() -> None:
    """With engines connected, a pin above the largest K they offer is INVALID_ARGUMENT naming
    that K; before any engine connects it is taken, and runs capped at an engine's largest K.
    Control: a pin of 6 with an engine offering K up to 4 was taken, and shown and run as
    K=4."""
    server = await start_server(load_settings(**{**FAST_SETTINGS, "declared_classes": ["chat"]}))
    try:
        async with grpc.aio.insecure_channel(server.grpc_target) as channel:
            stub = async_policy_stub(channel)
            await stub.SetOverride(_pin("chat", 6), metadata=AUTH)  # no engine yet: taken
            engine = EngineClient(channel)
            await engine.connect(hello(max_k=4))
            assert (await engine.send(report(1))).accepted
            decisions = snapshot(server).class_view("chat").decisions
            assert decisions and {d.k for d in decisions} == {4}  # capped
            for k in (5, 8):
                code, details = await _code(stub.SetOverride(_pin("chat", k), metadata=AUTH))
                assert code == grpc.StatusCode.INVALID_ARGUMENT
                assert details.startswith(f"override.pin_k: {k} is above 4, the largest K the "
                                          "connected engines offer: pin 4 or less"), details
                assert "num_speculative_tokens" in details
            assert [o.pin_k for o in snapshot(server).overrides] == [6]  # nothing changed
            await stub.SetOverride(_pin("chat", 4), metadata=AUTH)
            await stub.SetOverride(_pin("*", 0), metadata=AUTH)  # off is always there
            # Another engine offering a draft of a larger K raises the bound.
            wide_hello = hello("engine-2", max_k=6)
            wide_hello.drafts[0].name = "draft-wide"
            wide = EngineClient(channel)
            await wide.connect(wide_hello)
            await stub.SetOverride(_pin("chat", 6), metadata=AUTH)
            await wide.close()
            await engine.close()
    finally:
        await server.stop(grace_seconds=0.1)

    server = await start_server(load_settings(**{**FAST_SETTINGS, "declared_classes": ["chat"]}))
    try:
        async with grpc.aio.insecure_channel(server.grpc_target) as channel:
            plain_hello = hello(max_k=0)  # a plain engine: no speculation configured
            del plain_hello.drafts[:]
            plain = EngineClient(channel)
            await plain.connect(plain_hello)
            stub = async_policy_stub(channel)
            code, details = await _code(stub.SetOverride(_pin("chat", 1), metadata=AUTH))
            assert code == grpc.StatusCode.INVALID_ARGUMENT
            assert details.startswith("override.pin_k: 1, but the connected engines offer no "
                                      "speculation"), details
            await stub.SetOverride(_pin("chat", 0), metadata=AUTH)
            await plain.close()
    finally:
        await server.stop(grace_seconds=0.1)


async def test_one_client_holds_at_most_its_share_of_watchers() -> None:
    """A client beyond event_streams_per_client watchers is refused though slots are free, so
    one client cannot take every one of max_watch_streams. Control: the share did not exist
    (every watcher up to max_watch_streams was served to the one client)."""
    server = await start_server(load_settings(**{**FAST_SETTINGS, "max_watch_streams": 8,
                                                 "event_streams_per_client": 2}))
    try:
        async with grpc.aio.insecure_channel(server.grpc_target) as channel:
            policy = async_policy_stub(channel)
            calls = await _watchers_then_refused(policy, 2, "event_streams_per_client")
            for c in calls:
                c.cancel()
    finally:
        await server.stop(grace_seconds=0.1)
