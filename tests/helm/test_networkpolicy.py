"""NetworkPolicy template: only labelled worker namespaces reach gRPC."""

from __future__ import annotations


def _rules(netpol: dict) -> dict[str, dict]:
    """Ingress rules keyed by the single named port each one opens."""
    out = {}
    for rule in netpol["spec"]["ingress"]:
        (port,) = rule["ports"]
        out[port["port"]] = rule
    return out


def test_only_labelled_worker_namespaces_reach_grpc(render):
    """gRPC ingress comes only from namespaces with the worker label from values."""
    r = render()
    np = r.one("NetworkPolicy")
    pods = r.one("Deployment")["spec"]["template"]["metadata"]["labels"]
    assert np["spec"]["podSelector"]["matchLabels"].items() <= pods.items()
    grpc = _rules(np)["grpc"]
    assert grpc["from"] == [{"namespaceSelector": {"matchLabels": {"kvplane.io/worker": "true"}}}]
    assert grpc["ports"] == [{"port": "grpc", "protocol": "TCP"}]


def test_metrics_only_from_monitoring(render):
    """The metrics port opens only to the monitoring namespace label; an empty key closes it."""
    rules = _rules(render().one("NetworkPolicy"))
    assert rules["metrics"]["from"] == [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    ]
    closed = _rules(
        render({"networkPolicy": {"metricsNamespaceLabel": {"key": ""}}}).one("NetworkPolicy")
    )
    assert set(closed) == {"grpc"}


def test_custom_worker_labels_and_pods(render):
    """A custom namespace label and workerPodLabels combine in one peer (namespace AND pod)."""
    np = render(
        {
            "networkPolicy": {
                "workerNamespaceLabel": {"key": "team", "value": "llm"},
                "workerPodLabels": {"app": "sglang"},
            }
        }
    ).one("NetworkPolicy")
    assert _rules(np)["grpc"]["from"] == [
        {
            "namespaceSelector": {"matchLabels": {"team": "llm"}},
            "podSelector": {"matchLabels": {"app": "sglang"}},
        }
    ]


def test_egress_denied_by_default(render):
    """The control plane opens no connections, so all egress is denied unless turned off."""
    np = render().one("NetworkPolicy")
    assert np["spec"]["policyTypes"] == ["Ingress", "Egress"]
    assert np["spec"]["egress"] == []
    open_np = render({"networkPolicy": {"denyEgress": False}}).one("NetworkPolicy")
    assert open_np["spec"]["policyTypes"] == ["Ingress"]
    assert "egress" not in open_np["spec"]


def test_disabled(render):
    """networkPolicy.enabled=false renders no NetworkPolicy."""
    assert render({"networkPolicy": {"enabled": False}}).maybe("NetworkPolicy") is None


def test_empty_worker_label_rejected(render_error):
    """An empty worker label key would admit nothing sensible, so the schema rejects it."""
    err = render_error({"networkPolicy": {"workerNamespaceLabel": {"key": ""}}})
    assert "networkPolicy.workerNamespaceLabel.key" in err


def test_non_string_label_value_rejected(render_error):
    """Label values must be strings (true unquoted is a boolean) -- rejected naming the field."""
    err = render_error({"networkPolicy": {"workerNamespaceLabel": {"value": True}}})
    assert "networkPolicy.workerNamespaceLabel.value" in err


def test_workers_outside_the_cluster_are_admitted_by_cidr_to_grpc_only(render):
    """networkPolicy.workerCIDRs (workers reaching a LoadBalancer Service): an ipBlock rule per
    range on the gRPC port; the metrics port keeps its namespace rule only. Control: none by default."""
    def rules(values):  # noqa: ANN001, ANN202
        return render(values).one("NetworkPolicy")["spec"]["ingress"]

    default = rules(None)
    assert not any("ipBlock" in peer for rule in default for peer in rule["from"])
    got = rules({"service": {"type": "LoadBalancer"}, "networkPolicy": {"workerCIDRs": ["203.0.113.0/24", "2001:db8::/32"]}})
    blocks = [rule for rule in got if any("ipBlock" in peer for peer in rule["from"])]
    assert len(blocks) == 1
    assert [peer["ipBlock"]["cidr"] for peer in blocks[0]["from"]] == ["203.0.113.0/24", "2001:db8::/32"]
    assert blocks[0]["ports"] == [{"port": "grpc", "protocol": "TCP"}]


def test_a_worker_cidr_that_is_not_a_cidr_is_refused(render_error):
    err = render_error({"networkPolicy": {"workerCIDRs": ["10.0.0.1"]}})
    assert "workerCIDRs" in err


def test_ingress_opens_the_container_ports_whatever_the_service_ports(render):
    """NetworkPolicy ports apply to the pod, so they must be the container's (50051 / 9090), never
    the Service's: they are the container ports' names, which the container defines, also with
    service.grpcPort 443 / metricsPort 80 (consistency check of the port split)."""
    r = render({"service": {"grpcPort": 443, "metricsPort": 80}})
    container_ports = {
        p["name"]: p["containerPort"] for p in r.one("Deployment")["spec"]["template"]["spec"]["containers"][0]["ports"]
    }
    opened = {port["port"] for rule in r.one("NetworkPolicy")["spec"]["ingress"] for port in rule["ports"]}
    assert opened == {"grpc", "metrics"}
    assert {container_ports[name] for name in opened} == {50051, 9090}
