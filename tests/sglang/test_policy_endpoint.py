"""The live policy endpoint of the embedded control plane (``--kv-policy-listen``), without SGLang:
the launch checks of :class:`PolicyEndpointConfig`, a real policy-only gRPC server over a real
:class:`EmbeddedControlPlane` (token, TLS, watch, port conflict, shutdown) and ``kvplane policy``."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from structlog.testing import capture_logs

from controlplane import api
from controlplane.cli import policy_cmd
from controlplane.embedded import EmbeddedControlPlane
from controlplane.service.client import ClientTLS, GrpcControlPlane
from kvplane.cli import main as kvplane_main
from kvplane.v1 import controlplane_pb2 as pb
from kvplane.v1 import controlplane_pb2_grpc as pb_grpc
from sglang_ext.args import LayeredKVArgs
from sglang_ext.policy_endpoint import PolicyEndpoint
from sglang_ext.policy_endpoint_config import PolicyEndpointConfig
from tests.service.certs import ThrowawayCA
from tests.service.conftest import wait_until

REPO = Path(__file__).resolve().parents[2]
TOKEN = "let-me-tune"


@pytest.fixture
def token_file(tmp_path: Path) -> str:
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    return str(path)


@pytest.fixture
def endpoint(token_file: str) -> Any:
    """An endpoint on a free port over a fresh embedded control plane (stopped after the test)."""
    cp = EmbeddedControlPlane(synchronous=True)
    ep = PolicyEndpoint.start(cp, PolicyEndpointConfig("127.0.0.1:0", token_file=token_file))
    assert ep is not None
    yield SimpleNamespace(endpoint=ep, cp=cp, target=f"127.0.0.1:{ep.port}")
    ep.stop()
    cp.close()


def _args(**kw: Any) -> LayeredKVArgs:
    return LayeredKVArgs(enable_layered_kv=True, **kw)


# ----- launch checks ------------------------------------------------------------------------------


def test_no_listen_flag_no_endpoint_and_its_options_need_it(token_file):
    """Off by default; a ``--kv-policy-listen-*`` option without the flag is refused by name."""
    assert PolicyEndpointConfig.from_args(_args()) is None
    with pytest.raises(ValueError, match="--kv-policy-listen-token-file only apply with --kv-policy-listen HOST:PORT"):
        PolicyEndpointConfig.from_args(_args(kv_policy_listen_token_file=token_file))


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"kv_policy_listen": "127.0.0.1"}, "--kv-policy-listen='127.0.0.1': expected HOST:PORT"),
        ({"kv_policy_listen": "127.0.0.1:70000"}, "--kv-policy-listen='127.0.0.1:70000': port 70000 is out of range [0, 65535]"),
        ({"kv_policy_listen": "127.0.0.1:-5"}, "port -5 is out of range [0, 65535]"),
        ({"kv_policy_listen": "127.0.0.1:5000"}, "serves policy updates: give --kv-policy-listen-token-file FILE"),
        ({"kv_policy_listen": "127.0.0.1:5000", "kv_policy_listen_tls_cert": "TOKEN", "kv_policy_listen_allow_unauthenticated": True},
         "--kv-policy-listen-tls-cert and --kv-policy-listen-tls-key must be given together"),
        ({"kv_policy_listen": "127.0.0.1:5000", "kv_control_plane": "grpc://127.0.0.1:50051",
          "kv_policy_listen_allow_unauthenticated": True},
         "--kv-policy-listen serves the embedded control plane's policy; with --kv-control-plane=grpc://127.0.0.1:50051"),
        ({"kv_policy_listen": "127.0.0.1:5000", "kv_policy_listen_token_file": "/nonexistent-kvplane/token"},
         "--kv-policy-listen-token-file='/nonexistent-kvplane/token': no such file"),
    ],
)
def test_bad_configurations_are_refused_naming_the_flag(kw, message, token_file):
    """Each refusal is one ValueError naming the flag, the value and what is allowed."""
    kw = {k: (token_file if v == "TOKEN" else v) for k, v in kw.items()}
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")
                       .replace(")", r"\)").replace(".", r"\.")):
        PolicyEndpointConfig.from_args(_args(**kw))


def test_an_empty_token_file_and_a_garbage_certificate_are_named(tmp_path, token_file):
    """File contents are checked at launch: an empty token, a certificate that does not parse."""
    empty = tmp_path / "empty"
    empty.write_text("  \n")
    with pytest.raises(ValueError, match="--kv-policy-listen-token-file: token file .* is empty"):
        PolicyEndpointConfig("127.0.0.1:0", token_file=str(empty))
    garbage = tmp_path / "cert.pem"
    garbage.write_text("not a certificate")
    with pytest.raises(ValueError, match="--kv-policy-listen-tls-cert=.*not a PEM certificate file"):
        PolicyEndpointConfig("127.0.0.1:0", token_file=token_file, tls_cert=str(garbage), tls_key=str(garbage))


def test_a_token_gRPC_metadata_cannot_carry_is_named(tmp_path):
    """--kv-policy-listen-token-file holding a two-line token (`openssl rand -base64 64`) is
    refused at launch. Negative control: the old reader accepted it (every update then failed
    with 'Invalid metadata'); ``test_a_valid_configuration_passes`` is the accepted case."""
    wrapped = tmp_path / "wrapped"
    wrapped.write_text("A" * 64 + "\n" + "B" * 24 + "\n")
    with pytest.raises(ValueError, match="--kv-policy-listen-token-file: token file .* character 65 of the token is a line break"):
        PolicyEndpointConfig("127.0.0.1:0", token_file=str(wrapped))


def test_a_valid_configuration_passes(token_file):
    """Negative control of the refusals: token file + a free port is accepted."""
    config = PolicyEndpointConfig.from_args(_args(kv_policy_listen="127.0.0.1:0", kv_policy_listen_token_file=token_file))
    assert config is not None and config.token == TOKEN and config.port == 0 and not config.tls
    open_config = PolicyEndpointConfig("[::1]:5000", allow_unauthenticated=True)
    assert open_config.token is None and open_config.host == "::1"


def test_launch_refuses_dp_and_a_taken_port(token_file):
    """``--dp-size 2`` is refused; so is a port somebody listens on (and a free one passes)."""
    args = _args(kv_policy_listen="127.0.0.1:0", kv_policy_listen_token_file=token_file)
    with pytest.raises(ValueError, match="--kv-policy-listen with --dp-size 2"):
        PolicyEndpointConfig.check_launch(args, SimpleNamespace(dp_size=2))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        taken = _args(kv_policy_listen=f"127.0.0.1:{port}", kv_policy_listen_token_file=token_file)
        with pytest.raises(ValueError, match=rf"--kv-policy-listen='127.0.0.1:{port}': cannot bind \(Address already in use\)"):
            PolicyEndpointConfig.check_launch(taken, SimpleNamespace(dp_size=1))
    assert PolicyEndpointConfig.check_launch(taken, SimpleNamespace(dp_size=1)) is not None  # released now


# ----- the endpoint -----------------------------------------------------------------------------


def test_get_update_watch_with_the_token(endpoint):
    """Get and watch are open; an update with the bearer token makes a new version that the
    controller's store holds and that an open watch receives."""
    client = GrpcControlPlane(endpoint.target, token=TOKEN)
    try:
        assert client.get_policy().version == 1
        seen: list[int] = []

        def read_two() -> None:
            for policy in client.watch_policy():
                seen.append(policy.version)
                if len(seen) == 2:
                    return  # closes the watch (cancels the stream)

        reader = threading.Thread(target=read_two, daemon=True)
        reader.start()
        assert wait_until(lambda: seen == [1], 10)
        new = client.update_policy({"slo_tbt_ms": 123.0, "alpha": 0.5, "scheduler": "lvf"})
        assert (new.version, new.slo_tbt_ms, new.alpha, new.scheduler) == (2, 123.0, 0.5, "lvf")
        assert endpoint.cp.get_policy() == new
        assert endpoint.endpoint.scheduler_gated()
        reader.join(10)
        assert seen == [1, 2]
    finally:
        client.close()


