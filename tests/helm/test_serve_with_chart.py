"""The chart's Deployment args and ConfigMap run the real `kvplane serve`: the rendered flags are
accepted, the policy file is the active policy, the token guards writes, metrics are served, and
SIGTERM stops it cleanly. Scenario: what the pod would run, on loopback, with the mounted files
re-rooted into a temp directory."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from controlplane.service.ports import ipv6_loopback
from tests.helm.conftest import CHART, NAMESPACE, RELEASE, REPO, Rendered, container, run_helm

TOKEN = "s3cret-policy-token"
VALUES: dict[str, Any] = {
    "policy": {"slo_tbt_ms": 150, "scheduler": "lvf", "alpha": 1e-5, "lvf": {"beta_b": -0.5}},
    "policyToken": {"existingSecret": "kv-token", "key": "token"},
    "server": {"maxSessions": 8, "graceSeconds": 2, "logLevel": "info"},
}


def _wait_for(check: Callable[[], Any], timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


def _rendered(helm: Path, values: dict[str, Any], tmp_path: Path) -> Rendered:
    proc = run_helm(helm, ["template", RELEASE, str(CHART), "--namespace", NAMESPACE], values, tmp_path)
    assert proc.returncode == 0, proc.stderr
    return Rendered(docs=[d for d in yaml.safe_load_all(proc.stdout) if d])


def _start(cmd: list[str], tmp_path: Path) -> tuple[subprocess.Popen[bytes], Path]:
    """The pod's command started, its output in tmp_path/serve.log."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    log_path = tmp_path / "serve.log"
    with log_path.open("wb") as log:
        return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), log_path


def _serving_event(proc: subprocess.Popen[bytes], log_path: Path) -> dict[str, Any] | None:
    """The server's `serving` log event once written (None before); fails if the server exited."""
    if proc.poll() is not None:
        raise AssertionError(f"kvplane serve exited {proc.returncode}:\n{log_path.read_text()}")
    for line in log_path.read_text().splitlines():
        if line.startswith("{") and json.loads(line).get("event") == "serving":
            return json.loads(line)
    return None


def _pod_command(rendered, root: Path) -> list[str]:
    """`kvplane serve` + the Deployment's args, with mount paths under ``root`` and loopback ports."""
    c = container(rendered.one("Deployment"))
    policy_dir = root / "etc/kvplane/policy"
    token_dir = root / "etc/kvplane/token"
    policy_dir.mkdir(parents=True)
    token_dir.mkdir(parents=True)
    (policy_dir / "policy.yaml").write_text(rendered.one("ConfigMap")["data"]["policy.yaml"])
    (token_dir / "token").write_text(TOKEN + "\n")
    args = [a.replace("/etc/kvplane", str(root / "etc/kvplane")) for a in c["args"]]
    host = args[args.index("--listen") + 1].rpartition(":")[0]  # loopback, but the chart's [::] kept
    args[args.index("--listen") + 1] = "[::]:0" if host == "[::]" else "127.0.0.1:0"
    args[args.index("--metrics-port") + 1] = "0"
    return [sys.executable, "-m", "kvplane.cli", "serve", *args]


@pytest.fixture(scope="module")
def served(helm, tmp_path_factory) -> Iterator[tuple[subprocess.Popen[bytes], dict[str, Any]]]:
    """One server started as the pod would start it (shared by this module's tests; the SIGTERM
    test runs last); yields (process, its `serving` log event)."""
    tmp_path = tmp_path_factory.mktemp("pod")
    cmd = _pod_command(_rendered(helm, VALUES, tmp_path), tmp_path)
    proc, log_path = _start(cmd, tmp_path)
    try:
        event = _wait_for(lambda: _serving_event(proc, log_path), 60, "the serving event")
        yield proc, event
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


def test_every_probe_service_the_schema_allows_is_serving(served):
    """Each probes.grpcService the schema allows answers SERVING on the pod's health port (the
    port the kubelet probes), so no allowed value keeps the startup probe failing; control: a name
    the schema refuses answers NOT_FOUND."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    _, event = served
    schema = json.loads((CHART / "values.schema.json").read_text())
    allowed = schema["properties"]["probes"]["properties"]["grpcService"]["enum"]
    with grpc.insecure_channel(f"127.0.0.1:{event['health_port']}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in allowed:
            got = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert got.status == health_pb2.HealthCheckResponse.SERVING, service
        with pytest.raises(grpc.RpcError) as info:
            stub.Check(health_pb2.HealthCheckRequest(service="kvplane.v1.Controlplane"), timeout=5)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND


def test_pod_args_start_a_healthy_server(served):
    """The rendered flags and files start a SERVING server with the chart's limits and token."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    proc, event = served
    assert event["policy_token"] is True and event["tls"] is False
    assert event["max_sessions"] == 8
    with grpc.insecure_channel(f"127.0.0.1:{event['port']}") as channel:
        got = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert got.status == health_pb2.HealthCheckResponse.SERVING


