"""`kvplane serve` command line: argument validation, TLS wiring, metrics endpoint."""

from __future__ import annotations

import argparse
import subprocess
import urllib.request

import pytest

from controlplane.cli import serve_cmd
from controlplane.service.ports import free_ports, ipv6_loopback

from .certs import ThrowawayCA
from .conftest import (
    ServeProcess,
    kvplane_cmd,
    step_report,
    subprocess_env,
    wait_until,
    worker_info,
)


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve_cmd.add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--max-sessions", "0"], "max_sessions: 0 is out of range"),
        # below 2 MiB a worker's batch of queued reports (up to 1 MiB) was refused and its stream
        # dropped (negative control: the old serve started with 1024 .. 2 MiB - 1)
        (["--max-message-bytes", "10"], "--max-message-bytes=10 is out of range [2097152, 1073741824] (2 MiB at least: workers"),
        (["--max-message-bytes", "65536"], "--max-message-bytes=65536 is out of range [2097152, 1073741824]"),
        (["--max-message-bytes", "2097151"], "--max-message-bytes=2097151 is out of range [2097152, 1073741824]"),
        (["--max-message-bytes", str((1 << 30) + 1)], "--max-message-bytes=1073741825 is out of range [2097152, 1073741824]"),
        (["--rate-limit-rps", "-1"], "rate_limit_rps: -1.0 is out of range"),
        (["--tls-cert", "/nonexistent.pem"], "--tls-cert and --tls-key must be given together"),
        (["--listen", "127.0.0.1:70000"], "--listen='127.0.0.1:70000': port 70000 is out of range [0, 65535]"),
        (["--listen", ":-5"], "--listen=':-5': port -5 is out of range [0, 65535]"),
        (["--listen", "127.0.0.1:http"], "--listen='127.0.0.1:http': port 'http' is not an integer in [0, 65535]"),
        (["--listen", "127.0.0.1"], "--listen='127.0.0.1': expected HOST:PORT"),
        (["--metrics-port", "70000"], "--metrics-port=70000 is out of range [0, 65535]"),
        (["--health-port", "-1"], "--health-port=-1 is out of range [0, 65535]"),
        (["--grace-s", "-1"], "--grace-s=-1.0 is out of range [0, 3600] (seconds)"),
        (["--grace-s", "nan"], "--grace-s=nan is out of range [0, 3600] (seconds)"),
    ],
)
def test_bad_arguments_exit_2_naming_the_option(argv: list[str], fragment: str) -> None:
    """Out-of-range options make `kvplane serve` exit 2 with one line naming the option and range."""
    proc = subprocess.run(
        kvplane_cmd("serve", "--listen", "127.0.0.1:0", *argv),
        env=subprocess_env(), capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvplane serve: ") and fragment in lines[0], proc.stderr


@pytest.mark.parametrize(
    ("listen", "grace_s"),
    [("127.0.0.1:0", 0.0), ("0.0.0.0:65535", 3600.0), ("[::]:50051", 5.0), (":50051", 0.5)],
)
def test_edge_values_are_accepted(listen: str, grace_s: float) -> None:
    """Negative control: port 0 (any free, what the tests bind), 65535, IPv6 and grace 0 / 3600 pass."""
    args = _args("--listen", listen, "--grace-s", str(grace_s), "--metrics-port", "0", "--health-port", "65535")
    config = serve_cmd.build_config(args)
    assert config.health_listen is not None and config.health_listen.endswith(":65535")


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A CA, the server's certificate and key, and a garbage PEM."""
    root = tmp_path_factory.mktemp("serve-pki")
    ca = ThrowawayCA()
    server = ca.issue("srv", server=True)
    files = {
        "ca": ca.cert_pem, "cert": server.cert_pem, "key": server.key_pem,
        "garbage": b"-----BEGIN CERTIFICATE-----\nnot base64\n-----END CERTIFICATE-----\n",
    }
    for name, data in files.items():
        (root / name).write_bytes(data)
    return {name: str(root / name) for name in files}


@pytest.mark.parametrize(
    ("cert", "key", "ca", "fragment"),
    [
        ("garbage", "key", None, "--tls-cert='{garbage}': not a PEM certificate file"),
        ("cert", "garbage", None, "--tls-key='{garbage}': not an unencrypted PEM private key"),
        ("cert", "ca", None, "--tls-key='{ca}': not an unencrypted PEM private key"),
        ("cert", "key", "garbage", "--tls-ca='{garbage}': not a PEM certificate file"),
    ],
)
def test_garbage_tls_files_are_named(pki: dict[str, str], cert: str, key: str, ca: str | None, fragment: str) -> None:
    """A garbage certificate, key or CA makes serve exit 2 naming that flag and file (was: "cannot bind")."""
    argv = ["--tls-cert", pki[cert], "--tls-key", pki[key], *(["--tls-ca", pki[ca]] if ca else [])]
    proc = subprocess.run(
        kvplane_cmd("serve", "--listen", "127.0.0.1:0", *argv),
        env=subprocess_env(), capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"kvplane serve: {fragment.format(**pki)}"), proc.stderr


def test_valid_tls_files_pass_the_checks(pki: dict[str, str]) -> None:
    """Negative control: the real certificate, its key and the CA build a TLS config."""
    config = serve_cmd.build_config(
        _args("--tls-cert", pki["cert"], "--tls-key", pki["key"], "--tls-ca", pki["ca"])
    )
    assert config.tls is not None and config.tls.client_ca is not None


@pytest.mark.parametrize(
    ("flag", "name", "content", "fragment"),
    [
        ("--policy", "policy.yaml", "slo_tbt_ms: [1\n  alpha: 2\n",
         "--policy: policy file '{path}': not valid YAML/JSON (expected ',' or ']', but got ':' at line 2, column 8)"),
        ("--policy", "policy.json", "[1, 2]", "--policy: policy file '{path}': expected an object at the top level"),
        ("--policy-token-file", "token", " \n", "--policy-token-file: token file '{path}': is empty"),
        # `openssl rand -base64 64 > token`: two lines, gRPC metadata cannot carry the newline
        # (negative control: the old reader started the server and every write then failed)
        ("--policy-token-file", "token", "A" * 64 + "\n" + "B" * 24 + "\n",
         "--policy-token-file: token file '{path}': character 65 of the token is a line break"),
    ],
)
def test_bad_policy_and_token_files_exit_2_in_one_line(tmp_path, flag, name, content, fragment) -> None:  # type: ignore[no-untyped-def]
    """A bad policy or token file is one line naming the flag, the file and the problem (a YAML
    parse error, multi-line from the parser, included)."""
    path = tmp_path / name
    path.write_text(content)
    proc = subprocess.run(
        kvplane_cmd("serve", "--listen", "127.0.0.1:0", flag, str(path)),
        env=subprocess_env(), capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"kvplane serve: {fragment.format(path=path)}"), proc.stderr


def test_bad_policy_file_exits_2_naming_field(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A policy file with an out-of-range field makes serve exit 2 naming the file and field."""
    policy = tmp_path / "policy.yaml"
    policy.write_text("alpha: -3\n")
    proc = subprocess.run(
        kvplane_cmd("serve", "--listen", "127.0.0.1:0", "--policy", str(policy)),
        env=subprocess_env(), capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2
    assert "alpha" in proc.stderr and "policy.yaml" in proc.stderr


def test_tls_files_configure_mutual_tls(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """--tls-cert/--tls-key/--tls-ca load into a TLS config that requires client certs; the token file is read."""
    ca = ThrowawayCA()
    server = ca.issue("srv", server=True)
    (tmp_path / "c.pem").write_bytes(server.cert_pem)
    (tmp_path / "k.pem").write_bytes(server.key_pem)
    (tmp_path / "ca.pem").write_bytes(ca.cert_pem)
    (tmp_path / "token").write_text("  tok-123\n")
    config = serve_cmd.build_config(
        _args(
            "--tls-cert", str(tmp_path / "c.pem"), "--tls-key", str(tmp_path / "k.pem"),
            "--tls-ca", str(tmp_path / "ca.pem"), "--policy-token-file", str(tmp_path / "token"),
        )
    )
    assert config.tls is not None and config.tls.client_ca == ca.cert_pem
    assert config.policy_token == "tok-123"


def test_metrics_endpoint_exports_service_and_controller_metrics(tmp_path, connect) -> None:  # type: ignore[no-untyped-def]
    """/metrics shows solve-time histogram, plans, pauses, sessions and decision latency."""
    proc = ServeProcess(*free_ports(2), tmp_path / "serve.log")
    proc.start()
    try:
        session = connect(proc.target).open_session(worker_info("metered"))
        assert session.wait_connected(10)
        step = 0

        def decided() -> bool:
            nonlocal step
            session.report(step_report(step, {"m1": 500, "m2": 900}))
            step += 1
            return session.stats.decisions_received > 0

        assert wait_until(decided, 20)
        assert wait_until(lambda: proc.metric("kvplane_sessions") == 1, 10)
        with urllib.request.urlopen(f"http://127.0.0.1:{proc.metrics_port}/metrics", timeout=5) as r:
            text = r.read().decode()
        for name in (
            "kvplane_solve_ms_bucket",
            "kvplane_plans_total",
            "kvplane_pauses_total",
            "kvplane_sessions",
            "kvplane_decision_latency_ms_bucket",
            "kvplane_reports_total",
            "kvplane_policy_version",
        ):
            assert name in text, name
        assert proc.metric("kvplane_solve_ms_count") >= 1
    finally:
        proc.kill()


def test_taken_metrics_and_health_ports_exit_2_naming_the_flag() -> None:
    """A taken --metrics-port (bound after the gRPC server had started: a traceback, exit 1), an
    unresolvable --metrics-host, and a --health-port on the API's own port each end in one line
    naming the flag and exit 2. Control: the same command with a free metrics port serves (it is
    stopped by the timeout)."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        busy = taken.getsockname()[1]
        api = free_ports(1)[0]
        cases = [
            (["--listen", "127.0.0.1:0", "--metrics-port", str(busy)], "--metrics-host/--metrics-port"),
            (["--listen", "127.0.0.1:0", "--metrics-host", "999.1.1.1", "--metrics-port", "0"],
             "--metrics-host/--metrics-port"),
            (["--listen", f"127.0.0.1:{api}", "--health-port", str(api)], "--health-port"),
        ]
        for argv, flag in cases:
            proc = subprocess.run(kvplane_cmd("serve", *argv), env=subprocess_env(),
                                  capture_output=True, text=True, timeout=60)
            assert proc.returncode == 2, (argv, proc.stderr[-2000:])
            assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
            ours = [ln for ln in proc.stderr.splitlines() if ln.startswith("kvplane serve: ")]
            assert len(ours) == 1 and flag in ours[0], proc.stderr[-2000:]
        with pytest.raises(subprocess.TimeoutExpired):
            subprocess.run(kvplane_cmd("serve", "--listen", "127.0.0.1:0", "--metrics-port", "0"),
                           env=subprocess_env(), capture_output=True, text=True, timeout=8)


@pytest.mark.skipif(not ipv6_loopback(), reason="no IPv6 on this host")
def test_metrics_refuse_a_port_taken_on_ipv6_alone() -> None:
    """The wildcard's dual-stack metrics bind refuses a port some IPv6-only socket holds (an IPv4
    fallback would start, and an IPv6 pod's metrics would not answer, with no error). Control: an
    explicit IPv4 host binds the same port (only IPv6 is taken)."""
    import socket

    from prometheus_client import CollectorRegistry

    holder = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
    holder.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
    holder.bind(("::", 0))
    holder.listen()
    port = holder.getsockname()[1]
    try:
        with pytest.raises(OSError):
            serve_cmd.start_metrics(port, "0.0.0.0", CollectorRegistry(), dual_stack=True)
        server = serve_cmd.start_metrics(port, "0.0.0.0", CollectorRegistry(), dual_stack=False)
        assert server.server_port == port
        server.shutdown()
        server.server_close()
    finally:
        holder.close()


def test_two_mib_message_limit_serves(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Control of the --max-message-bytes refusals: the smallest accepted limit, 2 MiB, starts a
    real server that answers its health check; the limit is twice the client's largest report
    batch, so any batch a worker sends fits."""
    from controlplane.service.client import REPORT_BATCH_MAX_BYTES
    from controlplane.service.server import MIN_SERVE_MESSAGE_BYTES

    assert MIN_SERVE_MESSAGE_BYTES == 2097152 and MIN_SERVE_MESSAGE_BYTES >= 2 * REPORT_BATCH_MAX_BYTES
    assert serve_cmd.build_config(_args("--max-message-bytes", "2097152")).max_message_bytes == 2097152
    proc = ServeProcess(*free_ports(2), tmp_path / "serve.log", "--max-message-bytes", "2097152")
    proc.start(timeout_s=60.0)  # fails unless it turns healthy
    proc.kill()
