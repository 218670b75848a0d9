"""Security: mutual TLS for sessions, the caller's identity in the audit log, rate limits."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from structlog.testing import capture_logs

from controlplane import api
from controlplane.service import convert
from controlplane.service.client import ClientTLS
from controlplane.service.server import ServerConfig, TLSConfig
from kvplane.v1 import controlplane_pb2 as pb
from kvplane.v1 import controlplane_pb2_grpc as pb_grpc

from .certs import ThrowawayCA
from .conftest import TOKEN, step_report, wait_until, worker_info


@pytest.fixture(scope="module")
def pki():  # type: ignore[no-untyped-def]
    ca = ThrowawayCA()
    return {
        "ca": ca,
        "server": ca.issue("kvplane-controlplane", server=True),
        "worker": ca.issue("worker-7", server=False),
        "rogue_ca": ThrowawayCA("rogue-ca"),
    }


@pytest.fixture
def mtls_server(serve, pki):  # type: ignore[no-untyped-def]
    tls = TLSConfig(
        cert_chain=pki["server"].cert_pem,
        private_key=pki["server"].key_pem,
        client_ca=pki["ca"].cert_pem,
    )
    return serve(ServerConfig(max_sessions=4, max_watchers=1, tls=tls, policy_token=TOKEN))


def _worker_session(mtls_server, connect, pki, worker_id: str):  # type: ignore[no-untyped-def]
    """A client with the worker's certificate (cn=worker-7) and its session, connected."""
    tls = ClientTLS(
        root_certificates=pki["ca"].cert_pem,
        private_key=pki["worker"].key_pem,
        cert_chain=pki["worker"].cert_pem,
    )
    client = connect(f"localhost:{mtls_server.port}", tls=tls, token=TOKEN)
    session = client.open_session(worker_info(worker_id))
    assert session.wait_connected(10)
    return client, session


def test_mtls_worker_with_cert_streams_and_is_audited_by_cn(mtls_server, connect, pki) -> None:  # type: ignore[no-untyped-def]
    """A worker presenting a CA-signed cert gets a session; its policy writes are audited as cn=worker-7."""
    client, session = _worker_session(mtls_server, connect, pki, "tls-worker")
    session.report(step_report(0, {"r": 300}))
    assert wait_until(lambda: session.stats.decisions_received >= 1, 10)
    with capture_logs() as logs:
        client.update_policy({"alpha": 0.7})
    audit = [e for e in logs if e["event"] == "policy_audit"]
    assert audit and audit[0]["actor"] == "cn=worker-7"


def test_mtls_client_without_cert_is_rejected(mtls_server, pki) -> None:  # type: ignore[no-untyped-def]
    """A TLS client without a certificate cannot complete the handshake (no RPC succeeds)."""
    creds = grpc.ssl_channel_credentials(root_certificates=pki["ca"].cert_pem)
    with grpc.secure_channel(f"localhost:{mtls_server.port}", creds) as ch:
        with pytest.raises(grpc.RpcError) as info:
            pb_grpc.PolicyServiceStub(ch).GetPolicy(pb.GetPolicyRequest(), timeout=5)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_mtls_client_with_foreign_cert_is_rejected(mtls_server, pki) -> None:  # type: ignore[no-untyped-def]
    """A client cert signed by another CA is rejected."""
    rogue = pki["rogue_ca"].issue("intruder", server=False)
    creds = grpc.ssl_channel_credentials(
        root_certificates=pki["ca"].cert_pem, private_key=rogue.key_pem, certificate_chain=rogue.cert_pem
    )
    with grpc.secure_channel(f"localhost:{mtls_server.port}", creds) as ch:
        with pytest.raises(grpc.RpcError) as info:
            pb_grpc.PolicyServiceStub(ch).GetPolicy(pb.GetPolicyRequest(), timeout=5)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_plaintext_client_cannot_talk_to_tls_server(mtls_server) -> None:  # type: ignore[no-untyped-def]
    """A plaintext client gets no answer from a TLS server."""
    with grpc.insecure_channel(f"127.0.0.1:{mtls_server.port}") as ch:
        with pytest.raises(grpc.RpcError) as info:
            pb_grpc.PolicyServiceStub(ch).GetPolicy(pb.GetPolicyRequest(), timeout=3)
    assert info.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def test_rate_limit_exceeded_names_the_limit(serve, connect) -> None:  # type: ignore[no-untyped-def]
    """Beyond rate_limit_rps a client's calls get RESOURCE_EXHAUSTED naming rate_limit_rps; health stays exempt."""
    s = serve(ServerConfig(max_sessions=2, max_watchers=1, rate_limit_rps=5))
    client = connect(s.target)
    outcomes = []
    t0 = time.monotonic()
    for _ in range(30):
        try:
            client.get_policy()
            outcomes.append("ok")
        except api.ResourceExhausted as exc:
            assert "rate_limit_rps" in str(exc)
            outcomes.append("limited")
    elapsed = time.monotonic() - t0
    # The bucket holds a burst of rate_limit_rps and refills at that rate: however slow the host
    # made the loop, no more calls pass than that budget.
    allowed = 5 + 5 * elapsed + 1
    assert 1 <= outcomes.count("ok") <= allowed, (outcomes, elapsed)
    limited = outcomes.count("limited")
    assert limited >= 30 - allowed and limited >= 1
    assert client.health() == "SERVING"
    assert s.metric("kvplane_rejected_total", {"limit": "rate_limit_rps"}) == limited


