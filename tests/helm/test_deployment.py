"""Deployment template: ports, native gRPC probes, restricted security, secrets, image pinning."""

from __future__ import annotations

import pytest

from tests.helm.conftest import FULLNAME, container

TOKEN_SECRET = "kvplane-policy-token"
TLS_SECRET = "kvplane-tls"


def _volume(deployment: dict, name: str) -> dict:
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    return volumes[name]


def _mounts(deployment: dict) -> dict[str, dict]:
    return {m["name"]: m for m in container(deployment)["volumeMounts"]}


def test_ports_and_args_default(render):
    """The container serves gRPC on 50051, metrics on 9090 and its probes on 50052, and is told so
    by its flags."""
    c = container(render().one("Deployment"))
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"grpc": 50051, "metrics": 9090, "health": 50052}
    assert c["args"] == [
        "--listen",
        "0.0.0.0:50051",
        "--metrics-port",
        "9090",
        "--policy",
        "/etc/kvplane/policy/policy.yaml",
        "--log-level",
        "info",
        "--grace-s",
        "5",
        "--max-sessions",
        "256",
        "--max-watchers",
        "32",
        "--max-message-bytes",
        "4194304",
        "--rate-limit-rps",
        "0",
        "--health-port",
        "50052",
    ]
    assert "command" not in c, "the image ENTRYPOINT (kvplane serve) must not be overridden"


def test_custom_service_ports_leave_the_container_ports_fixed(render):
    """The Service's ports are the Service's: the container keeps binding 50051 / 9090 (unprivileged,
    whatever the Service exposes); the health port (a container port) flows to its flag, port and
    probes together."""
    c = container(render({"service": {"grpcPort": 7000, "metricsPort": 7001, "healthPort": 7002}}).one("Deployment"))
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"grpc": 50051, "metrics": 9090, "health": 7002}
    assert c["args"][:4] == ["--listen", "0.0.0.0:50051", "--metrics-port", "9090"]
    assert c["args"][c["args"].index("--health-port") + 1] == "7002"
    assert c["livenessProbe"]["grpc"]["port"] == 7002


@pytest.mark.parametrize(("grpc", "metrics"), [(443, 80), (1, 1023)])
def test_privileged_service_ports_keep_the_container_unprivileged(render, grpc, metrics):
    """service.grpcPort 443 / metricsPort 80 render the Service on those ports while the container,
    uid 10001 with every capability dropped (it cannot bind below 1024), binds its fixed 50051 / 9090,
    which the Service targets by name. Negative control: the old chart passed 443 / 80 to --listen /
    --metrics-port and as the containerPorts (the pod crash-looped on 'Permission denied')."""
    r = render({"service": {"grpcPort": grpc, "metricsPort": metrics}})
    svc_ports = {p["name"]: p for p in r.one("Service")["spec"]["ports"]}
    assert {n: p["port"] for n, p in svc_ports.items()} == {"grpc": grpc, "metrics": metrics}
    assert {n: p["targetPort"] for n, p in svc_ports.items()} == {"grpc": "grpc", "metrics": "metrics"}
    c = container(r.one("Deployment"))
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"grpc": 50051, "metrics": 9090, "health": 50052}
    assert all(port >= 1024 for port in ports.values())
    assert c["args"][:4] == ["--listen", "0.0.0.0:50051", "--metrics-port", "9090"]
    assert c["securityContext"]["runAsUser"] == 10001 and c["securityContext"]["capabilities"]["drop"] == ["ALL"]
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert c[probe]["grpc"]["port"] == 50052


@pytest.mark.parametrize("port", [80, 1023])
def test_a_privileged_health_port_is_refused(render_error, port):
    """service.healthPort is a container port (not in the Service): below 1024 the unprivileged pod
    could not bind it, so the schema refuses it. Control: 1024 renders (test below)."""
    assert "service.healthPort" in render_error({"service": {"healthPort": port}})


