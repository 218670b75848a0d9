"""`kvplane serve --tls-cert` refuses a certificate outside its validity dates and reports its expiry.

gRPC serves an expired (or not-yet-valid) certificate without a word: the pod turns Ready (its
probes are plaintext) and every worker that verifies the certificate fails its handshake. Real
certificates (``cryptography``), real ``kvplane serve`` subprocesses.
"""

from __future__ import annotations

import datetime
import json
import subprocess
import urllib.request
from pathlib import Path

import pytest

from controlplane.service.pem_files import check_key_pair
from sglang_ext.args import LayeredKVArgs

from .certs import ThrowawayCA
from .conftest import kvplane_cmd, subprocess_env

DAY = datetime.timedelta(days=1)
VALIDITY = {
    "expired": (-90 * DAY, -DAY),
    "not-yet-valid": (DAY, 90 * DAY),
    "valid": (-DAY, 90 * DAY),
    "expires-in-2-days": (-DAY, 2 * DAY),
}


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, str]]:
    """(certificate, key) files of a server certificate for each ``VALIDITY`` case."""
    root = tmp_path_factory.mktemp("cert-validity")
    ca = ThrowawayCA()
    files = {}
    for case, valid in VALIDITY.items():
        pair = ca.issue("srv", server=True, valid=valid)
        (root / f"{case}.crt").write_bytes(pair.cert_pem)
        (root / f"{case}.key").write_bytes(pair.key_pem)
        files[case] = (str(root / f"{case}.crt"), str(root / f"{case}.key"))
    return files


@pytest.mark.parametrize(
    ("case", "fragment"),
    [("expired", "the certificate has expired (notAfter "), ("not-yet-valid", "the certificate is not valid yet (notBefore ")],
)
def test_serve_refuses_a_certificate_outside_its_dates(certs: dict[str, tuple[str, str]], case: str, fragment: str) -> None:
    """Exit 2, one line naming --tls-cert, the file, the date and the current time. Negative
    control: the old check (chain parses, key matches) started the server with either one."""
    cert, key = certs[case]
    proc = subprocess.run(
        kvplane_cmd("serve", "--listen", "127.0.0.1:0", "--tls-cert", cert, "--tls-key", key),
        env=subprocess_env(), capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"kvplane serve: --tls-cert={cert!r}: {fragment}"), proc.stderr
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT")
    assert f", now {now}" in lines[0], lines[0]


def test_the_plugin_refuses_an_expired_client_certificate(certs: dict[str, tuple[str, str]]) -> None:
    """The same check is the plugin's launch check of --kv-tls-cert (it calls check_key_pair).
    Negative control: the old check accepted it; the valid one passes."""
    cert, key = certs["expired"]
    with pytest.raises(ValueError, match=r"^--kv-tls-cert='.*': the certificate has expired \(notAfter "):
        LayeredKVArgs(kv_control_plane="grpc://127.0.0.1:50051", kv_tls_cert=cert, kv_tls_key=key)
    cert, key = certs["valid"]
    assert LayeredKVArgs(kv_control_plane="grpc://127.0.0.1:50051", kv_tls_cert=cert, kv_tls_key=key).kv_tls_cert


