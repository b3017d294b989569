"""Certificates the TLS tests make for themselves (``cryptography``): a CA, a server certificate
for 127.0.0.1, ::1 and localhost, engine client certificates, and a second CA that signs a
client certificate the first CA does not know. Nothing here is a real secret."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

_DAY = datetime.timedelta(days=1)


@dataclass(frozen=True)
class KeyPair:
    cert: Path
    key: Path


@dataclass(frozen=True)
class PKI:
    """PEM files under one directory."""

    ca: Path  # signs the server and the engine certificates
    server: KeyPair  # CN controller; SANs localhost, 127.0.0.1, ::1, controller.test
    engine: KeyPair  # client certificate, CN engine-1 (SAN DNS engine-1)
    engine_two: KeyPair  # client certificate, CN engine-2
    stranger: KeyPair  # client certificate CN engine-1 from another CA
    other_ca: Path  # the CA of ``stranger``
    other_key: Path  # a key that matches no certificate here


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> Path:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                       serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    return path


def _write_cert(cert: x509.Certificate, path: Path) -> Path:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return path


def _ca(cn: str) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = _key()
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(_name(cn))
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - _DAY).not_valid_after(now + 30 * _DAY)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(
                digital_signature=True, key_cert_sign=True, crl_sign=True,
                content_commitment=False, key_encipherment=False, data_encipherment=False,
                key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            .sign(key, hashes.SHA256()))
    return cert, key


def _leaf(ca: tuple[x509.Certificate, ec.EllipticCurvePrivateKey], cn: str,
          sans: list[x509.GeneralName], usage: x509.ObjectIdentifier, directory: Path,
          stem: str) -> KeyPair:
    ca_cert, ca_key = ca
    key = _key()
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(ca_cert.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - _DAY).not_valid_after(now + 30 * _DAY)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    return KeyPair(_write_cert(cert, directory / f"{stem}.crt"),
                   _write_key(key, directory / f"{stem}.key"))


def make_pki(directory: Path) -> PKI:
    directory.mkdir(parents=True, exist_ok=True)
    ca = _ca("specpilot test CA")
    other = _ca("some other CA")
    server = _leaf(ca, "controller", [
        x509.DNSName("localhost"), x509.DNSName("controller.test"),
        x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
        x509.IPAddress(ipaddress.ip_address("::1"))],
        ExtendedKeyUsageOID.SERVER_AUTH, directory, "server")
    client = ExtendedKeyUsageOID.CLIENT_AUTH
    return PKI(
        ca=_write_cert(ca[0], directory / "ca.crt"),
        server=server,
        engine=_leaf(ca, "engine-1", [x509.DNSName("engine-1")], client, directory, "engine"),
        engine_two=_leaf(ca, "engine-2", [x509.DNSName("engine-2")], client, directory,
                         "engine-two"),
        stranger=_leaf(other, "engine-1", [x509.DNSName("engine-1")], client, directory,
                       "stranger"),
        other_ca=_write_cert(other[0], directory / "other-ca.crt"),
        other_key=_write_key(_key(), directory / "other.key"),
    )
