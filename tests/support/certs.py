"""Throw-away TLS material for tests: a CA, a server certificate for the
loopback addresses and a client certificate, all signed by that CA."""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass
from typing import Sequence

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class TLSFiles:
    ca_cert: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _sans(names: Sequence[str]) -> x509.SubjectAlternativeName:
    out = []
    for n in names:
        try:
            out.append(x509.IPAddress(ipaddress.ip_address(n)))
        except ValueError:
            out.append(x509.DNSName(n))
    return x509.SubjectAlternativeName(out)


def _write(path: str, data: bytes) -> str:
    with open(path, "wb") as f:
        f.write(data)
    return path


def _key_pem(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _issue(ca_key, ca_name, common_name: str, sans: Sequence[str], usage):
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(_sans(sans), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return cert, key


def make_tls_files(directory: str, prefix: str = "",
                   server_names: Sequence[str] = ("127.0.0.1", "::1", "localhost"),
                   client_names: Sequence[str] = ("scraper.example",)) -> TLSFiles:
    """Write ca.pem, server.pem/-key.pem and client.pem/-key.pem into directory."""
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _name(f"{prefix}test CA")
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                     content_commitment=False, key_encipherment=False, data_encipherment=False,
                                     key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    server_cert, server_key = _issue(ca_key, ca_name, "mps-exporter", server_names, ExtendedKeyUsageOID.SERVER_AUTH)
    client_cert, client_key = _issue(ca_key, ca_name, "scraper", client_names, ExtendedKeyUsageOID.CLIENT_AUTH)
    pem = serialization.Encoding.PEM
    p = lambda name: os.path.join(directory, prefix + name)  # noqa: E731
    return TLSFiles(
        ca_cert=_write(p("ca.pem"), ca_cert.public_bytes(pem)),
        server_cert=_write(p("server.pem"), server_cert.public_bytes(pem)),
        server_key=_write(p("server-key.pem"), _key_pem(server_key)),
        client_cert=_write(p("client.pem"), client_cert.public_bytes(pem)),
        client_key=_write(p("client-key.pem"), _key_pem(client_key)),
    )
