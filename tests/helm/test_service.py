"""Service template: gRPC and metrics ports, named targets, selector."""

from __future__ import annotations

from tests.helm.conftest import FULLNAME


def test_ports_target_named_container_ports(render):
    """The Service exposes grpc and metrics and targets the container ports by name."""
    svc = render().one("Service")
    ports = {p["name"]: p for p in svc["spec"]["ports"]}
    assert ports["grpc"]["port"] == 50051 and ports["grpc"]["targetPort"] == "grpc"
    assert ports["grpc"]["appProtocol"] == "grpc"
    assert ports["metrics"]["port"] == 9090 and ports["metrics"]["targetPort"] == "metrics"
    assert svc["spec"]["type"] == "ClusterIP"
    assert svc["metadata"]["name"] == FULLNAME


def test_selector_selects_the_pods(render):
    """The Service selector is a subset of the Deployment's pod labels."""
    r = render()
    selector = r.one("Service")["spec"]["selector"]
    pod_labels = r.one("Deployment")["spec"]["template"]["metadata"]["labels"]
    assert selector and selector.items() <= pod_labels.items()


def test_type_ports_and_annotations(render):
    """service.type, ports and annotations are applied."""
    svc = render(
        {
            "service": {
                "type": "LoadBalancer",
                "grpcPort": 443,
                "metricsPort": 9100,
                "annotations": {"lb.example/internal": "true"},
            }
        }
    ).one("Service")
    assert svc["spec"]["type"] == "LoadBalancer"
    assert {p["name"]: p["port"] for p in svc["spec"]["ports"]} == {"grpc": 443, "metrics": 9100}
    assert svc["metadata"]["annotations"] == {"lb.example/internal": "true"}


def test_external_traffic_policy_on_node_port_and_load_balancer(render, render_error):
    """service.externalTrafficPolicy reaches a NodePort or LoadBalancer Service (Local keeps the
    workers' addresses, which the per-host rate limit counts); unset, the field is absent
    (Kubernetes' default); with ClusterIP it is refused by name, and a value outside Cluster /
    Local by the schema."""
    assert "externalTrafficPolicy" not in render({"service": {"type": "LoadBalancer"}}).one("Service")["spec"]
    for kind in ("NodePort", "LoadBalancer"):
        svc = render({"service": {"type": kind, "externalTrafficPolicy": "Local"}}).one("Service")
        assert svc["spec"]["externalTrafficPolicy"] == "Local"
    err = render_error({"service": {"externalTrafficPolicy": "Local"}})
    assert "service.externalTrafficPolicy" in err and "ClusterIP" in err
    assert "externalTrafficPolicy" in render_error({"service": {"type": "NodePort", "externalTrafficPolicy": "local"}})


def test_ip_family_policy(render, render_error):
    """service.ipFamilyPolicy reaches the Service (dual stack: the pods answer on both families,
    tests/helm/test_serve_with_chart.py); unset, the cluster's default; other values refused."""
    assert "ipFamilyPolicy" not in render().one("Service")["spec"]
    svc = render({"service": {"ipFamilyPolicy": "PreferDualStack"}}).one("Service")
    assert svc["spec"]["ipFamilyPolicy"] == "PreferDualStack"
    assert "ipFamilyPolicy" in render_error({"service": {"ipFamilyPolicy": "DualStack"}})