def test_the_lowest_unprivileged_health_port_renders(render):
    """Control of the refusal above: 1024 is the health port, its probes' port."""
    c = container(render({"service": {"healthPort": 1024}}).one("Deployment"))
    assert c["livenessProbe"]["grpc"]["port"] == 1024


def test_probes_are_native_grpc(render):
    """Startup, liveness and readiness use kubelet's gRPC probe on the health service, on the
    plaintext health-only port (--health-port) also without TLS: on the API port the probes
    shared its bounded unary-call slots with Plan and policy calls (Helm review, session 64)."""
    c = container(render().one("Deployment"))
    assert c["args"][c["args"].index("--health-port") + 1] == "50052"
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert c[probe]["grpc"] == {"port": 50052, "service": ""}, probe
        assert "tcpSocket" not in c[probe] and "exec" not in c[probe]
    assert c["livenessProbe"]["periodSeconds"] == 10
    assert c["readinessProbe"]["failureThreshold"] == 2
    assert c["startupProbe"]["failureThreshold"] == 30


def test_probe_health_service_name_is_configurable(render):
    """probes.grpcService is the grpc.health.v1 service the probes ask about."""
    c = container(render({"probes": {"grpcService": "kvplane.v1.ControlPlane"}}).one("Deployment"))
    assert c["readinessProbe"]["grpc"]["service"] == "kvplane.v1.ControlPlane"


