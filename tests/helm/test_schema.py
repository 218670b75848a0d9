"""values.schema.json: bad values fail `helm template` / `helm lint` with a message naming the field,
and the policy part agrees with controlplane.policy.Policy at every boundary."""

from __future__ import annotations

import dataclasses
import json
import subprocess
from typing import Any

import pytest
import yaml

from controlplane.model.batch import SchemaError
from controlplane.policy import SCHEDULERS, VICTIM_RULES, Policy
from tests.helm.conftest import CHART

SCHEMA = json.loads((CHART / "values.schema.json").read_text())
POLICY_SCHEMA = SCHEMA["properties"]["policy"]

# (values, text the error must contain)
BAD_VALUES: list[tuple[dict[str, Any], str]] = [
    ({"image": {"tag": "latest"}}, "image.tag"),
    ({"image": {"tag": "LATEST"}}, "image.tag"),
    ({"image": {"tag": ""}}, "image.tag"),
    ({"image": {"tag": 1.5}}, "image.tag"),
    ({"image": {"repository": "Bad Repo"}}, "image.repository"),
    ({"image": {"digest": "sha256:nothex"}}, "image.digest"),
    ({"image": {"pullPolicy": "Sometimes"}}, "image.pullPolicy"),
    ({"service": {"grpcPort": 0}}, "service.grpcPort"),
    ({"service": {"grpcPort": 70000}}, "service.grpcPort"),
    ({"service": {"metricsPort": "9090"}}, "service.metricsPort"),
    ({"service": {"grpcPort": 9090}}, "service.metricsPort"),
    ({"service": {"type": "ExternalName"}}, "service.type"),
    # below 2 MiB workers' report batches (up to 1 MiB) are refused (the old schema took 1024)
    ({"server": {"maxMessageBytes": 2097151}}, "server.maxMessageBytes"),
    ({"server": {"maxMessageBytes": 65536}}, "server.maxMessageBytes"),
    ({"replicaCount": -1}, "replicaCount"),
    ({"replicaCount": "two"}, "replicaCount"),
    ({"policy": {"scheduler": "sjf"}}, "policy.scheduler"),
    ({"policy": {"victim_rule": "oldest"}}, "policy.victim_rule"),
    ({"policy": {"window_min": 0}}, "policy.window_min"),
    ({"policy": {"window_min": 2.5}}, "policy.window_min"),
    (
        {"policy": {"window_min": 80, "window_max": 16}},
        "policy.window_max: 16 is below policy.window_min = 80",
    ),
    ({"policy": {"slo_tbt_ms": "fast"}}, "policy.slo_tbt_ms"),
    ({"policy": {"version": 3}}, "version"),
    ({"policy": {"layerkv": {"tpot_margin": 1.5}}}, "policy.layerkv.tpot_margin"),
    ({"policy": {"lvf": {"gamma": 1}}}, "gamma"),
    ({"policy": {"unknown_knob": 1}}, "unknown_knob"),
    ({"securityContext": {"runAsNonRoot": False}}, "securityContext.runAsNonRoot"),
    (
        {"securityContext": {"allowPrivilegeEscalation": True}},
        "securityContext.allowPrivilegeEscalation",
    ),
    (
        {"securityContext": {"readOnlyRootFilesystem": False}},
        "securityContext.readOnlyRootFilesystem",
    ),
    ({"securityContext": {"privileged": True}}, "securityContext.privileged"),
    (
        {"securityContext": {"capabilities": {"drop": ["NET_RAW"]}}},
        "securityContext.capabilities.drop",
    ),
    ({"securityContext": {"capabilities": {"drop": ["ALL"], "add": ["NET_ADMIN"]}}}, "add"),
    (
        {"securityContext": {"seccompProfile": {"type": "Unconfined"}}},
        "securityContext.seccompProfile.type",
    ),
    ({"podSecurityContext": {"runAsUser": 0}}, "podSecurityContext.runAsUser"),
    ({"resources": {"requests": {"cpu": "lots", "memory": "1Gi"}}}, "resources.requests.cpu"),
    ({"resources": {"limits": {"memory": None}}}, "memory"),
    ({"tls": {"enabled": True}}, "tls.existingSecret"),
    ({"tls": {"enabled": "yes"}}, "tls.enabled"),
    ({"policyToken": {"existingSecret": "Not_A_Secret"}}, "policyToken.existingSecret"),
    ({"autoscaling": {"minReplicas": 0}}, "autoscaling.minReplicas"),
    (
        {"autoscaling": {"targetCPUUtilizationPercentage": 0}},
        "autoscaling.targetCPUUtilizationPercentage",
    ),
    ({"podDisruptionBudget": {"minAvailable": "half"}}, "podDisruptionBudget.minAvailable"),
    ({"probes": {"liveness": {"periodSeconds": 0}}}, "probes.liveness.periodSeconds"),
    (
        {"networkPolicy": {"workerNamespaceLabel": {"key": "bad key!"}}},
        "networkPolicy.workerNamespaceLabel.key",
    ),
    ({"tmpSizeLimit": "big"}, "tmpSizeLimit"),
    ({"extraArgs": "--verbose"}, "extraArgs"),
    ({"surprise": True}, "surprise"),
]


