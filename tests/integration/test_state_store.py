"""The state stores against real servers: the in-memory default, a real redis-server and a real
three-node Redis Cluster hold the same records the same way."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import numpy as np
import pytest

from benchmarks.redis_servers import RedisCluster, RedisServer
from specpilot.contract.pricing import DRAFT_COLUMNS, TARGET_COLUMNS
from specpilot.contract.records import Decision, DecisionEvent, Override, OverrideScope, Reason
from specpilot.controller.core.cost_model import CostEvidence
from specpilot.controller.core.fleet import CostExport, EvidenceEntry, EvidenceExport
from specpilot.controller.core.recommend import (
    PLAIN,
    SPECULATIVE,
    DraftCurve,
    EngineOptions,
    Option,
    Recommendation,
)
from specpilot.controller.store.base import StateStore, StoreUnavailable
from specpilot.controller.store.codec import costs_to_json
from specpilot.controller.store.memory import MemoryStore
from specpilot.controller.store.redis_store import RedisStore, model_tag


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisCluster]:
    cluster = RedisCluster(tmp_path_factory.mktemp("cluster"))
    cluster.start()
    yield cluster
    cluster.stop()


@pytest.fixture(params=["memory", "redis", "cluster"])
async def store(request: pytest.FixtureRequest) -> AsyncIterator[StateStore]:
    kind = request.param
    if kind == "memory":
        s: StateStore = MemoryStore()
    else:
        target = request.getfixturevalue("redis_server" if kind == "redis" else "redis_cluster")
        s = RedisStore.from_url(target.url)
    yield s
    await s.close()


def _export(sidecar: str, at: float, n: float) -> EvidenceExport:
    return EvidenceExport(sidecar, at, (EvidenceEntry("code", "d", (n, n / 2), (1.0, 2.0)),
                                        EvidenceEntry("chat", "d", (n,), (n,))))


async def test_exports_round_trip_per_model_and_replace_the_sidecars_previous(
        store: StateStore, request: pytest.FixtureRequest) -> None:
    model = f"m-{request.node.callspec.id}-{id(store)}"
    await store.put_evidence(model, _export("a", 100.0, 5.0), ttl_seconds=60)
    await store.put_evidence(model, _export("b", 101.0, 7.0), ttl_seconds=60)
    await store.put_evidence(model, _export("a", 102.0, 9.0), ttl_seconds=60)  # replaces a's
    await store.put_evidence(model + "-other", _export("c", 102.0, 1.0), ttl_seconds=60)
    got = await store.evidence(model, since=0.0)
    assert got == [_export("a", 102.0, 9.0), _export("b", 101.0, 7.0)]
    # Older than ``since``: left out (a sidecar that stopped publishing ages out).
    assert [e.sidecar for e in await store.evidence(model, since=101.5)] == ["a"]


async def test_an_expired_export_is_gone(store: StateStore, request: pytest.FixtureRequest) -> None:
    model = f"ttl-{request.node.callspec.id}"
    await store.put_evidence(model, _export("a", 100.0, 5.0), ttl_seconds=0.05)
    await asyncio.sleep(0.2)
    assert await store.evidence(model, since=0.0) == []


async def test_keys_of_a_model_share_one_cluster_slot(redis_cluster: RedisCluster) -> None:
    store = RedisStore.from_url(redis_cluster.url)
    try:
        for model in ("llama-70b", "qwen/qwen3-8b", "odd{name}"):
            await store.put_evidence(model, _export("a", 1.0, 1.0), ttl_seconds=60)
            assert len(await store.evidence(model, since=0.0)) == 1  # MGET of one slot works
        slots = {redis_cluster.nodes[0].cli("CLUSTER", "KEYSLOT", f"specpilot:{model_tag(m)}:{k}")
                 for m in ("llama-70b",) for k in ("sidecars", "evidence:a", "evidence:b")}
        assert len(slots) == 1
    finally:
        await store.close()


async def test_a_malformed_record_is_skipped_not_fatal(redis_server: RedisServer) -> None:
    store = RedisStore.from_url(redis_server.url)
    tag = model_tag("bad")
    try:
        await store.put_evidence("bad", _export("a", 1.0, 1.0), ttl_seconds=60)
        await store.put_evidence("bad", _export("b", 1.0, 2.0), ttl_seconds=60)
        redis_server.cli("SET", f"specpilot:{tag}:evidence:b", '{"format": 1}')
        assert [e.sidecar for e in await store.evidence("bad", since=0.0)] == ["a"]
        await store.put_override("bad", Override("code", pin_k=1))
        for junk in ('{"format": 1, "traffic_class": "x", "pin_k": "9", "force_draft": null, '
                     '"force_off": false, "note": "", "set_at": 1, "set_by": ""}', "not json"):
            redis_server.cli("HSET", f"specpilot:{tag}:overrides", "x", junk)
            assert [o.traffic_class for o in await store.overrides("bad")] == ["code"]
        await store.put_options("bad", _options("a", 1.0), ttl_seconds=60)
        redis_server.cli("SET", f"specpilot:{tag}:options:b", '{"format": 1, "pool": "gpu"}')
        assert [o.sidecar for o in await store.options("bad", since=0.0)] == ["a"]
        await store.put_costs("bad", _costs("a", 1.0), ttl_seconds=60)
        redis_server.cli("SET", f"specpilot:{tag}:costs:b", _short_costs_json())
        assert [c.sidecar for c in await store.costs("bad", since=0.0)] == ["a"]
        await store.add_decisions("bad", "a", [_event(1, 2)], max_len=10)
        redis_server.cli("XADD", f"specpilot:{tag}:decisions", "*", "sidecar", "a",
                         "event", '{"format": 1, "at": "NaN"}')
        assert [e.policy_version for _, e in await store.decisions("bad", 10)] == [1]
    finally:
        await store.close()


async def test_an_unreachable_redis_raises_store_unavailable(tmp_path: Path) -> None:
    down = RedisServer(tmp_path)  # never started: nothing listens on its port
    store = RedisStore.from_url(down.url, timeout_seconds=0.2)
    try:
        with pytest.raises(StoreUnavailable, match="redis"):
            await store.put_evidence("m", _export("a", 1.0, 1.0), ttl_seconds=60)
        with pytest.raises(StoreUnavailable):
            await store.evidence("m", since=0.0)
    finally:
        await store.close()


async def _next_change(changes: AsyncIterator[None]) -> None:
    await asyncio.wait_for(anext(changes), timeout=5.0)


async def test_fleet_overrides_round_trip_and_every_change_is_announced(
        store: StateStore, request: pytest.FixtureRequest) -> None:
    model = f"ov-{request.node.callspec.id}"
    changes = store.override_changes(model)
    await _next_change(changes)  # subscribed
    pin = Override("code", pin_k=2, note="incident 7", set_at=10.0, set_by="sidecar-a")
    await store.put_override(model, pin)
    await _next_change(changes)
    await store.put_override(model, Override("*", force_off=True, set_at=11.0))
    await _next_change(changes)
    await store.put_override(model + "-other", Override("chat", pin_k=1))
    got = await store.overrides(model)
    assert [(o.traffic_class, o.scope) for o in got] == [("*", OverrideScope.FLEET),
                                                         ("code", OverrideScope.FLEET)]
    assert got[1] == Override("code", pin_k=2, note="incident 7", set_at=10.0,
                              scope=OverrideScope.FLEET, set_by="sidecar-a")
    assert await store.clear_override(model, "code")
    await _next_change(changes)
    assert not await store.clear_override(model, "code")
    assert [o.traffic_class for o in await store.overrides(model)] == ["*"]
    await changes.aclose()  # type: ignore[attr-defined]


def _event(version: int, k: int) -> DecisionEvent:
    return DecisionEvent(version, 100.0 + version,
                         Decision("code", 1, "d" if k else "", k, Reason.GOODPUT, 1.2),
                         Decision("code", 1, "", 0, Reason.WARMUP, 1.0, 0.01, 1, "d", True)
                         if version > 1 else None)


async def test_the_decision_log_keeps_about_its_size_newest_last(
        store: StateStore, request: pytest.FixtureRequest) -> None:
    model = f"log-{request.node.callspec.id}"
    await store.add_decisions(model, "a", [_event(v, v % 4) for v in range(1, 301)], max_len=100)
    await store.add_decisions(model, "b", [_event(301, 3)], max_len=100)
    newest = await store.decisions(model, count=5)
    assert [(s, e.policy_version) for s, e in newest] == [
        ("a", 297), ("a", 298), ("a", 299), ("a", 300), ("b", 301)]
    assert newest[-1][1] == _event(301, 3)
    held = await store.decisions(model, count=1000)
    assert 100 <= len(held) < 300  # capped near max_len (Redis trims whole nodes: "about")


async def test_recommendations_share_the_log_with_decisions(
        store: StateStore, request: pytest.FixtureRequest) -> None:
    model = f"rec-{request.node.callspec.id}"
    rec = Recommendation("docs", 3, 8, "", PLAIN, (
        Option(PLAIN, "", 0, 397.5, 0.0, 1, 5000.0),
        Option(SPECULATIVE, "d", 2, 342.0, 3487.0, 2, 9000.0)))
    await store.add_decisions(model, "a", [_event(1, 2)], max_len=100)
    await store.add_recommendations(model, "a", [rec], at=123.0, max_len=100)
    await store.add_decisions(model, "b", [_event(2, 3)], max_len=100)
    assert await store.recommendations_log(model, count=10) == [("a", 123.0, rec)]
    assert [(s, e.policy_version) for s, e in await store.decisions(model, 10)] == [
        ("a", 1), ("b", 2)]
    assert await store.recommendations_log(model, count=1) == []  # newest entry: a decision


def _options(sidecar: str, at: float) -> EngineOptions:
    return EngineOptions(sidecar, at, SPECULATIVE if sidecar != "plain" else PLAIN, 8.0,
                         (1, 8), (100.0, 400.0), 1234.5,
                         (DraftCurve("code", "d", (4, 2), (210.5, 800.0), 950.0),)
                         if sidecar != "plain" else ())


async def test_engine_options_round_trip_and_age_out(
        store: StateStore, request: pytest.FixtureRequest) -> None:
    model = f"opt-{request.node.callspec.id}"
    for sidecar in ("a", "plain"):  # the sidecars' index comes with their evidence
        await store.put_evidence(model, _export(sidecar, 100.0, 1.0), ttl_seconds=60)
        await store.put_options(model, _options(sidecar, 100.0), ttl_seconds=60)
    await store.put_options(model, _options("a", 101.0), ttl_seconds=60)  # replaces a's
    assert await store.options(model, since=0.0) == [_options("a", 101.0),
                                                     _options("plain", 100.0)]
    assert [o.sidecar for o in await store.options(model, since=100.5)] == ["a"]
    await store.put_options(model, _options("a", 102.0), ttl_seconds=0.05)
    await asyncio.sleep(0.2)
    assert [o.sidecar for o in await store.options(model, since=0.0)] == ["plain"]


def _costs(sidecar: str, at: float, scale: float = 1.0) -> CostExport:
    n = TARGET_COLUMNS + 2 + DRAFT_COLUMNS  # the target's columns, two knots, one draft
    x = np.arange(1.0, n + 1)
    return CostExport(sidecar, at, "gpu tp1 pp1 bfloat16", CostEvidence(
        ("d",), (16, 32), scale * np.outer(x, x), np.asarray(scale * 0.01 * x), scale * 1e-4,
        scale * 3.0, scale * 300.0))


def _short_costs_json() -> str:
    """A stored step-cost record with a value of its information matrix missing: refused, not
    misread."""
    raw = json.loads(costs_to_json(_costs("b", 1.0)))
    raw["information_upper"].pop()
    return json.dumps(raw)


async def test_step_cost_exports_round_trip_and_age_out(
        store: StateStore, request: pytest.FixtureRequest) -> None:
    model = f"cost-{request.node.callspec.id}"
    for sidecar in ("a", "b"):  # the sidecars' index comes with their evidence
        await store.put_evidence(model, _export(sidecar, 100.0, 1.0), ttl_seconds=60)
        await store.put_costs(model, _costs(sidecar, 100.0), ttl_seconds=60)
    await store.put_costs(model, _costs("a", 101.0, scale=2.0), ttl_seconds=60)  # replaces a's
    got = await store.costs(model, since=0.0)
    assert [(c.sidecar, c.at, c.hardware) for c in got] == [
        ("a", 101.0, "gpu tp1 pp1 bfloat16"), ("b", 100.0, "gpu tp1 pp1 bfloat16")]
    want = _costs("a", 101.0, scale=2.0).evidence
    assert np.array_equal(got[0].evidence.information, want.information)
    assert (got[0].evidence.drafts, got[0].evidence.knots, got[0].evidence.steps) == (
        ("d",), (16, 32), 600.0)
    assert [c.sidecar for c in await store.costs(model, since=100.5)] == ["a"]
    await store.put_costs(model, _costs("a", 102.0), ttl_seconds=0.05)
    await asyncio.sleep(0.2)
    assert [c.sidecar for c in await store.costs(model, since=0.0)] == ["b"]


def _older_costs_json(sidecar: str, fmt: int) -> str:
    """A step-cost record as an older sidecar stored it: format ``fmt`` (1: before the context
    column, 2: before the speculating-sequence and prefill columns), its vectors that much
    shorter."""
    raw = json.loads(costs_to_json(_costs(sidecar, 100.0)))
    n = len(raw["weighted_times"]) - (3 if fmt == 1 else 2)
    x = np.arange(1.0, n + 1)
    raw["information_upper"] = np.outer(x, x)[np.triu_indices(n)].tolist()
    raw["weighted_times"] = (0.01 * x).tolist()
    raw["format"] = fmt
    return json.dumps(raw)


async def test_a_step_cost_record_of_an_older_or_unknown_format_is_skipped(
        redis_server: RedisServer) -> None:
    """Older sidecars' stored step costs lack columns whose costs their other columns absorbed
    (no empty column undoes that): skipped, as a record of an unknown format is, never misread;
    a current record beside them is read."""
    store = RedisStore.from_url(redis_server.url)
    tag = model_tag("old-costs")
    try:
        for sidecar in ("a", "b", "c", "d"):
            await store.put_evidence("old-costs", _export(sidecar, 100.0, 1.0), ttl_seconds=60)
        await store.put_costs("old-costs", _costs("a", 100.0), ttl_seconds=60)
        redis_server.cli("SET", f"specpilot:{tag}:costs:b", _older_costs_json("b", 1))
        redis_server.cli("SET", f"specpilot:{tag}:costs:c", _older_costs_json("c", 2))
        future = json.loads(costs_to_json(_costs("d", 100.0)))
        future["format"] = 99
        redis_server.cli("SET", f"specpilot:{tag}:costs:d", json.dumps(future))
        got = {c.sidecar: c.evidence for c in await store.costs("old-costs", since=0.0)}
        assert sorted(got) == ["a"]
        assert np.array_equal(got["a"].information, _costs("a", 100.0).evidence.information)
    finally:
        await store.close()
