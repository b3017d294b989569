"""Two real controllers sharing a real redis-server: evidence learnt through one is used by the
other without double counting, step costs only between engines on the same hardware; an
override set through one is in force on both (a pod one only
on its own); a controller killed and restarted resumes from its last flush, one stopped
gracefully from all it had; what an engine taught is published when it leaves, though no
fleet_model is set; an outage of Redis costs nothing but sharing."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import numpy as np
import pytest

from benchmarks.redis_servers import RedisServer
from specpilot.controller.server.app import RunningServer, start_server
from specpilot.controller.server.stubs import async_policy_stub
from specpilot.controller.settings import load_settings
from specpilot.controller.store.redis_store import RedisStore
from specpilot.v1 import engine_pb2, policy_pb2
from tests.integration.conftest import FAST_SETTINGS, TOKEN
from tests.integration.engine_client import DRAFT, EngineClient, acceptance, hello, report

FLUSH = 0.1
AUTH = (("authorization", f"Bearer {TOKEN}"),)
# The plugin's default report interval, seconds: the bound on how soon a fleet override must be
# in force on every sidecar (the tests' controllers run with a much shorter one).
DEFAULT_REPORT_INTERVAL = 1.0
pytestmark = pytest.mark.integration


async def _controller(redis: RedisServer, sidecar: str, **extra: Any) -> RunningServer:
    return await start_server(load_settings(**{
        **FAST_SETTINGS, "state_store": redis.url, "sidecar_id": sidecar,
        "fleet_model": "tiny-target", "fleet_flush_interval_seconds": FLUSH,
        "declared_classes": ["chat"], **extra}))


@pytest.fixture
async def pair(redis: RedisServer) -> AsyncIterator[tuple[RunningServer, RunningServer]]:
    a = await _controller(redis, "sidecar-a")
    b = await _controller(redis, "sidecar-b")
    try:
        yield a, b
    finally:
        await a.stop(grace_seconds=0.1)
        await b.stop(grace_seconds=0.1)


async def _teach(ch: grpc.aio.Channel, engine_id: str, histogram: tuple[int, ...],
                 reports: int) -> EngineClient:
    """An engine on ``ch`` that sent ``reports`` reports of ``histogram``, still connected."""
    client = EngineClient(ch)
    await client.connect(hello(engine_id))
    for seq in range(1, reports + 1):
        await client.send(report(seq, acceptance("chat", histogram)))
    return client


async def _feed(server: RunningServer, engine_id: str, histogram: tuple[int, ...],
                reports: int) -> None:
    async with grpc.aio.insecure_channel(server.grpc_target) as ch:
        await (await _teach(ch, engine_id, histogram, reports)).close()


def _own_and_total(server: RunningServer) -> tuple[np.ndarray, np.ndarray]:
    """Position-1 accepts: this controller's own evidence and its posterior's (own + fleet),
    both as of now."""
    now = time.time()
    own = dict(((e.traffic_class, e.draft), e) for e in server.core.export_evidence(now))
    est = server.core.estimate("chat", DRAFT, now)
    mine = np.array(own[("chat", DRAFT)].accepts) if ("chat", DRAFT) in own else np.zeros(1)
    return mine, np.array(est.alpha) - est.prior_alpha


async def _until(predicate: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.05)


async def test_evidence_learnt_through_one_controller_is_used_by_the_other(
        pair: tuple[RunningServer, RunningServer]) -> None:
    a, b = pair
    await _feed(a, "engine-a", (10, 20, 70), reports=5)  # 100 steps, 90 accepted at position 1
    await _feed(b, "engine-b", (50, 30, 20), reports=2)  # 100 steps, 50 accepted
    # B's posterior = B's own + A's, and A's = A's own + B's: the merged counts are the sum of
    # the two sidecars' own (decay within a second is below the tolerance), never more.
    def merged() -> bool:
        a_own, a_all = _own_and_total(a)
        b_own, b_all = _own_and_total(b)
        total = a_own[0] + b_own[0]
        return bool(abs(a_all[0] - total) < 0.01 * total and abs(b_all[0] - total) < 0.01 * total)
    await _until(merged)
    a_own, _ = _own_and_total(a)
    assert a_own[0] == pytest.approx(450, rel=0.01)  # its own stays its own
    await asyncio.sleep(5 * FLUSH)  # more rounds re-read the same exports: still no double count
    assert merged()


async def test_a_killed_controller_resumes_from_its_last_flush(redis: RedisServer) -> None:
    a = await _controller(redis, "sidecar-a")
    try:
        await _feed(a, "engine-a", (10, 20, 70), reports=5)
        await asyncio.sleep(3 * FLUSH)  # flushed
        before, _ = _own_and_total(a)
    finally:
        await a.stop(grace_seconds=0.0)  # no final flush: what a SIGKILL leaves behind
    restarted = await _controller(redis, "sidecar-a")
    try:
        await _until(lambda: _own_and_total(restarted)[0][0] > 0)
        after, total = _own_and_total(restarted)
        assert after[0] == pytest.approx(before[0], rel=0.02)
        assert total[0] == pytest.approx(after[0], rel=0.02)  # not counted again as a peer's
    finally:
        await restarted.stop(grace_seconds=0.1)


async def test_a_redis_outage_keeps_the_controller_deciding_and_it_resyncs(
        pair: tuple[RunningServer, RunningServer], redis: RedisServer) -> None:
    a, b = pair
    redis.stop()
    await _feed(a, "engine-a", (10, 20, 70), reports=5)  # reports are accepted meanwhile
    assert _own_and_total(a)[0][0] == pytest.approx(450, rel=0.01)
    await _until(lambda: b"specpilot_state_store_up 0.0" in a.metrics.render())
    redis.start()  # back, empty: the next rounds publish again and B learns A's evidence
    await _until(lambda: _own_and_total(b)[1][0] > 400, timeout=15.0)
    # A's gauge moves when its whole round is done, a little after B can see its evidence.
    await _until(lambda: b"specpilot_state_store_up 1.0" in a.metrics.render())


def _pins(update: engine_pb2.PolicyUpdate, cls: str) -> set[int]:
    return {d.k for d in update.decisions if d.traffic_class == cls}


async def _policy_until(engine: EngineClient, cls: str, ks: set[int]) -> None:
    """Read policy updates until one has decisions for ``cls``, all with K in ``ks``."""
    while True:
        pins = _pins(await engine.next_policy(), cls)
        if pins and pins <= ks:
            return


async def test_an_override_set_through_one_controller_is_in_force_on_both(
        pair: tuple[RunningServer, RunningServer], redis: RedisServer) -> None:
    a, b = pair
    async with grpc.aio.insecure_channel(a.grpc_target) as ch_a, \
            grpc.aio.insecure_channel(b.grpc_target) as ch_b:
        engine_a, engine_b = EngineClient(ch_a), EngineClient(ch_b)
        await engine_a.connect(hello("engine-a"))
        await engine_b.connect(hello("engine-b"))
        policy_a, policy_b = async_policy_stub(ch_a), async_policy_stub(ch_b)

        # Default scope with a shared store: the fleet. B's engine gets it within one report
        # interval, and B's GetPolicy says where it came from.
        start = time.monotonic()
        await policy_a.SetOverride(policy_pb2.SetOverrideRequest(override=policy_pb2.Override(
            traffic_class="chat", pin_k=1, note="canary")), metadata=AUTH)
        await _policy_until(engine_b, "chat", {1})
        elapsed = time.monotonic() - start
        print(f"\nfleet override in force on the other sidecar's engine after "
              f"{1e3 * elapsed:.0f} ms")
        assert elapsed < DEFAULT_REPORT_INTERVAL
        (chat,) = (await policy_b.GetPolicy(
            policy_pb2.GetPolicyRequest(traffic_class="chat"))).classes
        (ov,) = chat.overrides
        assert (ov.scope, ov.set_by, ov.note) == (
            policy_pb2.OVERRIDE_SCOPE_FLEET, "sidecar-a", "canary")
        assert all(d.k == 1 for d in chat.decisions)

        # A pod override through A is A's alone, and beats the fleet's there.
        pod = policy_pb2.Override(traffic_class="chat", pin_k=3,
                                  scope=policy_pb2.OVERRIDE_SCOPE_POD)
        await policy_a.SetOverride(policy_pb2.SetOverrideRequest(override=pod), metadata=AUTH)
        await _policy_until(engine_a, "chat", {3})
        await asyncio.sleep(5 * FLUSH)  # rounds of both went by
        assert {d.k for d in b.core.snapshot(time.time()).class_view("chat").decisions} == {1}

        # Cleared through B: lifted on both (A keeps its pod override).
        cleared = await policy_b.ClearOverride(
            policy_pb2.ClearOverrideRequest(traffic_class="chat"), metadata=AUTH)
        assert cleared.cleared
        await _until(lambda: not b.core.fleet_overrides() and not a.core.fleet_overrides(),
                     timeout=DEFAULT_REPORT_INTERVAL)
        assert [o.pin_k for o in a.core.snapshot(time.time()).class_view("chat").overrides] == [3]
        await engine_a.close()
        await engine_b.close()

    # Both sidecars' decisions reached the fleet's decision log.
    store = RedisStore.from_url(redis.url)
    try:
        deadline = time.monotonic() + 5
        while True:
            sidecars = {s for s, _ in await store.decisions("tiny-target", 1000)}
            if sidecars == {"sidecar-a", "sidecar-b"} or time.monotonic() > deadline:
                break
            await asyncio.sleep(FLUSH)
        assert sidecars == {"sidecar-a", "sidecar-b"}
    finally:
        await store.close()


async def test_a_fleet_override_waits_for_redis_and_nothing_changes_meanwhile(
        pair: tuple[RunningServer, RunningServer], redis: RedisServer) -> None:
    a, _ = pair
    redis.stop()
    async with grpc.aio.insecure_channel(a.grpc_target) as ch:
        policy = async_policy_stub(ch)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await policy.SetOverride(policy_pb2.SetOverrideRequest(override=policy_pb2.Override(
                traffic_class="chat", force_off=True)), metadata=AUTH)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "scope pod" in (err.value.details() or "")
        assert a.core.snapshot(time.time()).overrides == ()
        pod = policy_pb2.Override(traffic_class="chat", force_off=True,
                                  scope=policy_pb2.OVERRIDE_SCOPE_POD)
        await policy.SetOverride(policy_pb2.SetOverrideRequest(override=pod), metadata=AUTH)
        assert [o.force_off for o in a.core.snapshot(time.time()).overrides] == [True]


async def test_a_graceful_stop_flushes_what_came_after_the_last_round(
        redis: RedisServer) -> None:
    a = await _controller(redis, "sidecar-a", fleet_flush_interval_seconds=60.0)
    store = RedisStore.from_url(redis.url)
    ch = grpc.aio.insecure_channel(a.grpc_target)
    try:
        while not await store.evidence("tiny-target", since=0.0):  # the first round is done
            await asyncio.sleep(0.05)
        await _teach(ch, "engine-a", (10, 20, 70), reports=5)  # after it: only in memory
        before, _ = _own_and_total(a)
    finally:
        await a.stop(grace_seconds=1.0)  # the engine still connected
        await ch.close(None)
        await store.close()
    restarted = await _controller(redis, "sidecar-a")
    try:
        await _until(lambda: _own_and_total(restarted)[0][0] > 0)
        assert _own_and_total(restarted)[0][0] == pytest.approx(before[0], rel=0.02)
    finally:
        await restarted.stop(grace_seconds=0.1)


async def test_what_an_engine_taught_is_published_when_it_leaves_without_fleet_model(
        redis: RedisServer) -> None:
    # The model known only from the engine's hello, and the next round a minute away.
    a = await _controller(redis, "sidecar-a", fleet_model="", fleet_flush_interval_seconds=60.0)
    store = RedisStore.from_url(redis.url)
    try:
        await _feed(a, "engine-a", (10, 20, 70), reports=5)  # 100 steps, 90 accepted, then gone
        async def published() -> float:
            own = [ex for ex in await store.evidence("tiny-target", since=0.0)
                   if ex.sidecar == "sidecar-a"]
            return sum(e.accepts[0] for e in own[0].entries) if own else 0.0
        deadline = time.monotonic() + 10.0
        while (accepted := await published()) == 0.0:
            assert time.monotonic() < deadline, "nothing published after the engine left"
            await asyncio.sleep(0.05)
        assert accepted == pytest.approx(450, rel=0.02)
        assert a.fleet is not None and a.fleet.model() == "tiny-target"
    finally:
        await a.stop(grace_seconds=0.1)
        await store.close()


GPU = "NVIDIA H100 80GB HBM3 tp1 pp1 bfloat16"


def _timed(seq: int, seconds_per_step: float) -> engine_pb2.EngineReport:
    """100 steps at batch 1 with K=3 of the model draft, each ``seconds_per_step`` long."""
    return engine_pb2.EngineReport(sequence=seq, interval_seconds=0.05, step_timings=[
        engine_pb2.StepTiming(batch_bucket=0, draft=DRAFT, k=3, steps=100, sum_batch_size=100,
                              sum_verified_tokens=400, sum_draft_tokens=300,
                              sum_step_seconds=100 * seconds_per_step)])


def _on(hardware: str, engine_id: str) -> engine_pb2.EngineHello:
    h = hello(engine_id)
    h.hardware = hardware
    return h


def _step(server: RunningServer) -> float:
    """The controller's price of a batch-1 step with K=3 of the model draft, seconds."""
    return server.core.predicted_step_seconds(1, DRAFT, 3)


