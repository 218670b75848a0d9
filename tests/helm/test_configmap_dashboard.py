"""Grafana dashboard ConfigMap (optional): the chart ships the repository's one dashboard file
through ``.Files.Get``, labelled for the Grafana sidecar; off by default."""

from __future__ import annotations

import json
import subprocess
import tarfile

from tests.helm.conftest import CHART, FULLNAME, REPO

DASHBOARD = CHART / "dashboards" / "kvplane-grafana.json"
DOCS_COPY = REPO / "docs" / "monitoring" / "kvplane-grafana.json"


def test_absent_by_default(render):
    """No dashboard ConfigMap unless enabled (only the policy ConfigMap renders)."""
    maps = [d for d in render().docs if d["kind"] == "ConfigMap"]
    assert [m["metadata"]["name"] for m in maps] == [FULLNAME]


def test_carries_the_dashboard_file_labelled_for_the_sidecar(render):
    """enabled: one ConfigMap whose kvplane-grafana.json is byte for byte the chart's dashboard
    file, labelled grafana_dashboard: "1" with the chart's standard labels."""
    maps = {m["metadata"]["name"]: m for m in render({"grafanaDashboard": {"enabled": True}}).docs
            if m["kind"] == "ConfigMap"}
    cm = maps[f"{FULLNAME}-dashboard"]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["labels"]["app.kubernetes.io/part-of"] == "kvplane"
    assert cm["metadata"]["namespace"] == "serving"
    assert cm["data"]["kvplane-grafana.json"] == DASHBOARD.read_text()
    assert json.loads(cm["data"]["kvplane-grafana.json"])["uid"] == "kvplane-worker"


def test_label_namespace_and_annotations_are_configurable(render):
    """The sidecar's label, the namespace it watches and a folder annotation are values."""
    cm = [
        m for m in render({"grafanaDashboard": {
            "enabled": True, "namespace": "monitoring", "label": {"key": "dashboards", "value": "kvplane"},
            "labels": {"team": "serving"}, "annotations": {"grafana_folder": "kvplane"},
        }}).docs if m["kind"] == "ConfigMap" and m["metadata"]["name"].endswith("-dashboard")
    ][0]
    assert cm["metadata"]["namespace"] == "monitoring"
    assert cm["metadata"]["labels"]["dashboards"] == "kvplane" and "grafana_dashboard" not in cm["metadata"]["labels"]
    assert cm["metadata"]["labels"]["team"] == "serving"
    assert cm["metadata"]["annotations"] == {"grafana_folder": "kvplane"}


def test_bad_values_rejected(render_error):
    """The schema names the field: a non-boolean switch, an empty label key, an unknown key."""
    assert "grafanaDashboard.enabled" in render_error({"grafanaDashboard": {"enabled": "yes"}})
    assert "grafanaDashboard.label.key" in render_error({"grafanaDashboard": {"label": {"key": "", "value": "1"}}})
    assert "folder" in render_error({"grafanaDashboard": {"folder": "kvplane"}})


def test_one_copy_shipped_in_the_package(helm, tmp_path):
    """docs/monitoring's dashboard is a link to the chart's file (one copy), and `helm package`
    puts that file in the chart archive byte for byte."""
    assert DOCS_COPY.is_symlink() and DOCS_COPY.resolve() == DASHBOARD.resolve()
    proc = subprocess.run([str(helm), "package", str(CHART), "-d", str(tmp_path)], capture_output=True,
                          text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    [archive] = list(tmp_path.glob("kvplane-controlplane-*.tgz"))
    with tarfile.open(archive) as tar:
        member = tar.extractfile("kvplane-controlplane/dashboards/kvplane-grafana.json")
        assert member is not None and member.read() == DASHBOARD.read_bytes()


def test_negative_control_a_missing_file_fails_the_render(helm, tmp_path):
    """Negative control: a chart copy without the dashboard file refuses to render the ConfigMap,
    naming the file (the template never ships an empty dashboard)."""
    import shutil

    chart = tmp_path / "chart"
    shutil.copytree(CHART, chart)
    (chart / "dashboards" / "kvplane-grafana.json").unlink()
    proc = subprocess.run([str(helm), "template", "kv", str(chart), "--set", "grafanaDashboard.enabled=true"],
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode != 0 and "dashboards/kvplane-grafana.json" in proc.stderr


def test_a_long_release_name_keeps_the_dashboard_and_policy_configmaps_apart(helm, tmp_path):
    """A 42-character release name: the full name is cut at 63 characters, and the dashboard's
    name must not collapse onto the policy ConfigMap's."""
    from tests.helm.conftest import CHART, run_helm

    release = "llama-3-1-70b-instruct-prod-eu-west-1-blue"
    proc = run_helm(helm, ["template", release, str(CHART), "--namespace", "serving"],
                    {"grafanaDashboard": {"enabled": True}}, tmp_path)
    assert proc.returncode == 0, proc.stderr
    import yaml

    names = [d["metadata"]["name"] for d in yaml.safe_load_all(proc.stdout) if d and d["kind"] == "ConfigMap"]
    assert len(names) == 2 and len(set(names)) == 2, names
    assert all(len(n) <= 63 for n in names) and any(n.endswith("-dashboard") for n in names)