def test_restricted_security_context(render):
    """Pod and container meet the restricted Pod Security Standard."""
    d = render().one("Deployment")
    pod = d["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == 10001
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["automountServiceAccountToken"] is False
    sc = container(d)["securityContext"]
    assert sc["runAsNonRoot"] is True
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["privileged"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert sc["seccompProfile"] == {"type": "RuntimeDefault"}


def test_writable_tmp_with_read_only_root(render):
    """A size-limited emptyDir backs /tmp because the root filesystem is read-only."""
    d = render({"tmpSizeLimit": "64Mi"}).one("Deployment")
    assert _volume(d, "tmp") == {"name": "tmp", "emptyDir": {"sizeLimit": "64Mi"}}
    assert _mounts(d)["tmp"]["mountPath"] == "/tmp"


def test_resources_requests_and_limits(render):
    """Requests and limits are always set, and values override them."""
    c = container(render().one("Deployment"))
    assert set(c["resources"]) == {"requests", "limits"}
    assert set(c["resources"]["requests"]) == {"cpu", "memory"}
    assert set(c["resources"]["limits"]) == {"cpu", "memory"}
    custom = {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"cpu": "4", "memory": "4Gi"}}
    assert container(render({"resources": custom}).one("Deployment"))["resources"] == custom


def test_image_is_pinned(render):
    """The image reference carries the pinned tag, or the digest when one is given."""
    assert (
        container(render().one("Deployment"))["image"]
        == "ghcr.io/kvplane/kvplane-controlplane:0.1.0"
    )
    digest = "sha256:" + "ab" * 32
    c = container(
        render(
            {"image": {"repository": "reg.example:5000/kv/cp", "tag": "1.2.3", "digest": digest}}
        ).one("Deployment")
    )
    assert c["image"] == f"reg.example:5000/kv/cp@{digest}"


def test_policy_configmap_mounted(render):
    """The policy ConfigMap is mounted read-only where --policy points."""
    d = render().one("Deployment")
    assert _volume(d, "policy")["configMap"]["name"] == FULLNAME
    assert _mounts(d)["policy"] == {
        "name": "policy",
        "mountPath": "/etc/kvplane/policy",
        "readOnly": True,
    }


def test_policy_change_rolls_pods(render):
    """The pod template's policy checksum changes when (and only when) the policy changes."""

    def checksum(values=None):
        d = render(values).one("Deployment")
        return d["spec"]["template"]["metadata"]["annotations"]["checksum/policy"]

    base = checksum()
    assert checksum({"replicaCount": 2}) == base
    assert checksum({"policy": {"slo_tbt_ms": 150}}) != base


def test_no_token_no_secret(render):
    """Without policyToken.existingSecret no token flag, volume or mount is rendered."""
    d = render().one("Deployment")
    assert "--policy-token-file" not in container(d)["args"]
    assert "policy-token" not in _mounts(d)


def test_token_from_existing_secret(render):
    """policyToken.existingSecret mounts that Secret's key as the token file and passes it."""
    d = render({"policyToken": {"existingSecret": TOKEN_SECRET, "key": "write-token"}}).one(
        "Deployment"
    )
    args = container(d)["args"]
    assert args[args.index("--policy-token-file") + 1] == "/etc/kvplane/token/token"
    secret = _volume(d, "policy-token")["secret"]
    assert secret["secretName"] == TOKEN_SECRET
    assert secret["items"] == [{"key": "write-token", "path": "token"}]
    assert secret["defaultMode"] == 0o440
    assert _mounts(d)["policy-token"] == {
        "name": "policy-token",
        "mountPath": "/etc/kvplane/token",
        "readOnly": True,
    }


def test_mtls_from_existing_secret(render):
    """tls.enabled mounts cert, key and CA from the Secret and passes all three flags."""
    d = render({"tls": {"enabled": True, "existingSecret": TLS_SECRET}}).one("Deployment")
    args = container(d)["args"]
    flags = {args[i]: args[i + 1] for i in range(len(args) - 1) if args[i].startswith("--tls")}
    assert flags == {
        "--tls-cert": "/etc/kvplane/tls/tls.crt",
        "--tls-key": "/etc/kvplane/tls/tls.key",
        "--tls-ca": "/etc/kvplane/tls/ca.crt",
    }
    secret = _volume(d, "tls")["secret"]
    assert secret["secretName"] == TLS_SECRET
    assert secret["items"] == [
        {"key": "tls.crt", "path": "tls.crt"},
        {"key": "tls.key", "path": "tls.key"},
        {"key": "ca.crt", "path": "ca.crt"},
    ]
    assert _mounts(d)["tls"]["readOnly"] is True


def test_tls_without_client_ca(render):
    """An empty tls.caKey serves TLS without asking for client certificates (no --tls-ca)."""
    d = render({"tls": {"enabled": True, "existingSecret": TLS_SECRET, "caKey": ""}}).one(
        "Deployment"
    )
    args = container(d)["args"]
    assert "--tls-cert" in args and "--tls-ca" not in args
    assert [i["path"] for i in _volume(d, "tls")["secret"]["items"]] == ["tls.crt", "tls.key"]


def test_tls_probes_check_the_plaintext_health_port(render):
    """kubelet's gRPC probe cannot speak TLS, so with TLS on the server also serves grpc.health.v1
    in plaintext on service.healthPort (--health-port) and the probes check that port (a drain's
    NOT_SERVING reaches readiness); without TLS too (test_probes_are_native_grpc)."""
    c = container(
        render({"tls": {"enabled": True, "existingSecret": TLS_SECRET}}).one("Deployment")
    )
    assert c["args"][c["args"].index("--health-port") + 1] == "50052"
    assert {"name": "health", "containerPort": 50052, "protocol": "TCP"} in c["ports"]
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert c[probe]["grpc"] == {"port": 50052, "service": ""}
        assert "tcpSocket" not in c[probe]


@pytest.mark.parametrize("tls", [True, False])
@pytest.mark.parametrize("port", [50051, 9090])
def test_the_health_port_must_differ_from_the_others(render_error, tls, port):
    """The health port is a container port: it must differ from the container's fixed gRPC and
    metrics ports (whatever the Service's ports are)."""
    values = {"tls": {"enabled": True, "existingSecret": TLS_SECRET}} if tls else {}
    err = render_error({**values, "service": {"grpcPort": 443, "metricsPort": 80, "healthPort": port}})
    assert f"service.healthPort: {port} equals the container's gRPC port (50051) or metrics port (9090)" in err


def test_extra_args_follow_chart_flags(render):
    """extraArgs are appended after the chart's flags, verbatim."""
    args = container(render({"extraArgs": ["--max-watchers", "7"]}).one("Deployment"))["args"]
    assert args[-2:] == ["--max-watchers", "7"]
    assert args[0] == "--listen"


def test_replicas_absent_under_autoscaling(render):
    """replicaCount sets spec.replicas, unless the HPA owns the replica count."""
    assert render({"replicaCount": 3}).one("Deployment")["spec"]["replicas"] == 3
    d = render({"replicaCount": 3, "autoscaling": {"enabled": True}}).one("Deployment")
    assert "replicas" not in d["spec"]


def test_rolling_update_keeps_capacity(render):
    """Rolling updates never take the only replica down before its successor is ready."""
    strategy = render().one("Deployment")["spec"]["strategy"]
    assert strategy == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1},
    }


