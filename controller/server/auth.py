"""Bearer tokens, for every edge that takes one (policy writes over gRPC and HTTP, engine
streams): one comparison, in constant time. Engines' own tokens, each bound to its engine id.
And the names of a verified client certificate (mTLS engine streams)."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable, Mapping
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


def engine_token(secret: str, engine_id: str) -> str:
    """Engine ``engine_id``'s own token: HMAC-SHA256 of the id under the controller's
    ``engine_secret``, in hex. Holding one engine's token proves nothing about another id, and
    the secret cannot be recovered from tokens."""
    return hmac.new(secret.encode(), engine_id.encode(), hashlib.sha256).hexdigest()


def metadata_authorization(metadata: Iterable[tuple[str, Any]] | None) -> str | None:
    """The ``authorization`` value of gRPC invocation metadata (None when absent)."""
    values = [v for k, v in metadata or () if k == "authorization"]
    if not values:
        return None
    return values[0].decode() if isinstance(values[0], bytes) else str(values[0])


def certificate_names(auth_context: Mapping[str, Iterable[bytes]]) -> frozenset[str] | None:
    """The names of the peer's client certificate as gRPC verified it at the handshake (its
    common name and subject alternative names), or None when the peer presented none (a
    plaintext or server-only TLS connection). gRPC puts ``x509_*`` properties in the auth
    context only for a certificate that chained to the server's client CA."""
    if not auth_context.get("x509_pem_cert"):
        return None
    return frozenset(v.decode(errors="replace")
                     for key in ("x509_common_name", "x509_subject_alternative_name")
                     for v in auth_context.get(key, ()))
