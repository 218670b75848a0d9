"""`kvplane serve` command line: argument validation, TLS wiring, metrics endpoint."""

from __future__ import annotations

import argparse
import subprocess
import urllib.request

import pytest

from controlplane.cli import serve_cmd

from .certs import ThrowawayCA
from .conftest import (
    ServeProcess,
    free_port,
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
        (["--max-message-bytes", "10"], "max_message_bytes: 10 is out of range"),
        (["--rate-limit-rps", "-1"], "rate_limit_rps: -1.0 is out of range"),
        (["--tls-cert", "/nonexistent.pem"], "--tls-cert and --tls-key must be given together"),
    ],
)
def test_bad_arguments_exit_2_naming_the_option(argv: list[str], fragment: str) -> None:
    """Out-of-range options make `kvplane serve` exit 2 with a message naming the option and range."""
    proc = subprocess.run(
        kvplane_cmd("serve", "--listen", "127.0.0.1:0", *argv),
        env=subprocess_env(), capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert fragment in proc.stderr


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
    proc = ServeProcess(free_port(), free_port(), tmp_path / "serve.log")
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
