"""Test-time X.509 material (a CA, a server cert for 127.0.0.1/localhost, client certs).

Generated fresh per test session with the `cryptography` package; nothing is committed.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

ONE_DAY = (-datetime.timedelta(minutes=5), datetime.timedelta(days=1))
"""A leaf's default validity, relative to when it is issued."""


@dataclass(frozen=True)
class KeyPair:
    cert_pem: bytes
    key_pem: bytes


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


class ThrowawayCA:
    """A throwaway certificate authority."""

    def __init__(self, cn: str = "kvplane-test-ca") -> None:
        self._key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        self._name = _name(cn)
        self.cert = (
            x509.CertificateBuilder()
            .subject_name(self._name)
            .issuer_name(self._name)
            .public_key(self._key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(self._key, hashes.SHA256())
        )
        self.cert_pem = self.cert.public_bytes(serialization.Encoding.PEM)

    def issue_san_only(self, uri: str) -> KeyPair:
        """A client certificate with an empty subject and ``uri`` as its only subject alternative
        name, as SPIFFE and cert-manager issue them."""
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (
            self._leaf(x509.Name([]), key, ExtendedKeyUsageOID.CLIENT_AUTH)
            .add_extension(x509.SubjectAlternativeName([x509.UniformResourceIdentifier(uri)]), critical=True)
            .sign(self._key, hashes.SHA256())
        )
        return KeyPair(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))

    def _leaf(self, subject: x509.Name, key: ec.EllipticCurvePrivateKey, usage: x509.ObjectIdentifier,
              valid: tuple[datetime.timedelta, datetime.timedelta] = ONE_DAY) -> x509.CertificateBuilder:
        now = datetime.datetime.now(datetime.UTC)
        return (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(self._name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now + valid[0])
            .not_valid_after(now + valid[1])
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        )

    def issue(self, cn: str, *, server: bool,
              valid: tuple[datetime.timedelta, datetime.timedelta] = ONE_DAY) -> KeyPair:
        """A leaf certificate valid from ``now + valid[0]`` to ``now + valid[1]`` (default: from
        five minutes ago for a day)."""
        key = ec.generate_private_key(ec.SECP256R1())
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        builder = self._leaf(_name(cn), key, usage, valid)
        if server:
            builder = builder.add_extension(
                x509.SubjectAlternativeName(
                    [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
                ),
                critical=False,
            )
        cert = builder.sign(self._key, hashes.SHA256())
        return KeyPair(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))
