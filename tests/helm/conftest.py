"""Fixtures for the Helm chart tests: a real helm binary and a renderer returning parsed YAML.

helm comes from tools/helm.py (installed by `make setup`); a missing helm fails the tests with
the install command, it never skips them.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "kvplane-controlplane"
RELEASE = "kv"
NAMESPACE = "serving"
FULLNAME = f"{RELEASE}-kvplane-controlplane"


def _load_helm_tool() -> Any:
    spec = importlib.util.spec_from_file_location("kvplane_tools_helm", REPO / "tools" / "helm.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


helm_tool = _load_helm_tool()


@dataclass(frozen=True)
class Rendered:
    """Output of one `helm template` run."""

    docs: list[dict[str, Any]]
    """Parsed manifests (empty documents dropped), in helm's order."""

    def kinds(self) -> list[str]:
        return sorted(d["kind"] for d in self.docs)

    def one(self, kind: str) -> dict[str, Any]:
        found = [d for d in self.docs if d["kind"] == kind]
        if len(found) != 1:
            raise AssertionError(f"expected one {kind}, got {len(found)}: {self.kinds()}")
        return found[0]

    def maybe(self, kind: str) -> dict[str, Any] | None:
        found = [d for d in self.docs if d["kind"] == kind]
        return found[0] if found else None


@pytest.fixture(scope="session")
def helm() -> Path:
    """The pinned helm binary."""
    try:
        path = helm_tool.find_helm()
    except helm_tool.HelmNotFoundError as exc:
        pytest.fail(str(exc), pytrace=False)
    version = helm_tool.helm_version(path)
    if not version.startswith("v3."):
        pytest.fail(f"{path} is helm {version}; the chart tests need Helm v3", pytrace=False)
    return path


def run_helm(
    helm: Path, args: list[str], values: Mapping[str, Any] | None, tmp: Path
) -> subprocess.CompletedProcess[str]:
    cmd = [str(helm), *args]
    if values is not None:
        values_file = tmp / "values-under-test.yaml"
        values_file.write_text(yaml.safe_dump(dict(values)))
        cmd += ["-f", str(values_file)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)


@pytest.fixture(scope="session")
def _render_cache() -> dict[str, str]:
    """helm template output per (values, extra): identical renders run helm once per session."""
    return {}


@pytest.fixture
def render(helm: Path, tmp_path: Path, _render_cache: dict[str, str]) -> Callable[..., Rendered]:
    """render(values=None, *, extra=()) -> Rendered; fails the test if helm fails."""

    def _render(
        values: Mapping[str, Any] | None = None, *, extra: tuple[str, ...] = ()
    ) -> Rendered:
        key = json.dumps([values, extra], sort_keys=True)
        if key not in _render_cache:
            args = ["template", RELEASE, str(CHART), "--namespace", NAMESPACE, *extra]
            proc = run_helm(helm, args, values, tmp_path)
            if proc.returncode != 0:
                raise AssertionError(f"helm template failed:\n{proc.stderr}")
            _render_cache[key] = proc.stdout
        # parsed afresh each time, so a test may modify its copy
        docs = [d for d in yaml.safe_load_all(_render_cache[key]) if d]
        return Rendered(docs=docs)

    return _render


NOTES_PROBE = """apiVersion: v1
kind: ConfigMap
metadata:
  name: notes-under-test
data:
  notes: {{ include "kvplane.notesUnderTest" . | quote }}
"""


@pytest.fixture
def render_notes(helm: Path, tmp_path: Path) -> Callable[..., str]:
    """render_notes(values=None) -> the chart's NOTES.txt rendered by helm.

    `helm template` does not render NOTES and `helm install --dry-run` needs a cluster, so a copy
    of the chart wraps the real NOTES.txt in a named template and prints it through a ConfigMap.
    """

    def _render_notes(values: Mapping[str, Any] | None = None) -> str:
        chart = tmp_path / "chart"
        if not chart.exists():
            shutil.copytree(CHART, chart)
            notes = (chart / "templates" / "NOTES.txt").read_text()
            (chart / "templates" / "_notes_under_test.tpl").write_text(
                '{{- define "kvplane.notesUnderTest" -}}\n' + notes + "{{- end }}\n"
            )
            (chart / "templates" / "notes-under-test.yaml").write_text(NOTES_PROBE)
        args = [
            "template",
            RELEASE,
            str(chart),
            "--namespace",
            NAMESPACE,
            "--show-only",
            "templates/notes-under-test.yaml",
        ]
        proc = run_helm(helm, args, values, tmp_path)
        if proc.returncode != 0:
            raise AssertionError(f"helm template failed:\n{proc.stderr}")
        return str(yaml.safe_load(proc.stdout)["data"]["notes"])

    return _render_notes


@pytest.fixture
def render_error(helm: Path, tmp_path: Path) -> Callable[..., str]:
    """render_error(values=None, *, extra=()) -> stderr of a `helm template` that must fail."""

    def _render_error(
        values: Mapping[str, Any] | None = None, *, extra: tuple[str, ...] = ()
    ) -> str:
        args = ["template", RELEASE, str(CHART), "--namespace", NAMESPACE, *extra]
        proc = run_helm(helm, args, values, tmp_path)
        if proc.returncode == 0:
            raise AssertionError(f"helm template unexpectedly succeeded with {values} {extra}")
        return proc.stderr

    return _render_error


def container(deployment: dict[str, Any]) -> dict[str, Any]:
    """The single control-plane container of a rendered Deployment."""
    containers = deployment["spec"]["template"]["spec"]["containers"]
    assert [c["name"] for c in containers] == ["controlplane"]
    return containers[0]