def test_plaintext_health_port_under_mtls(serve, pki) -> None:  # type: ignore[no-untyped-def]
    """With health_listen, probes get SERVING in plaintext while the API itself still requires mTLS."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    tls = TLSConfig(pki["server"].cert_pem, pki["server"].key_pem, pki["ca"].cert_pem)
    s = serve(ServerConfig(max_sessions=2, max_watchers=1, tls=tls, health_listen="127.0.0.1:0"))
    assert s.server.health_port
    with grpc.insecure_channel(f"127.0.0.1:{s.server.health_port}") as ch:
        got = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert got.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as info:
            pb_grpc.PolicyServiceStub(ch).GetPolicy(pb.GetPolicyRequest(), timeout=5)
        assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED  # only health is exposed there


def _tls_channel(port: int, pair, pki) -> grpc.Channel:  # type: ignore[no-untyped-def]
    creds = grpc.ssl_channel_credentials(
        root_certificates=pki["ca"].cert_pem, private_key=pair.key_pem, certificate_chain=pair.cert_pem
    )
    return grpc.secure_channel(f"localhost:{port}", creds)


def _refused(port: int, pair, pki, hello, holder: str, timeout: float = 5) -> None:  # type: ignore[no-untyped-def]
    """A hello from the certificate ``pair`` is refused: PERMISSION_DENIED naming ``holder``."""
    with _tls_channel(port, pair, pki) as ch:
        with pytest.raises(grpc.RpcError) as info:
            list(pb_grpc.ControlPlaneStub(ch).Session(iter([hello]), timeout=timeout))
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED, info.value
    assert holder in info.value.details()


def test_a_worker_id_belongs_to_the_certificate_holding_its_session(mtls_server, connect, pki) -> None:  # type: ignore[no-untyped-def]
    """Under mTLS another client certificate cannot take a live worker id over (before, its hello
    closed the worker's session and the two flapped): PERMISSION_DENIED naming the holder, and
    the worker keeps streaming. Control: the same certificate (the worker restarted) still
    replaces its own session."""
    _, session = _worker_session(mtls_server, connect, pki, "w-shared")
    hello = pb.WorkerMessage(hello=convert.worker_info_to_proto(worker_info("w-shared")))
    _refused(mtls_server.port, pki["ca"].issue("worker-8", server=False), pki, hello, "cn=worker-7")
    session.report(step_report(0, {"r": 300}))
    assert wait_until(lambda: session.stats.decisions_received >= 1, 10)
    assert session.stats.reconnects == 0
    with _tls_channel(mtls_server.port, pki["worker"], pki) as ch:
        first = next(pb_grpc.ControlPlaneStub(ch).Session(iter([hello]), timeout=5))
    assert first.session_id


def test_certificates_without_a_cn_are_told_apart_by_their_san(mtls_server, pki) -> None:  # type: ignore[no-untyped-def]
    """SAN-only client certificates (SPIFFE, cert-manager) all had the identity ``"cn="`` (gRPC
    reports an empty CN), so one could take another's live worker id (control-plane review,
    session 54): now their SAN is the identity -- PERMISSION_DENIED naming the holder's SAN.
    Control: the holder's own certificate still replaces its session."""
    holder = pki["ca"].issue_san_only("spiffe://kvplane.test/worker-w1")
    other = pki["ca"].issue_san_only("spiffe://kvplane.test/attacker")
    hello = pb.WorkerMessage(hello=convert.worker_info_to_proto(worker_info("w-san")))
    done = threading.Event()

    def holding():  # type: ignore[no-untyped-def]  # the holder's stream stays open until the end
        yield hello
        done.wait(30)

    with _tls_channel(mtls_server.port, holder, pki) as ch:
        held = pb_grpc.ControlPlaneStub(ch).Session(holding())
        assert next(held).session_id
        _refused(mtls_server.port, other, pki, hello, "san=spiffe://kvplane.test/worker-w1")
        done.set()
        held.cancel()
    with _tls_channel(mtls_server.port, holder, pki) as ch:
        assert next(pb_grpc.ControlPlaneStub(ch).Session(iter([hello]), timeout=5)).session_id


def test_two_certificates_saying_hello_for_one_worker_id_at_once_cannot_both_hold_it(mtls_server, pki) -> None:  # type: ignore[no-untyped-def]
    """The claim of a worker id and its session's opening are one step: while the holder's hello
    is inside the control plane's ``open_session``, another certificate's hello for the same id
    waits, then finds the id held: PERMISSION_DENIED. Before, both passed the claim (the id was
    not yet owned) and the later one took the id over. The holder's ``open_session`` waits up to
    2 s for a second call: one arriving while it is inside is the race itself (it fails below)."""
    cp = mtls_server.control_plane
    real_open = cp.open_session
    inside = threading.Event()
    second = threading.Event()
    calls: list[str] = []

    def open_session(info):  # type: ignore[no-untyped-def]
        calls.append(info.worker_id)
        if len(calls) == 1:
            inside.set()
            second.wait(2.0)  # the race window, held open
        else:
            second.set()
        return real_open(info)

    cp.open_session = open_session
    hello = pb.WorkerMessage(hello=convert.worker_info_to_proto(worker_info("w-race")))
    done = threading.Event()
    first_reply: list[object] = []

    def holding():  # type: ignore[no-untyped-def]
        yield hello
        done.wait(30)

    def holder() -> None:
        with _tls_channel(mtls_server.port, pki["worker"], pki) as ch:
            stream = pb_grpc.ControlPlaneStub(ch).Session(holding())
            first_reply.append(next(stream))
            done.wait(30)
            stream.cancel()

    t = threading.Thread(target=holder, daemon=True)
    t.start()
    try:
        assert inside.wait(10)
        _refused(mtls_server.port, pki["ca"].issue("worker-9", server=False), pki, hello, "cn=worker-7", 10)
        assert calls == ["w-race"] and not second.is_set()  # the intruder never opened a session
        assert wait_until(lambda: bool(first_reply), 10)
    finally:
        done.set()
        t.join(10)
