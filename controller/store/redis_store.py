"""The fleet's store: Redis, standalone or Cluster (redis-py's asyncio clients).

Keys of one model share the hash tag ``{<model>}``, so they live in one Cluster slot and
multi-key reads (MGET) work there as on a single server:

    specpilot:{<model>}:evidence:<sidecar>   one sidecar's latest export (JSON), with a TTL
    specpilot:{<model>}:sidecars             sorted set: sidecar -> time of its latest export
    specpilot:{<model>}:costs:<sidecar>      its step-cost evidence (JSON), with a TTL
    specpilot:{<model>}:options:<sidecar>    what its engines achieve (JSON), with a TTL
    specpilot:{<model>}:overrides            hash: class -> fleet override (JSON); also the
                                             pub/sub channel that announces each change
    specpilot:{<model>}:decisions            stream, capped (MAXLEN ~): sidecar and an event or
                                             a recommendation (JSON)

Every Redis error surfaces as ``StoreUnavailable``; retrying is the caller's business.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, TypeVar

from redis import asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import RedisError

from specpilot.contract.records import DecisionEvent, Override
from specpilot.controller.core.fleet import CostExport, EvidenceExport
from specpilot.controller.core.recommend import EngineOptions, Recommendation
from specpilot.controller.logsafe import safe_name
from specpilot.controller.store.base import StoreUnavailable
from specpilot.controller.store.codec import (
    StoredRecordError,
    costs_from_json,
    costs_to_json,
    event_from_json,
    event_to_json,
    export_from_json,
    export_to_json,
    options_from_json,
    options_to_json,
    override_from_json,
    override_to_json,
    recommendation_from_json,
    recommendation_to_json,
)

log = logging.getLogger(__name__)
R = TypeVar("R")
CLUSTER_SCHEME = "redis+cluster://"
# How long one wait for an override announcement blocks before looking again (seconds).
_SUBSCRIBE_POLL_SECONDS = 1.0


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def model_tag(model: str) -> str:
    """The hash tag of a model's keys (braces in the name would end the tag early)."""
    return "{" + model.replace("{", "_").replace("}", "_") + "}"