def test_configmap_policy_is_active_and_token_guards_writes(served):
    """GetPolicy returns the ConfigMap's policy; an update needs the Secret's token."""
    from controlplane.api import Unauthenticated
    from controlplane.service.client import GrpcControlPlane

    _, event = served
    with GrpcControlPlane(f"grpc://127.0.0.1:{event['port']}") as client:
        policy = client.get_policy()
        assert (policy.slo_tbt_ms, policy.scheduler) == (150, "lvf")
        assert policy.alpha == pytest.approx(1e-5)
        assert policy.lvf.beta_b == -0.5
        with pytest.raises(Unauthenticated):
            client.update_policy({"slo_tbt_ms": 100})
        assert client.update_policy({"slo_tbt_ms": 100}, token=TOKEN).slo_tbt_ms == 100


def test_metrics_port_serves_prometheus(served):
    """The metrics port serves the control plane's Prometheus metrics."""
    _, event = served
    url = f"http://127.0.0.1:{event['metrics_port']}/metrics"
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    assert "kvplane_sessions " in text
    assert "kvplane_solve_ms_bucket" in text


def test_sigterm_stops_within_the_grace_period(served):
    """SIGTERM (what Kubernetes sends) ends the server with status 0 well inside the grace period."""
    proc, _ = served
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=VALUES["server"]["graceSeconds"] + 10) == 0
    assert time.monotonic() - start < 30  # terminationGracePeriodSeconds


def test_a_tls_pod_answers_its_probes_on_the_plaintext_health_port(helm, tmp_path):
    """The TLS chart's args, with the Secret's files from a throwaway CA, start a server whose API
    needs TLS while the probes' port (--health-port, plaintext) answers SERVING; plaintext on the
    API port fails (control: the probe port is not just the API without TLS)."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from controlplane.service.ports import free_ports
    from tests.service.certs import ThrowawayCA

    values = {**VALUES, "tls": {"enabled": True, "existingSecret": "kv-tls", "caKey": ""}}
    cmd = _pod_command(_rendered(helm, values, tmp_path), tmp_path)
    tls_dir = tmp_path / "etc/kvplane/tls"
    tls_dir.mkdir(parents=True)
    server = ThrowawayCA().issue("localhost", server=True)
    (tls_dir / "tls.crt").write_bytes(server.cert_pem)
    (tls_dir / "tls.key").write_bytes(server.key_pem)
    health = free_ports(1)[0]
    cmd[cmd.index("--health-port") + 1] = str(health)
    proc, log_path = _start(cmd, tmp_path)
    try:
        event = _wait_for(lambda: _serving_event(proc, log_path), 60, "the serving event")
        assert event["tls"] is True
        with grpc.insecure_channel(f"127.0.0.1:{health}") as channel:
            got = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert got.status == health_pb2.HealthCheckResponse.SERVING
        with grpc.insecure_channel(f"127.0.0.1:{event['port']}") as channel, pytest.raises(grpc.RpcError):
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=3)
    finally:
        proc.kill()
        proc.wait(timeout=10)


@pytest.mark.skipif(not ipv6_loopback(), reason="no IPv6 loopback on this host")
def test_the_pod_answers_on_ipv4_and_ipv6(helm, tmp_path):
    """IPv6-only and dual-stack clusters: the chart's ``--listen 0.0.0.0:PORT`` starts a server
    whose API, health and metrics ports all answer on 127.0.0.1 and on ::1 (gRPC binds a wildcard
    on both families; the metrics port follows ``--listen`` the same way). Control: an explicit
    ``--metrics-host 0.0.0.0`` is bound as given, IPv4 alone, so the metrics do not answer on ::1
    (the check can fail); the gRPC ports still do."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from controlplane.service.ports import free_ports

    def answers(host: str, event: dict[str, Any], health: int) -> list[bool]:
        got = []
        for port in (event["port"], health):
            try:
                with grpc.insecure_channel(f"{host}:{port}") as channel:
                    reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=3)
                got.append(reply.status == health_pb2.HealthCheckResponse.SERVING)
            except grpc.RpcError:
                got.append(False)
        try:
            with urllib.request.urlopen(f"http://{host}:{event['metrics_port']}/metrics", timeout=3) as response:
                got.append(b"kvplane_sessions " in response.read())
        except OSError:
            got.append(False)
        return got

    rendered = _rendered(helm, VALUES, tmp_path)
    assert container(rendered.one("Deployment"))["args"][:2] == ["--listen", "0.0.0.0:50051"]
    for explicit in (False, True):
        root = tmp_path / ("explicit" if explicit else "chart")
        root.mkdir()
        cmd = _pod_command(rendered, root)
        cmd[cmd.index("--listen") + 1] = "0.0.0.0:0"  # the pod's own address, as rendered
        cmd[cmd.index("--health-port") + 1] = str(free_ports(1)[0])
        if explicit:
            cmd += ["--metrics-host", "0.0.0.0"]
        proc, log_path = _start(cmd, root)
        try:
            event = _wait_for(lambda proc=proc, log_path=log_path: _serving_event(proc, log_path), 60,
                              "the serving event")
            health = int(cmd[cmd.index("--health-port") + 1])
            assert answers("127.0.0.1", event, health) == [True, True, True]
            assert answers("[::1]", event, health) == [True, True, not explicit]
        finally:
            proc.kill()
            proc.wait(timeout=10)
