"""Whole-chart checks with the real helm: `helm lint --strict`, and every rendered manifest
validated offline against the Kubernetes API schemas (kubernetes-validate, strict: unknown fields
are errors). ServiceMonitor is a Prometheus Operator CRD with no bundled schema: it is checked by
hand in test_servicemonitor.py and explicitly excluded here."""

from __future__ import annotations

import copy
import subprocess
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tests.helm.conftest import CHART

# Oldest supported (Chart.yaml kubeVersion: native gRPC probes are GA in 1.27) and newest bundled.
K8S_VERSIONS = ("1.27.0", "1.37.0")
CRD_KINDS = {"ServiceMonitor"}

ALL_ON: dict[str, Any] = {
    "replicaCount": 2,
    "policyToken": {"existingSecret": "kv-token", "key": "token"},
    "tls": {"enabled": True, "existingSecret": "kv-tls"},
    "podDisruptionBudget": {"enabled": True, "minAvailable": 1},
    "autoscaling": {
        "enabled": True,
        "minReplicas": 2,
        "maxReplicas": 4,
        "targetMemoryUtilizationPercentage": 75,
    },
    "serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}},
    "grafanaDashboard": {"enabled": True, "annotations": {"grafana_folder": "kvplane"}},
    "networkPolicy": {"workerPodLabels": {"app": "sglang"}},
    "extraEnv": [{"name": "KVPLANE_LOG_FORMAT", "value": "json"}],
    "extraArgs": ["--max-message-bytes", "8388608"],
    "podAnnotations": {"example.com/owner": "serving"},
    "imagePullSecrets": [{"name": "regcred"}],
    "topologySpreadConstraints": [
        {
            "maxSkew": 1,
            "topologyKey": "kubernetes.io/hostname",
            "whenUnsatisfiable": "ScheduleAnyway",
            "labelSelector": {"matchLabels": {"app.kubernetes.io/component": "controlplane"}},
        }
    ],
}

VARIANTS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "all-features": ALL_ON,
    "tls-server-only": {"tls": {"enabled": True, "existingSecret": "kv-tls", "caKey": ""}},
    "no-networkpolicy-existing-sa": {
        "networkPolicy": {"enabled": False},
        "serviceAccount": {"create": False, "name": "shared"},
    },
    "pdb-max-unavailable": {
        "podDisruptionBudget": {"enabled": True, "minAvailable": None, "maxUnavailable": "25%"}
    },
}


def _lint(helm, values_file=None) -> subprocess.CompletedProcess[str]:
    cmd = [str(helm), "lint", "--strict", str(CHART)]
    if values_file is not None:
        cmd += ["-f", str(values_file)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_helm_lint_strict(helm, tmp_path, variant):
    """`helm lint --strict` passes for every supported value combination."""
    values_file = tmp_path / "values.yaml"
    values_file.write_text(yaml.safe_dump(VARIANTS[variant]))
    proc = _lint(helm, values_file)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 chart(s) failed" in proc.stdout


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_manifests_match_kubernetes_schemas(render, variant):
    """Every rendered manifest validates (strict) against the Kubernetes API of 1.27 and 1.37."""
    rendered = render(VARIANTS[variant])
    checked = 0
    for doc in rendered.docs:
        if doc["kind"] in CRD_KINDS:
            continue
        for version in K8S_VERSIONS:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(
                    f"{doc['kind']} invalid for Kubernetes {version}: "
                    f"{'.'.join(map(str, exc.path))}: {exc.message}"
                )
        checked += 1
    assert checked >= 3, rendered.kinds()


def test_all_features_render_every_kind(render):
    """With every option on, one of each kind is rendered (two ConfigMaps: policy, dashboard)."""
    assert render(ALL_ON).kinds() == sorted(
        [
            "ConfigMap",
            "ConfigMap",
            "Deployment",
            "HorizontalPodAutoscaler",
            "NetworkPolicy",
            "PodDisruptionBudget",
            "Service",
            "ServiceAccount",
            "ServiceMonitor",
        ]
    )


def test_validator_catches_a_broken_manifest(render):
    """The schema validation is not a no-op: a mistyped field in a rendered Deployment fails it."""
    deployment = copy.deepcopy(render().one("Deployment"))
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpcc"] = {"port": 1}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSIONS[0], strict=True)
    deployment = copy.deepcopy(render().one("Deployment"))
    deployment["spec"]["replicas"] = "one"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSIONS[0], strict=True)


def test_every_resource_labelled_and_namespaced(render):
    """Every resource carries the standard labels and the release namespace."""
    for doc in render(ALL_ON).docs:
        labels = doc["metadata"]["labels"]
        assert labels["app.kubernetes.io/managed-by"] == "Helm"
        assert labels["app.kubernetes.io/instance"] == "kv"
        assert labels["app.kubernetes.io/version"] == "0.1.0"
        assert doc["metadata"]["namespace"] == "serving"


@pytest.mark.parametrize("tag", ["v" + "1" * 70, "1.0-", "_x", "sha-" + "a" * 64])
def test_the_version_label_is_a_valid_label_value_for_any_valid_tag(render, tag):
    """The image tag (up to 128 characters, which may end in - or .) becomes app.kubernetes.io/version:
    cut to 63 characters and trimmed to alphanumerics at both ends, a valid label value."""
    import re

    label = re.compile(r"^([A-Za-z0-9]([A-Za-z0-9_.-]{0,61}[A-Za-z0-9])?)?$")
    for doc in render({"image": {"tag": tag}}).docs:
        version = doc["metadata"]["labels"].get("app.kubernetes.io/version", "")
        assert label.match(version), (doc["kind"], version)
        assert version and tag.strip("-._").startswith(version[:10])
