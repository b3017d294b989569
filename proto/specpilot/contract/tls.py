"""TLS for the controller's listeners and for the clients that reach them (the CLI, the engine
plugin's link): PEM files read and checked once, with errors that name the setting.

Server side (``server_tls``): one certificate and key for the gRPC and the HTTP listener; with a
client CA, gRPC credentials that require a client certificate signed by it. gRPC's Python API has
two client-certificate modes only: not asked for, or required and verified at the handshake
(``ssl_server_credentials(require_client_auth=...)``; no "ask but allow none"). So
``tls_client_auth`` "engines" runs a second gRPC port that requires one, and engine streams on
the main port are refused by ``EngineService`` (docs/reliability.md, "TLS and mTLS").

The files are read at start-up: a rotated certificate takes a restart.
"""

from __future__ import annotations

import ssl
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import grpc

ClientAuth = Literal["all", "engines"]


class TLSError(ValueError):
    """A TLS file is missing, unreadable or does not fit; the message names the setting."""


def read_pem(path: str, setting: str) -> bytes:
    """The PEM file at ``path``; TLSError naming ``setting`` if it cannot be read or holds no
    PEM block."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise TLSError(f"{setting} {path!r}: {exc.strerror or exc}") from exc
    if b"-----BEGIN " not in data:
        raise TLSError(f"{setting} {path!r}: not a PEM file")
    return data


def _no_password() -> bytes:
    # Called by OpenSSL only for an encrypted key, instead of prompting on the terminal.
    raise TLSError("the key is encrypted; specpilot needs an unencrypted PEM key")


@dataclass(frozen=True)
class ServerTLS:
    """The listeners' TLS: the PEM material, and the HTTP listener's context."""

    cert_chain: bytes
    key: bytes
    client_ca: bytes | None
    client_auth: ClientAuth
    http_context: ssl.SSLContext

    def grpc_credentials(self, *, client_certificates: bool) -> grpc.ServerCredentials:
        """Credentials of a gRPC port; ``client_certificates``: the handshake requires a client
        certificate signed by the client CA (refused without one)."""
        pairs = [(self.key, self.cert_chain)]
        if client_certificates and self.client_ca is not None:
            return grpc.ssl_server_credentials(pairs, root_certificates=self.client_ca,
                                               require_client_auth=True)
        return grpc.ssl_server_credentials(pairs)

    @property
    def main_port_requires_client_certificates(self) -> bool:
        return self.client_ca is not None and self.client_auth == "all"


def server_tls(cert_file: str, key_file: str, client_ca_file: str = "",
               client_auth: ClientAuth = "all") -> ServerTLS | None:
    """The listeners' TLS from the settings' files, None without a certificate; TLSError naming
    the setting when one is missing, unreadable, not PEM, or the key does not match."""
    if bool(cert_file) != bool(key_file):
        missing, given = (("tls_key_file", "tls_cert_file") if cert_file
                          else ("tls_cert_file", "tls_key_file"))
        raise TLSError(f"{given} is set but {missing} is not: set both (PEM) or neither")
    if not cert_file:
        if client_ca_file:
            raise TLSError("tls_client_ca_file needs tls_cert_file and tls_key_file: client "
                           "certificates are asked for only over TLS")
        return None
    chain = read_pem(cert_file, "tls_cert_file")
    key = read_pem(key_file, "tls_key_file")
    if b"CERTIFICATE-----" not in chain:
        raise TLSError(f"tls_cert_file {cert_file!r}: holds no PEM certificate")
    if b"PRIVATE KEY-----" not in key:
        raise TLSError(f"tls_key_file {key_file!r}: holds no PEM private key")
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(cert_file, key_file, password=_no_password)
    except TLSError as exc:
        raise TLSError(f"tls_key_file {key_file!r}: {exc}") from exc
    except (ssl.SSLError, OSError) as exc:
        why = "does not match tls_cert_file" if "KEY_VALUES_MISMATCH" in str(exc) else str(exc)
        raise TLSError(f"tls_cert_file {cert_file!r} with tls_key_file {key_file!r}: {why}"
                       ) from exc
    client_ca = None
    if client_ca_file:
        client_ca = read_pem(client_ca_file, "tls_client_ca_file")
        try:
            ssl.create_default_context(cadata=client_ca.decode("ascii", "replace"))
        except (ssl.SSLError, ValueError) as exc:
            raise TLSError(f"tls_client_ca_file {client_ca_file!r}: no usable CA certificate "
                           f"({exc})") from exc
    return ServerTLS(chain, key, client_ca, client_auth, context)


# --- clients --------------------------------------------------------------------------------------
def channel_credentials(ca_file: str, cert_file: str = "", key_file: str = "",
                        names: tuple[str, str, str] = ("--tls-ca", "--tls-cert", "--tls-key"),
                        ) -> grpc.ChannelCredentials:
    """TLS credentials that verify the server against ``ca_file`` and, with ``cert_file`` and
    ``key_file``, present that client certificate; TLSError naming the option (``names``)."""
    ca_name, cert_name, key_name = names
    if bool(cert_file) != bool(key_file):
        raise TLSError(f"{cert_name} and {key_name} go together (the client certificate and "
                       "its key)")
    root = read_pem(ca_file, ca_name)
    if not cert_file:
        return grpc.ssl_channel_credentials(root_certificates=root)
    return grpc.ssl_channel_credentials(root_certificates=root,
                                        private_key=read_pem(key_file, key_name),
                                        certificate_chain=read_pem(cert_file, cert_name))


def server_name_options(server_name: str) -> list[tuple[str, Any]]:
    """Channel options that check the server's certificate for ``server_name`` instead of the
    target's host (a certificate for the Service's name, reached on 127.0.0.1)."""
    return [("grpc.ssl_target_name_override", server_name)] if server_name else []


def open_channel(target: str, *, ca_file: str = "", cert_file: str = "", key_file: str = "",
                 server_name: str = "", options: Sequence[tuple[str, Any]] = ()
                 ) -> grpc.Channel:
    """A (synchronous) channel to ``target``: TLS when ``ca_file`` is given, else plaintext.
    TLSError for a file that cannot be used, or client-certificate options without a CA."""
    if not ca_file:
        if cert_file or key_file or server_name:
            raise TLSError("--tls-cert, --tls-key and --tls-server-name need --tls-ca (the CA "
                           "that signed the controller's certificate)")
        return grpc.insecure_channel(target, options=list(options))
    credentials = channel_credentials(ca_file, cert_file, key_file)
    return grpc.secure_channel(target, credentials,
                               options=[*options, *server_name_options(server_name)])
