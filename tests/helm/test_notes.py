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


def _grpcurl_lines(notes: str) -> list[str]:
    return [line.strip() for line in notes.splitlines() if line.strip().startswith("grpcurl ")]


def test_notes_grpcurl_calls_methods_that_exist(render_notes):
    """Every method the NOTES' grpcurl lines call is in the real proto (PolicyService/Get was not)."""
    import re

    from kvplane.v1 import controlplane_pb2 as pb

    lines = _grpcurl_lines(render_notes())
    assert len(lines) == 2 and all("-plaintext" in line for line in lines)
    service = pb.DESCRIPTOR.services_by_name["PolicyService"]
    methods = re.findall(r"kvplane\.v1\.PolicyService/(\w+)", " ".join(lines))
    assert methods == ["GetPolicy"] and all(m in service.methods_by_name for m in methods)
    assert "grpc.health.v1.Health/Check" in lines[0]


def test_notes_grpcurl_under_tls_carries_the_ca_and_the_client_certificate(render_notes):
    """Under TLS the grpcurl lines name the CA and the Service's DNS name (the certificate names it,
    not localhost); under mTLS also a client certificate. Control: TLS without client certificates
    asks for none."""
    server_name = f"-servername {FULLNAME}.{NAMESPACE}.svc"
    mtls = _grpcurl_lines(render_notes({"tls": {"enabled": True, "existingSecret": "kv-tls"}}))
    assert all("-cacert server-ca.crt -cert worker.crt -key worker.key" in line and server_name in line for line in mtls)
    tls = _grpcurl_lines(render_notes({"tls": {"enabled": True, "existingSecret": "kv-tls", "caKey": ""}}))
    assert all("-cacert server-ca.crt" in line and "-cert worker.crt" not in line and server_name in line for line in tls)


def test_notes_port_forward_maps_an_unprivileged_local_port_to_the_service_port(render_notes):
    """With service.grpcPort 443 the NOTES forward local 50051 to the Service's 443 and call
    localhost:50051 (a local 443 would need root). Negative control: the old NOTES forwarded 443:443."""
    notes = render_notes({"service": {"grpcPort": 443}})
    assert f"port-forward svc/{FULLNAME} 50051:443" in notes
    assert all("localhost:50051 " in line for line in _grpcurl_lines(notes))
    assert f"{FULLNAME}.{NAMESPACE}.svc:443" in notes
