"""The fleet's store: Redis, standalone or Cluster (redis-py's asyncio clients).

Keys of one model share the hash tag ``{<model>}``, so they live in one Cluster slot and
multi-key reads (MGET) work there as on a single server:

    specpilot:{<model>}:evidence:<sidecar>   one sidecar's latest export (JSON), with a TTL
    specpilot:{<model>}:sidecars             sorted set: sidecar -> time of its latest export

Every Redis error surfaces as ``StoreUnavailable``; retrying is the caller's business.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

from redis import asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import RedisError

from controller.core.fleet import EvidenceExport
from controller.store.base import StoreUnavailable
from controller.store.codec import StoredRecordError, export_from_json, export_to_json

log = logging.getLogger(__name__)
CLUSTER_SCHEME = "redis+cluster://"


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

    async def evidence(self, model: str, since: float) -> list[EvidenceExport]:
        tag = model_tag(model)
        index = f"specpilot:{tag}:sidecars"
        try:
            await self._r.zremrangebyscore(index, "-inf", f"({since}")
            sidecars = [s.decode() if isinstance(s, bytes) else str(s)
                        for s in await self._r.zrangebyscore(index, since, "+inf")]
            if not sidecars:
                return []
            values = await self._r.mget([f"specpilot:{tag}:evidence:{s}" for s in sidecars])
        except (RedisError, OSError) as exc:
            raise StoreUnavailable(f"redis: {exc}") from exc
        out = []
        for sidecar, value in zip(sidecars, values, strict=True):
            if value is None:
                continue  # expired: the sidecar left
            try:
                out.append(export_from_json(value))
            except StoredRecordError as exc:
                log.warning("skipping the stored evidence of sidecar %r: %s", sidecar, exc)
        return sorted(out, key=lambda ex: ex.sidecar)

    async def close(self) -> None:
        with contextlib.suppress(RedisError, OSError):
            await self._r.aclose()
