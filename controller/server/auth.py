"""Bearer tokens, for every edge that takes one (policy writes over gRPC and HTTP, engine
streams): one comparison, in constant time."""

from __future__ import annotations

import hmac
from collections.abc import Iterable
from typing import Any, Literal

Verdict = Literal["ok", "unauthenticated", "permission_denied"]


def bearer_verdict(authorization: str | None, token: bytes) -> Verdict:
    """``authorization`` (``Bearer <token>``, or None when absent) against ``token``."""
    if not authorization:
        return "unauthenticated"
    scheme, _, given = authorization.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), token):
        return "permission_denied"
    return "ok"


def metadata_authorization(metadata: Iterable[tuple[str, Any]] | None) -> str | None:
    """The ``authorization`` value of gRPC invocation metadata (None when absent)."""
    values = [v for k, v in metadata or () if k == "authorization"]
    if not values:
        return None
    return values[0].decode() if isinstance(values[0], bytes) else str(values[0])