class RedisStore:
    def __init__(self, client: Any) -> None:
        self._r = client

    @classmethod
    def from_url(cls, url: str, timeout_seconds: float = 1.0) -> RedisStore:
        """``redis://host:port/db`` (or ``rediss://``) for one server, ``redis+cluster://host:port``
        for a Cluster (any node; the others are discovered)."""
        if url.startswith(CLUSTER_SCHEME):
            return cls(RedisCluster.from_url("redis://" + url[len(CLUSTER_SCHEME):],
                                             socket_timeout=timeout_seconds,
                                             socket_connect_timeout=timeout_seconds))
        return cls(aioredis.Redis.from_url(url, socket_timeout=timeout_seconds,
                                           socket_connect_timeout=timeout_seconds))

    async def put_evidence(self, model: str, export: EvidenceExport,
                           ttl_seconds: float) -> None:
        tag = model_tag(model)
        try:
            await self._r.set(f"specpilot:{tag}:evidence:{export.sidecar}",
                              export_to_json(export), px=max(int(ttl_seconds * 1000), 1))
            await self._r.zadd(f"specpilot:{tag}:sidecars", {export.sidecar: export.at})
        except (RedisError, OSError) as exc:
            raise StoreUnavailable(f"redis: {exc}") from exc

    async def _per_sidecar(self, tag: str, sidecars: list[str], kind: str,
                           parse: Callable[[bytes], R], what: str) -> list[R]:
        """Each listed sidecar's ``kind`` record, parsed; expired ones (the sidecar left) and
        unreadable ones (with a warning) left out."""
        if not sidecars:
            return []
        try:
            values = await self._r.mget([f"specpilot:{tag}:{kind}:{s}" for s in sidecars])
        except (RedisError, OSError) as exc:
            raise StoreUnavailable(f"redis: {exc}") from exc
        out = []
        for sidecar, value in zip(sidecars, values, strict=True):
            if value is None:
                continue
            try:
                out.append(parse(value))
            except StoredRecordError as exc:
                log.warning("skipping the stored %s of sidecar %s: %s", what, safe_name(sidecar),
                            safe_name(exc, 300))
        return out

    async def evidence(self, model: str, since: float) -> list[EvidenceExport]:
        tag = model_tag(model)
        index = f"specpilot:{tag}:sidecars"
        try:
            await self._r.zremrangebyscore(index, "-inf", f"({since}")
            sidecars = [_text(s) for s in await self._r.zrangebyscore(index, since, "+inf")]
        except (RedisError, OSError) as exc:
            raise StoreUnavailable(f"redis: {exc}") from exc
        out = await self._per_sidecar(tag, sidecars, "evidence", export_from_json, "evidence")
        return sorted(out, key=lambda ex: ex.sidecar)

    async def _put(self, model: str, kind: str, sidecar: str, value: str,
                   ttl_seconds: float) -> None:
        try:
            await self._r.set(f"specpilot:{model_tag(model)}:{kind}:{sidecar}", value,
                              px=max(int(ttl_seconds * 1000), 1))
        except (RedisError, OSError) as exc:
            raise StoreUnavailable(f"redis: {exc}") from exc

    async def _listed(self, model: str, kind: str, parse: Callable[[bytes], R],
                      what: str) -> list[R]:
        """Every indexed sidecar's ``kind`` record. The sidecars' index is the evidence's (a
        sidecar publishes it every round); the records' own times decide what is recent."""
        tag = model_tag(model)
        try:
            sidecars = [_text(s) for s in await self._r.zrange(f"specpilot:{tag}:sidecars", 0, -1)]
        except (RedisError, OSError) as exc:
            raise StoreUnavailable(f"redis: {exc}") from exc
        return await self._per_sidecar(tag, sidecars, kind, parse, what)

    async def put_costs(self, model: str, export: CostExport, ttl_seconds: float) -> None:
        try:
            value = costs_to_json(export)
        except ValueError as exc:  # not finite: the core never makes one, a bug must not spread
            log.warning("step costs not published to the store: %s", exc)
            return
        await self._put(model, "costs", export.sidecar, value, ttl_seconds)

    async def costs(self, model: str, since: float) -> list[CostExport]:
        out = await self._listed(model, "costs", costs_from_json, "step costs")
        return sorted((c for c in out if c.at >= since), key=lambda c: c.sidecar)

    async def put_options(self, model: str, options: EngineOptions, ttl_seconds: float) -> None:
        await self._put(model, "options", options.sidecar, options_to_json(options),
                        ttl_seconds)

    async def options(self, model: str, since: float) -> list[EngineOptions]:
        out = await self._listed(model, "options", options_from_json, "engine options")
        return sorted((o for o in out if o.at >= since), key=lambda o: o.sidecar)

    async def put_override(self, model: str, override: Override) -> None:
        key = f"specpilot:{model_tag(model)}:overrides"
        try:
            await self._r.hset(key, override.traffic_class, override_to_json(override))
            await self._r.publish(key, override.traffic_class)
        except (RedisError, OSError) as exc:
            raise StoreUnavailable(f"redis: {exc}") from exc

    async def clear_override(self, model: str, traffic_class: str) -> bool:
        key = f"specpilot:{model_tag(model)}:overrides"
        try:
            cleared = bool(await self._r.hdel(key, traffic_class))
            if cleared:
                await self._r.publish(key, traffic_class)
        except (RedisError, OSError) as exc:
            raise StoreUnavailable(f"redis: {exc}") from exc
        return cleared

    async def overrides(self, model: str) -> list[Override]:
        try:
            held = await self._r.hgetall(f"specpilot:{model_tag(model)}:overrides")
        except (RedisError, OSError) as exc:
            raise StoreUnavailable(f"redis: {exc}") from exc
        out = []
        for cls, value in sorted((_text(c), v) for c, v in held.items()):
            try:
                out.append(override_from_json(value))
            except StoredRecordError as exc:
                log.warning("skipping the stored fleet override on class %s: %s",
                            safe_name(cls), safe_name(exc, 300))
        return out

    async def override_changes(self, model: str) -> AsyncIterator[None]:
        channel = f"specpilot:{model_tag(model)}:overrides"
        try:
            if isinstance(self._r, RedisCluster):
                await self._r.initialize()  # its pubsub picks a node from the slots it learnt
            pubsub = self._r.pubsub()
        except (RedisError, OSError) as exc:
            raise StoreUnavailable(f"redis: {exc}") from exc
        try:
            await pubsub.subscribe(channel)
            yield None
            while True:
                if await pubsub.get_message(ignore_subscribe_messages=True,
                                            timeout=_SUBSCRIBE_POLL_SECONDS) is not None:
                    yield None
        except (RedisError, OSError) as exc:
            raise StoreUnavailable(f"redis: {exc}") from exc
        finally:
            with contextlib.suppress(RedisError, OSError):
                await pubsub.aclose()

    async def _append(self, model: str, entries: list[dict[str, str]], max_len: int) -> None:
        if not entries:
            return
        key = f"specpilot:{model_tag(model)}:decisions"
        try:
            async with self._r.pipeline(transaction=False) as pipe:
                for fields in entries:
                    pipe.xadd(key, fields, maxlen=max_len, approximate=True)
                await pipe.execute()
        except (RedisError, OSError) as exc:
            raise StoreUnavailable(f"redis: {exc}") from exc

    async def _newest(self, model: str, count: int) -> list[tuple[str, dict[str, Any]]]:
        if count <= 0:
            return []
        try:
            entries = await self._r.xrevrange(f"specpilot:{model_tag(model)}:decisions",
                                              count=count)
        except (RedisError, OSError) as exc:
            raise StoreUnavailable(f"redis: {exc}") from exc
        return [(_text(i), {_text(k): v for k, v in fields.items()})
                for i, fields in reversed(entries)]

    async def add_decisions(self, model: str, sidecar: str, events: Sequence[DecisionEvent],
                            max_len: int) -> None:
        entries = []
        for e in events:
            try:
                entries.append({"sidecar": sidecar, "event": event_to_json(e)})
            except ValueError as exc:
                log.warning("decision on class %s not logged to the store: %s",
                            safe_name(e.decision.traffic_class), safe_name(exc, 300))
        await self._append(model, entries, max_len)

    async def decisions(self, model: str, count: int) -> list[tuple[str, DecisionEvent]]:
        out = []
        for entry_id, fields in await self._newest(model, count):
            if "event" not in fields:
                continue  # a recommendation
            try:
                out.append((_text(fields["sidecar"]), event_from_json(fields["event"])))
            except (KeyError, StoredRecordError) as exc:
                log.warning("skipping decision log entry %s: %s", safe_name(entry_id),
                            safe_name(exc, 300))
        return out

    async def add_recommendations(self, model: str, sidecar: str,
                                  recommendations: Sequence[Recommendation], at: float,
                                  max_len: int) -> None:
        entries = []
        for r in recommendations:
            try:
                entries.append({"sidecar": sidecar,
                                "recommendation": recommendation_to_json(r, at)})
            except ValueError as exc:
                log.warning("recommendation for class %s not logged to the store: %s",
                            safe_name(r.traffic_class), safe_name(exc, 300))
        await self._append(model, entries, max_len)

    async def recommendations_log(self, model: str, count: int
                                  ) -> list[tuple[str, float, Recommendation]]:
        out = []
        for entry_id, fields in await self._newest(model, count):
            if "recommendation" not in fields:
                continue
            try:
                at, rec = recommendation_from_json(fields["recommendation"])
                out.append((_text(fields["sidecar"]), at, rec))
            except (KeyError, StoredRecordError) as exc:
                log.warning("skipping decision log entry %s: %s", safe_name(entry_id),
                            safe_name(exc, 300))
        return out

    async def close(self) -> None:
        with contextlib.suppress(RedisError, OSError):
            await self._r.aclose()
