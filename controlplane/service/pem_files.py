"""TLS material checked when a process starts, so a bad file is named by its flag at once.

gRPC reads PEM files only when it builds a channel or binds a port: a garbage CA bundle on a
worker surfaces as handshake failures minutes later, a garbage server certificate as "cannot
bind". Both sides check their files here first, with the standard library's OpenSSL (the same
PEM formats gRPC accepts):

* :func:`check_ca_bundle`: the file holds at least one certificate that parses.
* :func:`check_ca_dates`: that, and at least one of the bundle's certificates is within its dates (a bundle
  whose every CA has expired verifies no peer).
* :func:`check_key_pair`: the certificate chain parses, the private key parses (unencrypted: gRPC
  takes no passphrase) and belongs to the chain's first certificate, and every certificate of the
  chain is valid now (:func:`certificate_validity`; a notBefore up to :data:`CLOCK_SKEW_S` ahead
  is taken): gRPC serves an expired or not-yet-valid certificate without a word, and every peer
  that verifies it fails its handshake. Returns the chain's earliest notAfter.

Each raises ``ValueError`` naming the flag, the file and what is wrong, in one line. Used by
``kvplane serve`` (``--tls-ca``, ``--tls-cert``, ``--tls-key``) and by the plugin's launch options
(``--kv-tls-ca``, ``--kv-tls-cert``, ``--kv-tls-key``). Standard library only.
"""

from __future__ import annotations

import datetime
import os
import re
import ssl
import tempfile
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


CLOCK_SKEW_S = 300.0
"""A notBefore this far ahead of this host's clock is accepted: an issuer that does not backdate
its certificates, read by a host whose clock is a little behind, is not "not valid yet" to peers
whose clocks are right (deploy review, session 87)."""

_PEM_CERT = re.compile(r"-----BEGIN CERTIFICATE-----.+?-----END CERTIFICATE-----", re.S)


def _decoded(path: str | Path) -> list[dict]:
    """Every certificate of the PEM file ``path``, as the standard library decodes one (its only
    X.509 reader takes a file and reads the first certificate: the others go through a temporary
    file each, under ``$TMPDIR``)."""
    text = Path(path).read_text(errors="replace")
    blocks = _PEM_CERT.findall(text)
    if len(blocks) <= 1:
        return [ssl._ssl._test_decode_cert(str(path))]  # type: ignore[attr-defined]
    out = []
    for block in blocks:
        fd, tmp = tempfile.mkstemp(suffix=".pem")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(block + "\n")
            out.append(ssl._ssl._test_decode_cert(tmp))  # type: ignore[attr-defined]
        finally:
            os.unlink(tmp)
    return out


def _dates(flag: str, path: str | Path) -> list[tuple[float, float, str]]:
    """(notBefore, notAfter, subject's common name) of every certificate in ``path``."""
    try:
        out = []
        for decoded in _decoded(path):
            names = [v for rdn in decoded.get("subject", ()) for k, v in rdn if k == "commonName"]
            out.append((float(ssl.cert_time_to_seconds(decoded["notBefore"])),
                        float(ssl.cert_time_to_seconds(decoded["notAfter"])), names[0] if names else "?"))
        return out
    except (ssl.SSLError, KeyError, ValueError) as exc:
        raise ValueError(f"{flag}={str(path)!r}: cannot read the certificate's validity dates ({exc})") from None
    except OSError as exc:
        raise ValueError(f"{flag}={str(path)!r}: cannot read ({exc.strerror})") from None


def _out_of_date(not_before: float, not_after: float, now: float) -> str | None:
    if now + CLOCK_SKEW_S < not_before:
        return f"is not valid yet (notBefore {_utc(not_before)}, now {_utc(now)})"
    if now > not_after:
        return f"has expired (notAfter {_utc(not_after)}, now {_utc(now)})"
    return None


def certificate_validity(flag: str, path: str | Path, now: float | None = None) -> tuple[float, float]:
    """The latest notBefore and the earliest notAfter of the certificate chain in ``path``, in Unix
    seconds; ValueError naming ``flag``, the certificate, its date and the current time when
    ``now`` (default: the clock) is outside any certificate's dates (an expired intermediate fails
    every handshake as an expired leaf does; a notBefore up to :data:`CLOCK_SKEW_S` ahead is
    taken). ``path`` must already hold a certificate that parses (:func:`check_ca_bundle`)."""
    dates = _dates(flag, path)
    now = time.time() if now is None else now
    for i, (not_before, not_after, name) in enumerate(dates):
        why = _out_of_date(not_before, not_after, now)
        if why is not None:
            which = "the certificate" if len(dates) == 1 else f"certificate {i + 1} of {len(dates)} ({name!r})"
            raise ValueError(
                f"{flag}={str(path)!r}: {which} {why}; peers whose clocks agree with this host's would fail "
                "their TLS handshake -- renew it (or check this host's clock)"
            )
    return max(d[0] for d in dates), min(d[1] for d in dates)


def check_ca_dates(flag: str, path: str | Path, now: float | None = None) -> None:
    """The CA bundle in ``path`` parses (:func:`check_ca_bundle`) and at least one of its
    certificates is within its dates; ValueError naming ``flag`` otherwise (a bundle where some are
    out of date is normal: one in date verifies)."""
    check_ca_bundle(flag, path)
    dates = _dates(flag, path)
    now = time.time() if now is None else now
    whys = [_out_of_date(b, a, now) for b, a, _ in dates]
    if all(whys):
        which = "its only certificate" if len(dates) == 1 else f"each of its {len(dates)} certificates"
        raise ValueError(f"{flag}={str(path)!r}: {which} {whys[-1] if len(dates) == 1 else 'is out of date'}; "
                         "no peer certificate can be verified against it -- renew the CA bundle")


def check_key_pair(cert_flag: str, cert: str | Path, key_flag: str, key: str | Path) -> float:
    """The certificate chain in ``cert`` parses, each of its certificates is valid now and the
    unencrypted private key in ``key`` matches the first; ValueError naming the flag of the bad
    file otherwise. Returns the chain's earliest notAfter (Unix seconds)."""
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