@pytest.mark.parametrize(("values", "needle"), BAD_VALUES, ids=[n for _, n in BAD_VALUES])
def test_bad_value_rejected_naming_field(render_error, values, needle):
    """Each bad value makes `helm template` fail, and the message names the offending field."""
    assert needle in render_error(values)


def test_lint_strict_rejects_bad_values(helm, tmp_path):
    """`helm lint --strict` fails on a bad values file and names the field."""
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"image": {"tag": "latest"}, "policy": {"scheduler": "sjf"}}))
    proc = subprocess.run(
        [str(helm), "lint", "--strict", str(CHART), "-f", str(bad)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert "image.tag" in out and "policy.scheduler" in out


def test_schema_enums_match_server():
    """The schema's scheduler and victim-rule enums are exactly the server's registries."""
    props = POLICY_SCHEMA["properties"]
    assert tuple(props["scheduler"]["enum"]) == SCHEDULERS
    assert tuple(props["victim_rule"]["enum"]) == VICTIM_RULES


def test_schema_covers_policy_fields():
    """The schema knows every Policy field (and no other); version is the server's to assign."""

    def names(cls_instance) -> set[str]:
        return {f.name for f in dataclasses.fields(cls_instance)}

    props = POLICY_SCHEMA["properties"]
    assert set(props) == names(Policy()) - {"version"}
    assert set(props["layerkv"]["properties"]) == names(Policy().layerkv)
    assert set(props["lvf"]["properties"]) == names(Policy().lvf)
    assert POLICY_SCHEMA["additionalProperties"] is False


def _numeric_leaves() -> list[tuple[tuple[str, ...], dict[str, Any]]]:
    out = []
    for name, spec in POLICY_SCHEMA["properties"].items():
        if spec.get("type") == "object":
            out += [((name, inner), s) for inner, s in spec["properties"].items()]
        elif spec.get("type") in ("integer", "number"):
            out.append(((name,), spec))
    return out


def _nest(path: tuple[str, ...], value: Any) -> dict[str, Any]:
    return {path[0]: value} if len(path) == 1 else {path[0]: {path[1]: value}}


def _merge(items: list[dict[str, Any]]) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    for item in items:
        for k, v in item.items():
            if isinstance(v, dict):
                merged.setdefault(k, {}).update(v)
            else:
                merged[k] = v
    return merged


def _edges(spec: dict[str, Any]) -> tuple[float, float, float, float]:
    """(lowest allowed, highest allowed, just below, just above) for a numeric schema."""
    integer = spec["type"] == "integer"
    if "exclusiveMaximum" in spec:
        hi_bad = spec["exclusiveMaximum"]
        hi = hi_bad - (1 if integer else 1e-6)
    else:
        hi = spec["maximum"]
        hi_bad = hi + (1 if integer else max(abs(hi) * 1e-6, 1e-6))
    if "exclusiveMinimum" in spec:
        lo_bad = spec["exclusiveMinimum"]
        lo = lo_bad + (1 if integer else 1e-6)
    else:
        lo = spec["minimum"]
        lo_bad = lo - (1 if integer else max(abs(lo) * 1e-6, 1e-6))
    return lo, hi, lo_bad, hi_bad


@pytest.mark.parametrize("side", ["low", "high"])
def test_policy_edges_accepted_by_schema_and_server(render, side):
    """All policy fields at their lowest (or highest) allowed value render, and the server's Policy
    loads the rendered file to exactly those values."""
    leaves = _numeric_leaves()
    chosen = {path: _edges(spec)[0 if side == "low" else 1] for path, spec in leaves}
    values = _merge([_nest(path, v) for path, v in chosen.items()])
    cm = render({"policy": values}).one("ConfigMap")
    loaded = yaml.safe_load(cm["data"]["policy.yaml"])
    policy = Policy.from_dict(loaded)
    for path, want in chosen.items():
        got = (
            getattr(policy, path[0])
            if len(path) == 1
            else getattr(getattr(policy, path[0]), path[1])
        )
        assert got == pytest.approx(want, rel=1e-12), path
        assert type(got) is int or POLICY_SCHEMA_TYPE(path) == "number", path


def POLICY_SCHEMA_TYPE(path: tuple[str, ...]) -> str:  # noqa: N802 - reads like a constant lookup
    spec = POLICY_SCHEMA["properties"][path[0]]
    return str((spec["properties"][path[1]] if len(path) == 2 else spec)["type"])


@pytest.mark.parametrize("side", ["low", "high"])
def test_policy_out_of_range_rejected_by_schema_and_server(render_error, side):
    """Every policy value just outside its range is rejected by the schema (naming the field) and
    by the server's Policy -- the two agree on every boundary."""
    leaves = _numeric_leaves()
    bad = {path: _edges(spec)[2 if side == "low" else 3] for path, spec in leaves}
    for path, value in bad.items():
        with pytest.raises(SchemaError):
            Policy.from_dict(_nest(path, value))
    err = render_error({"policy": _merge([_nest(p, v) for p, v in bad.items()])})
    for path in bad:
        assert "policy." + ".".join(path) + ":" in err, path


def test_small_and_large_numbers_keep_their_type(render):
    """Numbers Go would print in exponent form load back as numbers of the right kind."""
    values = {
        "alpha": 1e-7,
        "max_paused_steps": 1 << 30,
        "slo_ttft_ms": 1e8,
        "layerkv": {"model_params": 7.5e10, "hidden_size": 1 << 24},
        "lvf": {"beta_b": -2.5e-5},
    }
    loaded = yaml.safe_load(render({"policy": values}).one("ConfigMap")["data"]["policy.yaml"])
    assert loaded["alpha"] == pytest.approx(1e-7)
    assert loaded["max_paused_steps"] == 1 << 30 and isinstance(loaded["max_paused_steps"], int)
    assert loaded["layerkv"]["hidden_size"] == 1 << 24 and isinstance(
        loaded["layerkv"]["hidden_size"], int
    )
    assert loaded["layerkv"]["model_params"] == 7.5e10
    assert loaded["lvf"]["beta_b"] == pytest.approx(-2.5e-5)
    Policy.from_dict(loaded)


PROBE_AND_HEALTH_PORT_BAD: dict[str, tuple[dict[str, Any], str]] = {
    "health-port-null": ({"service": {"healthPort": None}}, "healthPort"),
    "grpc-service-typo": ({"probes": {"grpcService": "kvplane.v1.Controlplane"}}, "probes.grpcService"),
    "grpc-service-short-name": ({"probes": {"grpcService": "ControlPlane"}}, "probes.grpcService"),
}
"""Values that rendered a Deployment that never runs: a null service.healthPort (an empty
--health-port and probe port), a probes.grpcService the server does not register (NOT_FOUND: the
startup probe never passes). Negative control: the old schema let each through."""


@pytest.mark.parametrize("case", list(PROBE_AND_HEALTH_PORT_BAD))
def test_health_port_and_probe_service_are_refused_by_template_and_lint(helm, render_error, tmp_path, case):
    """`helm template` and `helm lint --strict` both refuse each, naming the field."""
    values, needle = PROBE_AND_HEALTH_PORT_BAD[case]
    assert needle in render_error(values)
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(values))
    proc = subprocess.run(
        [str(helm), "lint", "--strict", str(CHART), "-f", str(bad)], capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode != 0 and needle in proc.stdout + proc.stderr, proc.stdout + proc.stderr


@pytest.mark.parametrize("service", ["", "kvplane.v1.ControlPlane", "kvplane.v1.PolicyService"])
def test_every_probe_service_the_schema_allows_renders(render, service):
    """Control of the refusals: each allowed name reaches all three probes."""
    from tests.helm.conftest import container

    c = container(render({"probes": {"grpcService": service}}).one("Deployment"))
    assert {c[p]["grpc"]["service"] for p in ("startupProbe", "livenessProbe", "readinessProbe")} == {service}


def test_probe_service_enum_is_what_the_server_registers():
    """The enum is "" plus the proto's services, the names the server sets in grpc.health.v1
    (test_serve_with_chart checks a real server answers SERVING for each)."""
    from controlplane.service.server import SERVICE_NAMES

    enum = SCHEMA["properties"]["probes"]["properties"]["grpcService"]["enum"]
    assert enum[0] == "" and sorted(enum[1:]) == sorted(SERVICE_NAMES)


def test_the_smallest_message_limit_renders(render):
    """Control of the server.maxMessageBytes refusals: 2 MiB (kvplane serve's minimum,
    MIN_SERVE_MESSAGE_BYTES) renders as --max-message-bytes."""
    from controlplane.service.server import MIN_SERVE_MESSAGE_BYTES
    from tests.helm.conftest import container

    assert SCHEMA["properties"]["server"]["properties"]["maxMessageBytes"]["minimum"] == MIN_SERVE_MESSAGE_BYTES
    args = container(render({"server": {"maxMessageBytes": MIN_SERVE_MESSAGE_BYTES}}).one("Deployment"))["args"]
    assert args[args.index("--max-message-bytes") + 1] == str(MIN_SERVE_MESSAGE_BYTES)