def test_an_update_without_or_with_a_wrong_token_is_unauthenticated(endpoint):
    """No token, a wrong token: UNAUTHENTICATED, the policy unchanged (the previous test's
    update with the right token is the negative control)."""
    for token in (None, "wrong"):
        client = GrpcControlPlane(endpoint.target, token=token)
        try:
            with pytest.raises(api.Unauthenticated):
                client.update_policy({"slo_tbt_ms": 1.0})
        finally:
            client.close()
    assert endpoint.cp.get_policy().version == 1
    with grpc.insecure_channel(endpoint.target) as channel:  # the wire status itself
        stub = pb_grpc.PolicyServiceStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            stub.UpdatePolicy(pb.UpdatePolicyRequest(changes=pb.Policy(alpha=0.1)), timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_only_the_policy_service_is_served(endpoint):
    """No worker sessions on this port: ControlPlane is UNIMPLEMENTED, health knows only
    PolicyService (and the server as a whole)."""
    with grpc.insecure_channel(endpoint.target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service, status in (("", "SERVING"), ("kvplane.v1.PolicyService", "SERVING")):
            got = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert health_pb2.HealthCheckResponse.ServingStatus.Name(got.status) == status
        with pytest.raises(grpc.RpcError) as err:
            health.Check(health_pb2.HealthCheckRequest(service="kvplane.v1.ControlPlane"), timeout=5)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        stub = pb_grpc.ControlPlaneStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            stub.Plan(pb.PlanRequest(), timeout=5)
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_launch_writes_the_launch_scheduler_into_the_live_policy(token_file):
    """With the endpoint on, ``--kv-scheduler`` becomes the live policy's starting scheduler."""
    cp = EmbeddedControlPlane(synchronous=True)
    args = _args(kv_scheduler="layerkv", kv_policy_listen="127.0.0.1:0", kv_policy_listen_token_file=token_file)
    ep = PolicyEndpoint.launch(args, cp)
    try:
        assert ep is not None and cp.get_policy().scheduler == "layerkv" and ep.scheduler_gated()
    finally:
        assert ep is not None
        ep.stop()
        cp.close()
    assert PolicyEndpoint.launch(_args(), EmbeddedControlPlane(synchronous=True)) is None  # flag off


def test_a_taken_port_is_one_log_line_not_a_crash(token_file):
    """Scenario: the port was free at launch and is taken when the scheduler binds. start()
    returns None after one ``policy_endpoint_unavailable`` line naming the address."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        listen = f"127.0.0.1:{busy.getsockname()[1]}"
        with capture_logs() as logs:
            ep = PolicyEndpoint.start(EmbeddedControlPlane(synchronous=True), PolicyEndpointConfig(listen, token_file=token_file))
    assert ep is None
    lines = [e for e in logs if e["event"] == "policy_endpoint_unavailable"]
    assert len(lines) == 1 and lines[0]["listen"] == listen and "cannot bind" in lines[0]["error"]


def test_tls_endpoint_with_client_certificates(tmp_path, token_file):
    """TLS + mTLS: a client with a CA-signed certificate updates; one without is refused at the
    handshake (UNAVAILABLE)."""
    ca = ThrowawayCA()
    server, worker = ca.issue("kvplane-policy", server=True), ca.issue("operator", server=False)
    files = {}
    for name, data in (("ca", ca.cert_pem), ("cert", server.cert_pem), ("key", server.key_pem)):
        files[name] = tmp_path / f"{name}.pem"
        files[name].write_bytes(data)
    cp = EmbeddedControlPlane(synchronous=True)
    config = PolicyEndpointConfig("127.0.0.1:0", token_file=token_file, tls_cert=str(files["cert"]),
                                  tls_key=str(files["key"]), tls_ca=str(files["ca"]))
    ep = PolicyEndpoint.start(cp, config)
    assert ep is not None
    try:
        good = GrpcControlPlane(f"localhost:{ep.port}", token=TOKEN, tls=ClientTLS(
            root_certificates=ca.cert_pem, private_key=worker.key_pem, cert_chain=worker.cert_pem))
        assert good.update_policy({"alpha": 0.25}).alpha == 0.25
        good.close()
        anonymous = GrpcControlPlane(f"localhost:{ep.port}", token=TOKEN, tls=ClientTLS(root_certificates=ca.cert_pem),
                                     timeout_s=2.0)
        with pytest.raises(api.Unavailable):
            anonymous.get_policy()
        anonymous.close()
    finally:
        ep.stop()
        cp.close()


EXIT_SCRIPT = textwrap.dedent(
    """
    import sys, threading, time
    from controlplane.embedded import EmbeddedControlPlane
    from controlplane.service.client import GrpcControlPlane
    from sglang_ext import policy_endpoint
    from sglang_ext.policy_endpoint_config import PolicyEndpointConfig
    if sys.argv[1] == "no-stop":  # negative control: what the interpreter would do without it
        policy_endpoint._stop_before_thread_join = lambda stop: None
    ep = policy_endpoint.PolicyEndpoint.start(
        EmbeddedControlPlane(synchronous=True), PolicyEndpointConfig("127.0.0.1:0", allow_unauthenticated=True))
    watch = GrpcControlPlane(f"127.0.0.1:{ep.port}").watch_policy()
    threading.Thread(target=lambda: list(watch), daemon=True).start()
    time.sleep(0.5)  # the watch is open on a server thread
    print("exiting", flush=True)
    """
)


def test_an_open_watch_does_not_hold_the_process_up_at_exit():
    """A scheduler process that exits with a watch open exits at once (the endpoint stops before
    the interpreter joins gRPC's threads); without that stop it hangs (negative control)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", EXIT_SCRIPT, "stop"], capture_output=True, text=True,
                          timeout=60, env=env, cwd=REPO)
    assert done.returncode == 0 and "exiting" in done.stdout, done.stderr[-2000:]
    with pytest.raises(subprocess.TimeoutExpired):
        subprocess.run([sys.executable, "-c", EXIT_SCRIPT, "no-stop"], capture_output=True, text=True,
                       timeout=8, env=env, cwd=REPO)


# ----- kvplane policy ---------------------------------------------------------------------------


def _printed(capsys: Any) -> dict:
    """The JSON object the command printed (the in-process server's log lines share stdout)."""
    return json.loads([line for line in capsys.readouterr().out.splitlines() if line.startswith("{")][-1])


def test_kvplane_policy_get_update_watch(endpoint, token_file, capsys):
    """The documented way: ``kvplane policy update --set`` changes SLO, alpha and scheduler (exit
    0, the new policy as JSON); without ``--token-file`` it exits 1 naming UNAUTHENTICATED;
    ``kvplane policy watch --count 2`` prints the current version, then the update."""
    assert kvplane_main(["policy", "get", "--target", endpoint.target]) == 0
    assert _printed(capsys)["version"] == 1
    assert kvplane_main(["policy", "update", "--target", endpoint.target, "--set", "slo_tbt_ms=150"]) == 1
    assert "kvplane policy: UNAUTHENTICATED" in capsys.readouterr().err
    watch = subprocess.Popen(
        [sys.executable, "-m", "kvplane.cli", "policy", "watch", "--target", endpoint.target, "--count", "2"],
        stdout=subprocess.PIPE, text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        assert watch.stdout is not None
        assert json.loads(watch.stdout.readline())["version"] == 1  # the watch is open
        code = kvplane_main(["policy", "update", "--target", endpoint.target, "--token-file", token_file,
                             "--set", "slo_tbt_ms=150", "--set", "alpha=0.8", "--set", "scheduler=layerkv",
                             "--set", "lvf.alpha=2"])
        updated = _printed(capsys)
        watched = json.loads(watch.stdout.readline())
        assert watch.wait(30) == 0
    finally:
        watch.kill()
    assert code == 0 and updated == watched == endpoint.cp.get_policy().to_dict()
    assert (updated["version"], updated["slo_tbt_ms"], updated["alpha"], updated["scheduler"]) == (2, 150, 0.8, "layerkv")
    assert updated["lvf"]["alpha"] == 2


def test_kvplane_policy_bad_arguments_exit_2():
    """A malformed --set, a bad --json, nothing to change: exit status 2, no RPC."""
    assert policy_cmd.parse_changes(["slo_tbt_ms=150", "scheduler=lvf", "lvf.alpha=2"], None) == {
        "slo_tbt_ms": 150, "scheduler": "lvf", "lvf": {"alpha": 2}}
    for argv in (["--set", "alpha"], ["--json", "[1]"], []):
        assert kvplane_main(["policy", "update", "--target", "127.0.0.1:1", *argv]) == 2