async def test_step_costs_learnt_on_one_hardware_price_the_others_steps_there_only(
        redis: RedisServer) -> None:
    servers = [await _controller(redis, s) for s in ("sidecar-a", "sidecar-b", "sidecar-l4")]
    a, b, other = servers
    try:
        async with contextlib.AsyncExitStack() as stack:
            engines = []
            for i, hardware in enumerate((GPU, GPU, "NVIDIA L4 tp1 pp1 bfloat16")):
                ch = await stack.enter_async_context(grpc.aio.insecure_channel(
                    servers[i].grpc_target))
                engines.append(EngineClient(ch))
                await engines[-1].connect(_on(hardware, f"engine-{i}"))
            prior = _step(a)
            assert _step(b) == _step(other) == prior
            for seq in range(1, 21):  # only A's engine times steps: 10x the generic prior
                await engines[0].send(_timed(seq, 10 * prior))
            assert _step(a) > 5 * prior
            await _until(lambda: _step(b) > 0.8 * _step(a))
            assert _step(b) == pytest.approx(_step(a), rel=0.02)
            await asyncio.sleep(5 * FLUSH)  # another engine type's never arrive (the control)
            assert _step(other) == pytest.approx(prior, rel=0.02)
            for engine in engines:
                await engine.close()
    finally:
        for server in servers:
            await server.stop(grace_seconds=0.1)


