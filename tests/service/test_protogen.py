"""The committed generated gRPC code matches what `make proto` produces from proto/."""

from __future__ import annotations

from pathlib import Path

from controlplane import protogen


def test_generated_code_is_fresh(tmp_path: Path) -> None:
    """Regenerating kvplane/v1 from proto/ into a temp dir gives byte-identical files."""
    generated = protogen.generate(tmp_path)
    assert generated, "protoc produced nothing"
    names = {p.name for p in generated}
    assert {"controlplane_pb2.py", "controlplane_pb2_grpc.py", "controlplane_pb2.pyi"} <= names
    stale = []
    for rel in generated:
        committed = protogen.REPO_ROOT / rel
        if not committed.exists() or committed.read_bytes() != (tmp_path / rel).read_bytes():
            stale.append(str(rel))
    assert not stale, f"stale generated files (run `make proto`): {stale}"
    committed_files = {
        p.name
        for p in (protogen.REPO_ROOT / protogen.PACKAGE_DIR).iterdir()
        if p.name.endswith(protogen.GENERATED_SUFFIXES)
    }
    assert committed_files == names, "generated files without a .proto source are committed"


def test_api_is_versioned_by_package() -> None:
    """Services live in package kvplane.v1; no method name carries a version suffix."""
    from kvplane.v1 import controlplane_pb2 as pb

    assert pb.DESCRIPTOR.package == "kvplane.v1"
    services = pb.DESCRIPTOR.services_by_name
    assert set(services) == {"ControlPlane", "PolicyService"}
    for service in services.values():
        for method in service.methods:
            assert not any(ch.isdigit() for ch in method.name), method.name
