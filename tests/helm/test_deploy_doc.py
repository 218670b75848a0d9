"""docs/deploy.md stays true: its metrics exist, its flags parse, its Helm values render and
validate, and its grpcurl policy update is a valid request for the real proto and Policy."""

from __future__ import annotations

import argparse
import json
import re

import kubernetes_validate
import yaml

from tests.helm.conftest import REPO

DOC = (REPO / "docs" / "deploy.md").read_text()


def _registry_names() -> set[str]:
    from prometheus_client import CollectorRegistry

    from controlplane.controller import PrometheusObserver
    from controlplane.service.metrics import ClientMetrics, ServiceMetrics

    service = ServiceMetrics()
    PrometheusObserver(service.registry)
    registries: list[CollectorRegistry] = [service.registry, ClientMetrics().registry]
    names: set[str] = set()
    for registry in registries:
        for family in registry.collect():
            names.add(family.name)
            names.update(sample.name for sample in family.samples)
            if family.type == "counter":
                names.add(family.name + "_total")
            if family.type == "histogram":
                names.update(family.name + s for s in ("_bucket", "_sum", "_count"))
    return names


def test_every_documented_metric_is_exported():
    """Each kvplane_* metric the doc explains is registered by the service, controller or client."""
    documented = set(re.findall(r"\b(kvplane_[a-z_]+[a-z])", DOC))
    assert len(documented) >= 10
    missing = sorted(documented - _registry_names())
    assert missing == []


def test_the_required_metrics_are_explained():
    """The metrics operators look at first each have a row in the metrics table."""
    for name in (
        "kvplane_solve_ms",
        "kvplane_plans_total",
        "kvplane_pauses_total",
        "kvplane_sessions",
    ):
        assert re.search(rf"^\| `{name}[{{`]", DOC, re.M), name


def test_server_flags_exist():
    """Every `--flag` the doc gives to `kvplane serve` is an option of the real command."""
    from controlplane.cli import serve_cmd

    parser = argparse.ArgumentParser()
    serve_cmd.add_arguments(parser)
    known = {opt for action in parser._actions for opt in action.option_strings}
    command = re.search(r"^kvplane serve --listen.*?^```", DOC, re.S | re.M)
    limits = re.search(r"^The limits \(defaults in brackets; `kvplane serve --help` names them\).*?\n\n", DOC,
                       re.S | re.M)
    assert command is not None and limits is not None
    used = set(re.findall(r"(--[a-z][a-z-]*[a-z])", command.group(0) + limits.group(0)))
    assert {"--listen", "--metrics-port", "--policy", "--policy-token-file", "--tls-ca"} <= used
    assert {"--max-sessions", "--rate-limit-rps", "--grace-s"} <= used
    assert used - known == set()


def test_worker_flags_exist():
    """Every worker flag in the doc (--enable-layered-kv, --kv-*) is defined by the SGLang plugin."""
    from sglang_ext.layered_kv_cli import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    defined = {option for action in parser._actions for option in action.option_strings}
    flags = set(re.findall(r"(--kv-[a-z-]+[a-z]|--enable-layered-kv)(?![-*\w])", DOC))
    assert {
        "--kv-control-plane",
        "--kv-tls-ca",
        "--kv-tls-cert",
        "--kv-tls-key",
        "--kv-policy-token-file",
    } <= flags
    assert flags - defined == set(), flags - defined
    assert "--kv-no-such-flag" not in defined  # control: the set is the parser's, not everything


def test_values_example_renders_and_validates(render):
    """The doc's kvplane-values.yaml installs: schema-valid, renders, passes the Kubernetes schemas."""
    block = re.search(r"cat > kvplane-values.yaml <<'EOF'\n(.*?)\nEOF\n", DOC, re.S)
    assert block is not None
    values = yaml.safe_load(block.group(1))
    rendered = render(values)
    assert "ServiceMonitor" in rendered.kinds()
    assert "PodDisruptionBudget" not in rendered.kinds()  # one replica: a budget would block every drain
    for doc in rendered.docs:
        if doc["kind"] != "ServiceMonitor":
            kubernetes_validate.validate(doc, "1.27.0", strict=True)


def test_grpcurl_examples_match_the_api():
    """The grpcurl methods exist in kvplane.v1 and the UpdatePolicy body parses and validates."""
    from google.protobuf import json_format

    from controlplane.policy import Policy
    from controlplane.service import policy_convert
    from kvplane.v1 import controlplane_pb2 as pb

    service = pb.DESCRIPTOR.services_by_name["PolicyService"]
    for method in re.findall(r"kvplane\.v1\.PolicyService/(\w+)", DOC):
        assert method in service.methods_by_name, method
    body = re.search(r"-d '(\{.*?\})'", DOC)
    assert body is not None
    request = json_format.Parse(body.group(1), pb.UpdatePolicyRequest())
    changes = json.loads(body.group(1))["changes"]
    assert request.changes.slo_tbt_ms == changes["slo_tbt_ms"]
    policy = Policy().merged(policy_convert.policy_changes_from_proto(request.changes))
    assert policy.scheduler == changes["scheduler"]
