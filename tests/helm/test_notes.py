"""NOTES.txt: what an operator sees after install."""

from __future__ import annotations

from tests.helm.conftest import FULLNAME, NAMESPACE


def test_notes_point_workers_at_the_service(render_notes):
    """NOTES give the in-cluster gRPC address and the SGLang flags to use it."""
    notes = render_notes()
    address = f"{FULLNAME}.{NAMESPACE}.svc:50051"
    assert f"--kv-control-plane grpc://{address}" in notes
    assert "--enable-layered-kv" in notes
    assert "plaintext" in notes
    assert "kubectl label namespace <worker-namespace> kvplane.io/worker=true" in notes
    assert "WARNING: policyToken.existingSecret is empty" in notes


def test_notes_with_mtls_and_token(render_notes):
    """With mTLS the NOTES list the worker TLS flags; with a token there is no warning."""
    notes = render_notes(
        {
            "tls": {"enabled": True, "existingSecret": "kv-tls"},
            "policyToken": {"existingSecret": "kv-token", "key": "token"},
        }
    )
    assert "client certificates required" in notes
    assert "--kv-tls-ca" in notes and "--kv-tls-cert" in notes and "--kv-tls-key" in notes
    assert "WARNING" not in notes
    assert "-plaintext" not in notes