def _serve_until_serving(cert: str, key: str, log_path: Path) -> list[dict[str, object]]:
    """Start `kvplane serve` with TLS, wait for its ``serving`` event, read /metrics, stop it;
    its JSON log events plus a pseudo-event ``{"metrics": text}``."""
    import time

    cmd = kvplane_cmd("serve", "--listen", "127.0.0.1:0", "--metrics-port", "0", "--grace-s", "0",
                      "--tls-cert", cert, "--tls-key", key)
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(cmd, env=subprocess_env(), stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert proc.poll() is None, log_path.read_text()
            events = [json.loads(line) for line in log_path.read_text().splitlines() if line.startswith("{")]
            serving = [e for e in events if e.get("event") == "serving"]
            if serving:
                url = f"http://127.0.0.1:{serving[0]['metrics_port']}/metrics"
                with urllib.request.urlopen(url, timeout=5) as r:
                    return [*events, {"metrics": r.read().decode()}]
            time.sleep(0.1)
        raise AssertionError(f"not serving within 60 s: {log_path.read_text()}")
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _gauge(metrics: str, name: str) -> float:
    return next(float(line.split()[1]) for line in metrics.splitlines() if line.startswith(name + " "))


@pytest.mark.parametrize("case", ["valid", "expires-in-2-days"])
def test_a_valid_certificate_starts_and_its_expiry_is_reported(
    certs: dict[str, tuple[str, str]], case: str, tmp_path: Path
) -> None:
    """Control of the refusals: a valid certificate serves. Its notAfter is logged at start (a
    warning when it is under 7 days away) and exported as kvplane_tls_cert_not_after_seconds.
    Negative control: the old serve logged no certificate event and had no such gauge."""
    cert, key = certs[case]
    events = _serve_until_serving(cert, key, tmp_path / "serve.log")
    not_after = check_key_pair("--tls-cert", cert, "--tls-key", key)
    expected = datetime.datetime.fromtimestamp(not_after, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    name = "tls_certificate_expires_soon" if case == "expires-in-2-days" else "tls_certificate"
    reported = [e for e in events if e.get("event") in ("tls_certificate", "tls_certificate_expires_soon")]
    assert len(reported) == 1 and reported[0]["event"] == name, reported
    assert reported[0]["not_after"] == expected and reported[0]["tls_cert"] == cert
    assert reported[0]["level"] == ("warning" if case == "expires-in-2-days" else "info")
    assert _gauge(str(events[-1]["metrics"]), "kvplane_tls_cert_not_after_seconds") == not_after


def _self_signed(cn: str, valid: tuple[datetime.timedelta, datetime.timedelta]) -> bytes:
    """A self-signed CA certificate valid from ``now + valid[0]`` to ``now + valid[1]`` (PEM)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now + valid[0])
            .not_valid_after(now + valid[1])
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    return cert.public_bytes(serialization.Encoding.PEM)


def test_every_certificate_of_the_chain_is_checked(certs: dict[str, tuple[str, str]], tmp_path: Path) -> None:
    """A valid leaf followed by an expired intermediate in --tls-cert fails every handshake as an
    expired leaf does: refused, naming the chain's certificate by position and name. The deploy
    fixes' review (session 87) found the first version reading the first certificate only (the
    server started and logged 30 days left). Control: the leaf with a valid intermediate passes,
    and the reported notAfter is the chain's earliest."""
    leaf, key = certs["valid"]
    chain = tmp_path / "chain.crt"
    chain.write_bytes(Path(leaf).read_bytes() + _self_signed("old-intermediate", (-90 * DAY, -DAY)))
    with pytest.raises(ValueError, match=r"certificate 2 of 2 \('old-intermediate'\) has expired \(notAfter "):
        check_key_pair("--tls-cert", chain, "--tls-key", key)
    chain.write_bytes(Path(leaf).read_bytes() + _self_signed("intermediate", (-DAY, 10 * DAY)))
    not_after = check_key_pair("--tls-cert", chain, "--tls-key", key)
    assert not_after < check_key_pair("--tls-cert", leaf, "--tls-key", key)  # the intermediate's 10 days


def test_a_ca_bundle_is_refused_only_when_no_certificate_in_it_is_in_date(tmp_path: Path) -> None:
    """--tls-ca / --kv-tls-ca: a bundle whose every certificate is out of date verifies no peer,
    refused naming the flag; one where some are expired is normal and passes (control). Found by
    the deploy fixes' review (session 87): an expired mTLS client CA started the server."""
    from controlplane.service.pem_files import check_ca_dates

    bundle = tmp_path / "ca.pem"
    bundle.write_bytes(_self_signed("old-ca", (-90 * DAY, -DAY)))
    with pytest.raises(ValueError, match=r"^--tls-ca='.*': its only certificate has expired \(notAfter "):
        check_ca_dates("--tls-ca", bundle)
    bundle.write_bytes(_self_signed("old-ca", (-90 * DAY, -DAY)) + _self_signed("older-ca", (-99 * DAY, -9 * DAY)))
    with pytest.raises(ValueError, match=r"each of its 2 certificates is out of date"):
        check_ca_dates("--tls-ca", bundle)
    bundle.write_bytes(_self_signed("old-ca", (-90 * DAY, -DAY)) + _self_signed("new-ca", (-DAY, 90 * DAY)))
    check_ca_dates("--tls-ca", bundle)
    with pytest.raises(ValueError, match=r"^--kv-tls-ca='.*': its only certificate has expired"):
        bundle.write_bytes(_self_signed("old-ca", (-90 * DAY, -DAY)))
        LayeredKVArgs(kv_control_plane="grpc://127.0.0.1:50051", kv_tls_ca=str(bundle))


def test_a_certificate_issued_moments_ago_by_a_clock_ahead_is_taken(tmp_path: Path) -> None:
    """A notBefore up to 5 minutes ahead of this host's clock (an issuer that does not backdate,
    read by a host whose clock is a little behind) is taken: peers whose clocks are right accept
    it. The first version refused it, crash-looping a fresh pod until its clock caught up (the
    deploy fixes' review, session 87). Control: a day ahead is refused."""
    from controlplane.service.pem_files import certificate_validity

    cert = tmp_path / "fresh.crt"
    cert.write_bytes(_self_signed("fresh", (datetime.timedelta(seconds=30), 90 * DAY)))
    certificate_validity("--tls-cert", cert)
    cert.write_bytes(_self_signed("early", (DAY, 90 * DAY)))
    with pytest.raises(ValueError, match=r"the certificate is not valid yet \(notBefore "):
        certificate_validity("--tls-cert", cert)
