"""The fleet's recommendations end to end: three real controllers sharing a real redis-server,
each beside a synthetic engine of one model with known acceptance and step costs: two
speculative engines with different drafts and one plain engine. Per class, the recommended
(pool, draft) must be the option with the highest true goodput, computed here by brute force
from the scenario's parameters (no controller code), and the RPC, the HTTP endpoint and the
metric must say the same."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import grpc
import numpy as np
import pytest

from benchmarks.redis_servers import RedisServer
from benchmarks.synthetic_engine import SyntheticEngine, TrueCost, brute_force_goodputs, drive
from specpilot.controller import cli
from specpilot.controller.server.app import RunningServer, start_server
from specpilot.controller.server.stubs import async_policy_stub
from specpilot.controller.settings import load_settings
from specpilot.controller.store.redis_store import RedisStore
from specpilot.v1 import policy_pb2

pytestmark = pytest.mark.integration

BATCH = 8
MAX_K = 6
# Two drafts of one target: draft-a is larger (costlier per pass, better on code), draft-b
# smaller (better on chat); both engines pay for speculation even at K = 0; the plain one
# does not. On docs no draft helps, and only the plain pool escapes the overhead.
RATES = {
    "draft-a": {"code": 0.9, "chat": 0.45, "docs": 0.05},
    "draft-b": {"code": 0.55, "chat": 0.8, "docs": 0.05},
}
COSTS = {
    "draft-a": TrueCost(draft_per_pass=0.006, speculative_overhead=0.003),
    "draft-b": TrueCost(draft_per_pass=0.003, speculative_overhead=0.003),
    "": TrueCost(),
}
CLASSES = ("code", "chat", "docs")
SETTINGS: dict[str, Any] = {
    "grpc_port": 0, "http_port": 0, "report_interval_seconds": 0.05, "seed": 3,
    "max_k": MAX_K, "fleet_model": "synthetic-target", "fleet_flush_interval_seconds": 0.1,
    "fleet_recommend_min_tries": 200.0,
}


def true_options(batch: int) -> dict[tuple[str, str, str], float]:
    """Goodput of every (pool, draft) from the scenario's parameters: a draft at its best K,
    speculation off on the speculative engines (their mean), the plain engine."""
    out = {}
    for cls in CLASSES:
        for draft, rates in RATES.items():
            values = brute_force_goodputs(np.full(MAX_K, rates[cls]), batch, COSTS[draft])
            out[(cls, "speculative", draft)] = max(values[1:])
        out[(cls, "speculative", "")] = float(np.mean(
            [batch / COSTS[d].step_seconds(batch, 0) for d in RATES]))
        out[(cls, "plain", "")] = batch / COSTS[""].step_seconds(batch, 0)
    return out


@pytest.fixture
async def fleet(redis: RedisServer) -> AsyncIterator[dict[str, RunningServer]]:
    servers = {}
    try:
        for draft in (*RATES, ""):
            name = f"sidecar-{draft or 'plain'}"
            servers[draft] = await start_server(load_settings(
                **SETTINGS, state_store=redis.url, sidecar_id=name))
        yield servers
    finally:
        for s in servers.values():
            await s.stop(grace_seconds=0.1)


def _engine(draft: str, seed: int) -> SyntheticEngine:
    rates = RATES.get(draft, RATES["draft-a"])  # the plain engine drafts nothing anyway
    return SyntheticEngine({c: np.full(MAX_K, rates[c]) for c in CLASSES}, COSTS[draft],
                           max_k=MAX_K, batch_size=BATCH, engine_id=f"engine-{draft or 'plain'}",
                           draft=draft, seed=seed)


async def test_recommendations_name_the_truly_best_draft_and_pool_per_class(
        fleet: dict[str, RunningServer], redis: RedisServer,
        capsys: pytest.CaptureFixture[str]) -> None:
    await asyncio.gather(*(drive(_engine(d, i), s.grpc_target, reports=200)
                           for i, (d, s) in enumerate(fleet.items())))
    plain = fleet[""]
    assert plain.fleet is not None
    deadline = time.monotonic() + 10
    while {r.traffic_class for r in plain.fleet.recommendations} != set(CLASSES):
        assert time.monotonic() < deadline, plain.fleet.recommendations
        await asyncio.sleep(0.1)

    async with grpc.aio.insecure_channel(plain.grpc_target) as ch:
        resp = await async_policy_stub(ch).GetRecommendations(
            policy_pb2.GetRecommendationsRequest())
    assert resp.computed_unix_seconds > 0
    truth = true_options(BATCH)
    for rec in resp.classes:
        assert rec.batch_size == BATCH  # compared at the fleet's load
        cls = rec.traffic_class
        options = {(o.pool, o.draft): o for o in rec.options}
        assert set(options) == {("speculative", "draft-a"), ("speculative", "draft-b"),
                                ("speculative", ""), ("plain", "")}, cls
        best = max(((p, d) for p, d in options), key=lambda pd: truth[(cls, *pd)])
        best_draft = max(("draft-a", "draft-b", ""), key=lambda d: truth[(cls, "speculative", d)])
        print(f"{cls}: recommended {rec.pool} {rec.draft or 'off'}; " + ", ".join(
            f"{p} {d or 'off'} {o.goodput_tokens_per_second:.0f} (true "
            f"{truth[(cls, p, d)]:.0f}, {o.tries:.0f} tries)" for (p, d), o in options.items()))
        assert (rec.options[0].pool, rec.options[0].draft) == best, cls
        assert (rec.pool, rec.draft) == (best[0], best_draft), cls
        top = rec.options[0]
        assert top.goodput_tokens_per_second == pytest.approx(truth[(cls, *best)], rel=0.15)
        assert all(o.sidecars == (2 if o.pool == "speculative" and not o.draft else 1)
                   for o in rec.options)
        assert all(o.tries >= 200 for o in rec.options if o.draft)

    # The gateway's endpoint on another sidecar and the metric say the same.
    spec = fleet["draft-a"]
    async with aiohttp.ClientSession() as http, \
            http.get(spec.http_url + "/api/recommendations?class=docs") as r:
        body = await r.json()
    (docs,) = body["classes"]
    assert (docs["pool"], docs["options"][0]["pool"]) == ("plain", "plain")
    assert b'specpilot_recommendation{draft="",pool="plain",traffic_class="docs"} 1.0' in (
        spec.metrics.render())

    # The first sidecar by name logged each class's recommendation to the fleet's decision log.
    store = RedisStore.from_url(redis.url)
    try:
        logged = await store.recommendations_log("synthetic-target", 1000)
    finally:
        await store.close()
    newest = {r.traffic_class: (r.pool, r.draft) for _, _, r in logged}
    assert newest == {r.traffic_class: (r.pool, r.draft) for r in resp.classes}
    # Mostly by the first by name; another sidecar logs too in a round where the first's
    # options had not reached the store yet (each round decides from what it reads).
    loggers = [sidecar for sidecar, _, _ in logged]
    names = {f"sidecar-{n or 'plain'}" for n in fleet}
    assert "sidecar-draft-a" in loggers and set(loggers) <= names

    # And the command line: the recommended option of each class is starred.
    capsys.readouterr()  # what was printed above, out of the way
    code = await asyncio.to_thread(cli.main, ["policy", "--target", plain.grpc_target,
                                              "recommend", "--class", "docs"])
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[1:]]
    assert code == 0 and rows[0][:4] == ["docs", str(BATCH), "*", "plain"]
