"""Chart layout: one template per kind, every value documented, pinned image, README present."""

from __future__ import annotations

import re

import yaml

from tests.helm.conftest import CHART

TEMPLATES = {
    "deployment.yaml",
    "service.yaml",
    "configmap.yaml",
    "serviceaccount.yaml",
    "poddisruptionbudget.yaml",
    "horizontalpodautoscaler.yaml",
    "servicemonitor.yaml",
    "networkpolicy.yaml",
    "configmap-dashboard.yaml",
    "_helpers.tpl",
    "NOTES.txt",
}


def test_one_template_per_kind():
    """templates/ holds exactly one file per kind (and component: ``<kind>-<component>.yaml``) plus
    helpers and NOTES."""
    assert {p.name for p in (CHART / "templates").iterdir()} == TEMPLATES
    for name in TEMPLATES - {"_helpers.tpl", "NOTES.txt"}:
        kinds = re.findall(r"^kind: (\w+)", (CHART / "templates" / name).read_text(), re.M)
        assert len(kinds) == 1, (name, kinds)
        assert kinds[0].lower() == name.removesuffix(".yaml").split("-")[0], (name, kinds)


def test_every_value_documented():
    """Every value in values.yaml has a comment directly above it or above an enclosing block
    (e.g. podSecurityContext, whose fields are Kubernetes' own)."""
    lines = (CHART / "values.yaml").read_text().splitlines()
    stack: list[tuple[int, bool]] = []  # (indent, documented) of enclosing keys
    undocumented = []
    for i, line in enumerate(lines):
        m = re.match(r"^(\s*)([A-Za-z_][\w./-]*):(.*)$", line)
        if not m:
            continue
        indent, key, rest = len(m.group(1)), m.group(2), m.group(3).strip()
        while stack and stack[-1][0] >= indent:
            stack.pop()
        own = i > 0 and lines[i - 1].strip().startswith("#")
        documented = own or any(doc for _, doc in stack)
        if rest and not rest.startswith("#") and not documented:
            undocumented.append(key)
        stack.append((indent, documented))
    assert undocumented == []


def test_documented_in_readme():
    """The chart README lists every top-level value."""
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    readme = (CHART / "README.md").read_text()
    missing = [k for k in values if f"`{k}" not in readme]
    assert missing == []


def test_image_pinned_and_app_version():
    """The default image tag is pinned (not latest) and equals the chart's appVersion."""
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["image"]["tag"] == chart["appVersion"]
    assert values["image"]["tag"] != "latest"
    assert chart["apiVersion"] == "v2"
    assert chart["kubeVersion"].startswith(">=1.27")
