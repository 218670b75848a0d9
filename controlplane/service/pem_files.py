"""TLS material checked when a process starts, so a bad file is named by its flag at once.

gRPC reads PEM files only when it builds a channel or binds a port: a garbage CA bundle on a
worker surfaces as handshake failures minutes later, a garbage server certificate as "cannot
bind". Both sides check their files here first, with the standard library's OpenSSL (the same
PEM formats gRPC accepts):

* :func:`check_ca_bundle`: the file holds at least one certificate that parses.
* :func:`check_key_pair`: the certificate chain parses, the private key parses (unencrypted: gRPC
  takes no passphrase) and belongs to the chain's first certificate, and that certificate is valid
  now (:func:`certificate_validity`): gRPC serves an expired or not-yet-valid certificate without a
  word, and every peer that verifies it fails its handshake. Returns its notAfter.

Each raises ``ValueError`` naming the flag, the file and what is wrong, in one line. Used by
``kvplane serve`` (``--tls-ca``, ``--tls-cert``, ``--tls-key``) and by the plugin's launch options
(``--kv-tls-ca``, ``--kv-tls-cert``, ``--kv-tls-key``). Standard library only.
"""

from __future__ import annotations

import datetime
import ssl
import time
from pathlib import Path


def _reason(exc: ssl.SSLError) -> str:
    """OpenSSL's reason in words (``NO_CERTIFICATE_OR_CRL_FOUND`` -> "no certificate or crl found")."""
    text = str(exc.args[1]) if len(exc.args) > 1 else str(exc)
    text = text.split("] ", 1)[-1].rsplit(" (_ssl.c", 1)[0]
    return " ".join(text.split())


def _no_passphrase() -> bytes:
    # An encrypted key must fail here, not make OpenSSL prompt on the launcher's terminal.
    return b""


def check_ca_bundle(flag: str, path: str | Path) -> None:
    """``path`` holds at least one PEM certificate that parses; ValueError naming ``flag`` otherwise."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        context.load_verify_locations(cafile=str(path))
    except ssl.SSLError as exc:
        raise ValueError(
            f"{flag}={str(path)!r}: not a PEM certificate file ({_reason(exc)}); "
            "expected one or more '-----BEGIN CERTIFICATE-----' blocks"
        ) from None
    except OSError as exc:
        raise ValueError(f"{flag}={str(path)!r}: cannot read ({exc.strerror})") from None


def _utc(epoch_s: float) -> str:
    return datetime.datetime.fromtimestamp(epoch_s, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def certificate_validity(flag: str, path: str | Path, now: float | None = None) -> tuple[float, float]:
    """The (notBefore, notAfter) of the first certificate in ``path``, in Unix seconds; ValueError
    naming ``flag``, the date and the current time when ``now`` (default: the clock) is outside them.
    ``path`` must already hold a certificate that parses (:func:`check_ca_bundle`)."""
    try:
        # The standard library's only public-enough X.509 reader (it takes a file, first certificate).
        decoded = ssl._ssl._test_decode_cert(str(path))  # type: ignore[attr-defined]
        not_before = float(ssl.cert_time_to_seconds(decoded["notBefore"]))
        not_after = float(ssl.cert_time_to_seconds(decoded["notAfter"]))
    except (ssl.SSLError, KeyError, ValueError) as exc:
        raise ValueError(f"{flag}={str(path)!r}: cannot read the certificate's validity dates ({exc})") from None
    except OSError as exc:
        raise ValueError(f"{flag}={str(path)!r}: cannot read ({exc.strerror})") from None
    now = time.time() if now is None else now
    if now < not_before:
        raise ValueError(
            f"{flag}={str(path)!r}: the certificate is not valid yet (notBefore {_utc(not_before)}, "
            f"now {_utc(now)}); every peer would fail its TLS handshake -- check the clock or reissue it"
        )
    if now > not_after:
        raise ValueError(
            f"{flag}={str(path)!r}: the certificate has expired (notAfter {_utc(not_after)}, "
            f"now {_utc(now)}); every peer would fail its TLS handshake -- renew it"
        )
    return not_before, not_after


def check_key_pair(cert_flag: str, cert: str | Path, key_flag: str, key: str | Path) -> float:
    """The certificate chain in ``cert`` parses, its first certificate is valid now and the
    unencrypted private key in ``key`` matches it; ValueError naming the flag of the bad file
    otherwise. Returns the certificate's notAfter (Unix seconds)."""
    check_ca_bundle(cert_flag, cert)  # the chain's certificates parse (names the certificate)
    _not_before, not_after = certificate_validity(cert_flag, cert)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(str(cert), str(key), password=_no_passphrase)
    except ssl.SSLError as exc:
        if exc.reason == "KEY_VALUES_MISMATCH":
            problem = f"does not belong to the certificate in {cert_flag}={str(cert)!r}"
        else:
            problem = (
                f"not an unencrypted PEM private key ({_reason(exc)}); expected a "
                "'-----BEGIN PRIVATE KEY-----' (or RSA / EC) block"
            )
        raise ValueError(f"{key_flag}={str(key)!r}: {problem}") from None
    except OSError as exc:
        raise ValueError(f"{key_flag}={str(key)!r}: cannot read ({exc.strerror})") from None
    return not_after