async def test_a_killed_controller_resumes_its_step_costs_from_its_last_flush(
        redis: RedisServer) -> None:
    a = await _controller(redis, "sidecar-a")
    try:
        async with grpc.aio.insecure_channel(a.grpc_target) as ch:
            engine = EngineClient(ch)
            await engine.connect(_on(GPU, "engine-a"))
            prior = _step(a)
            for seq in range(1, 21):
                await engine.send(_timed(seq, 10 * prior))
            learnt = _step(a)
            assert learnt > 5 * prior
            await asyncio.sleep(3 * FLUSH)  # flushed
            await engine.close()
    finally:
        await a.stop(grace_seconds=0.0)  # no final flush: what a SIGKILL leaves behind
    restarted = await _controller(redis, "sidecar-a")
    try:
        async with grpc.aio.insecure_channel(restarted.grpc_target) as ch:
            engine = EngineClient(ch)
            # It reconnects, naming its hardware; nothing else can teach this controller the
            # learnt costs (no other sidecar, no timings): only its own flushed record.
            await engine.connect(_on(GPU, "engine-a"))
            await _until(lambda: _step(restarted) > 0.8 * learnt)
            assert _step(restarted) == pytest.approx(learnt, rel=0.02)
            await engine.close()
    finally:
        await restarted.stop(grace_seconds=0.1)