def test_selector_matches_pod_labels(render):
    """The Deployment selector selects its own pod template."""
    d = render({"podLabels": {"team": "serving"}}).one("Deployment")
    selector = d["spec"]["selector"]["matchLabels"]
    labels = d["spec"]["template"]["metadata"]["labels"]
    assert selector.items() <= labels.items()
    assert labels["team"] == "serving"
    assert "team" not in selector


def test_scheduling_values_pass_through(render):
    """nodeSelector, tolerations, affinity, spread and priority reach the pod spec."""
    values = {
        "nodeSelector": {"pool": "cpu"},
        "tolerations": [
            {"key": "dedicated", "operator": "Equal", "value": "kv", "effect": "NoSchedule"}
        ],
        "affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": []}},
        "priorityClassName": "system-cluster-critical",
        "imagePullSecrets": [{"name": "regcred"}],
    }
    pod = render(values).one("Deployment")["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"pool": "cpu"}
    assert pod["tolerations"] == values["tolerations"]
    assert pod["affinity"] == values["affinity"]
    assert pod["priorityClassName"] == "system-cluster-critical"
    assert pod["imagePullSecrets"] == [{"name": "regcred"}]


def test_server_limits_become_flags(render):
    """server.* values become the matching `kvplane serve` flags, numbers written plainly."""
    values = {
        "server": {
            "logLevel": "debug",
            "graceSeconds": 2.5,
            "maxSessions": 1000,
            "maxWatchers": 4,
            "maxMessageBytes": 16777216,
            "rateLimitRps": 0.5,
        }
    }
    args = container(render(values).one("Deployment"))["args"]
    flags = {args[i]: args[i + 1] for i in range(len(args) - 1) if args[i].startswith("--")}
    assert flags["--log-level"] == "debug"
    assert flags["--grace-s"] == "2.5"
    assert flags["--max-sessions"] == "1000"
    assert flags["--max-watchers"] == "4"
    assert flags["--max-message-bytes"] == "16777216"
    assert flags["--rate-limit-rps"] == "0.5"


def test_grace_must_fit_termination_period(render_error):
    """A drain longer than the pod's termination grace period is rejected naming both values."""
    err = render_error({"server": {"graceSeconds": 40}, "terminationGracePeriodSeconds": 30})
    assert "server.graceSeconds: 40 is not 2 s below terminationGracePeriodSeconds = 30" in err
    err = render_error({"server": {"graceSeconds": 28.5}, "terminationGracePeriodSeconds": 30})
    assert "server.graceSeconds: 28.5 is not 2 s below terminationGracePeriodSeconds = 30" in err


def test_graceful_termination_period(render):
    """terminationGracePeriodSeconds gives the SIGTERM handler time to drain."""
    pod = render({"terminationGracePeriodSeconds": 45}).one("Deployment")["spec"]["template"][
        "spec"
    ]
    assert pod["terminationGracePeriodSeconds"] == 45


def test_fullname_override(render):
    """fullnameOverride names every resource."""
    r = render({"fullnameOverride": "kv-cp"})
    assert {d["metadata"]["name"] for d in r.docs} == {"kv-cp"}
