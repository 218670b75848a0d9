"""The gRPC server: ``create_server(address, control_plane) -> (server, port)``.

Hosts ``kvplane.v1.ControlPlane`` and ``kvplane.v1.PolicyService`` over any
:class:`api.ControlPlane`, plus the standard ``grpc.health.v1`` health service and server
reflection. Limits (message size, sessions, watchers, request rate) each fail with
RESOURCE_EXHAUSTED naming the limit. :func:`create_server` binds but does not start, so tests can
bind port 0; ``kvplane serve`` (``controlplane/cli/serve_cmd.py``) adds signals and metrics HTTP.
"""

from __future__ import annotations

from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from controlplane import api
from controlplane.service.decision_notifier import DecisionNotifier
from controlplane.service.interceptors import (
    AuthInterceptor,
    ErrorMappingInterceptor,
    RateLimitInterceptor,
)
from controlplane.service.lock_safe_health_servicer import LockSafeHealthServicer
from controlplane.service.metrics import ServiceMetrics
from controlplane.service.policy_servicer import PolicyServicer
from controlplane.service.session_servicer import SessionServicer
from kvplane.v1 import controlplane_pb2 as pb
from kvplane.v1 import controlplane_pb2_grpc as pb_grpc

log = structlog.get_logger(__name__)

SERVICE_NAMES = tuple(s.full_name for s in pb.DESCRIPTOR.services_by_name.values())
"""Fully qualified names of the kvplane services (``kvplane.v1.ControlPlane``, ...)."""
POLICY_SERVICE_NAME = pb.DESCRIPTOR.services_by_name["PolicyService"].full_name
"""``kvplane.v1.PolicyService``: all a policy-only server hosts (``create_server(sessions=False)``)."""
WRITE_METHODS = frozenset({"/kvplane.v1.PolicyService/UpdatePolicy"})
"""Methods that need the bearer token when one is configured."""


@dataclass(frozen=True)
class TLSConfig:
    """Server TLS material (PEM bytes). With ``client_ca`` the server requires client certs (mTLS)."""

    cert_chain: bytes
    """Server certificate chain."""
    private_key: bytes
    """Server private key."""
    client_ca: bytes | None = None
    """CA that signs worker certificates; set = mutual TLS (client certificate required)."""

    @classmethod
    def from_files(cls, cert: str | Path, key: str | Path, ca: str | Path | None = None) -> TLSConfig:
        return cls(
            cert_chain=Path(cert).read_bytes(),
            private_key=Path(key).read_bytes(),
            client_ca=Path(ca).read_bytes() if ca else None,
        )

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(self.private_key, self.cert_chain)],
            root_certificates=self.client_ca,
            require_client_auth=self.client_ca is not None,
        )


MIN_SERVE_MESSAGE_BYTES = 2 << 20
"""Smallest ``kvplane serve --max-message-bytes`` (and chart ``server.maxMessageBytes``): a
worker batches its queued reports into one message of up to ``REPORT_BATCH_MAX_BYTES`` (1 MiB,
:mod:`controlplane.service.client`) without knowing the server's limit; a lower limit refuses such
a batch with RESOURCE_EXHAUSTED and drops the worker's stream under load. Twice the batch leaves
room for a batch's last report and framing."""


@dataclass(frozen=True)
class ServerConfig:
    """Limits and security of one server."""

    max_sessions: int = 256
    """Concurrent worker sessions; one more gets RESOURCE_EXHAUSTED (max_sessions)."""
    max_watchers: int = 32
    """Concurrent WatchPolicy streams."""
    unary_workers: int = 8
    """Threads reserved for unary calls, health and reflection."""
    max_message_bytes: int = 4 * 1024 * 1024
    """Largest accepted (and sent) message; larger ones get RESOURCE_EXHAUSTED from gRPC. Below
    :data:`MIN_SERVE_MESSAGE_BYTES` workers' report batches can be refused: ``kvplane serve`` and
    the chart refuse such a limit; lower values (down to 1024) are for tests of the limit itself."""
    rate_limit_rps: float = 0.0
    """RPC calls per second per client host (0 = unlimited)."""
    policy_token: str | None = None
    """Bearer token required for UpdatePolicy (None = writes open)."""
    tls: TLSConfig | None = None
    """TLS / mTLS; None = plaintext (loopback or a trusted network only)."""
    keepalive_s: float = 10.0
    """Ping idle connections this often to notice vanished workers."""
    health_listen: str | None = None
    """Extra plaintext ``HOST:PORT`` serving only grpc.health.v1 (for kubelet gRPC probes, which
    cannot do TLS); None = health only on the main port."""
    hello_timeout_s: float = 10.0
    """Seconds a new session stream has to send its hello before it is cancelled (its slot freed)."""

    def __post_init__(self) -> None:
        for name, lo, hi in (
            ("max_sessions", 1, 100_000),
            ("max_watchers", 1, 10_000),
            ("unary_workers", 1, 1024),
            ("max_message_bytes", 1024, 1 << 30),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
                raise ValueError(f"{name}: {value!r} is out of range (allowed [{lo}, {hi}])")
        if not 0.0 <= self.rate_limit_rps <= 1e7:
            raise ValueError(f"rate_limit_rps: {self.rate_limit_rps} is out of range (allowed [0, 1e7])")
        if not 0.1 <= self.keepalive_s <= 3600:
            raise ValueError(f"keepalive_s: {self.keepalive_s} is out of range (allowed [0.1, 3600])")
        if not 0.1 <= self.hello_timeout_s <= 3600:
            raise ValueError(f"hello_timeout_s: {self.hello_timeout_s} is out of range (allowed [0.1, 3600])")
        if self.policy_token is not None and not self.policy_token.strip():
            raise ValueError("policy_token: must not be empty (use None for no token)")

    @property
    def threads(self) -> int:
        """Server pool size: every session and watch gets a pool thread, unary calls keep theirs.

        (Each session also runs one reader thread of its own outside the pool.)"""
        return self.max_sessions + self.max_watchers + self.unary_workers


class ControlPlaneServer:
    """A bound (not yet started) gRPC server over a control plane."""

    def __init__(
        self,
        grpc_server: grpc.Server,
        port: int,
        health_servicer: LockSafeHealthServicer,
        policy_servicer: PolicyServicer,
        metrics: ServiceMetrics,
        health_server: grpc.Server | None = None,
        health_port: int | None = None,
        service_names: tuple[str, ...] = SERVICE_NAMES,
    ) -> None:
        self.grpc_server = grpc_server
        self.port = port
        self.health = health_servicer
        self.metrics = metrics
        self._policy = policy_servicer
        self._health_server = health_server
        self.health_port = health_port
        """Bound port of the plaintext health-only listener, if configured."""
        self.service_names = service_names
        """The kvplane services this server hosts (health reports each of them)."""

    def start(self) -> None:
        self.grpc_server.start()
        if self._health_server is not None:
            self._health_server.start()
        for name in ("", *self.service_names):
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info("server_started", port=self.port)

    def stop(self, grace_s: float | None = 5.0) -> None:
        """Graceful stop: report NOT_SERVING, end watches, let in-flight RPCs finish for grace_s."""
        self.health.enter_graceful_shutdown()
        self._policy.stop()
        self.grpc_server.stop(grace_s).wait()
        if self._health_server is not None:
            self._health_server.stop(0).wait()
        log.info("server_stopped", port=self.port)

    def wait_for_termination(self, timeout_s: float | None = None) -> bool:
        return bool(self.grpc_server.wait_for_termination(timeout_s))


def create_server(
    address: str,
    control_plane: api.ControlPlane,
    config: ServerConfig | None = None,
    metrics: ServiceMetrics | None = None,
    notifier: DecisionNotifier | None = None,
    *,
    sessions: bool = True,
) -> tuple[ControlPlaneServer, int]:
    """Bind ``address`` (``host:port``; port 0 picks a free one). Returns (server, bound port).

    ``notifier``: the :class:`DecisionNotifier` given to the control plane's observer, so
    decisions planned between reports are pushed at once (without it they ride the next report).
    ``sessions=False`` hosts only ``PolicyService`` (with health and reflection): the live policy
    of a control plane whose workers are in-process (the plugin's ``--kv-policy-listen``).
    Raises RuntimeError naming the address when it cannot be bound.
    """
    config = config or ServerConfig()
    metrics = metrics or ServiceMetrics()
    options = [
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.so_reuseport", 0),
        ("grpc.keepalive_time_ms", int(config.keepalive_s * 1000)),
        ("grpc.keepalive_timeout_ms", 5000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", 1000),
        ("grpc.http2.max_pings_without_data", 0),
        # A small, fixed receive window: a worker that outpaces the server is pushed back at
        # once, its reports queue on its side and go out as ReportBatches (adaptive batching)
        # instead of piling up seconds of backlog in transport buffers.
        ("grpc.http2.lookahead_bytes", 16 * 1024),
        ("grpc.http2.bdp_probe", 0),
    ]
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=config.threads, thread_name_prefix="kvplane-rpc"),
        interceptors=[
            ErrorMappingInterceptor(metrics, reflection_streams=max(1, config.unary_workers // 4)),
            RateLimitInterceptor(config.rate_limit_rps, metrics),
            AuthInterceptor(config.policy_token, WRITE_METHODS),
        ],
        options=options,
        maximum_concurrent_rpcs=config.threads,
    )
    service_names = SERVICE_NAMES if sessions else (POLICY_SERVICE_NAME,)
    if sessions:
        session_servicer = SessionServicer(control_plane, metrics, config.max_sessions, notifier,
                                           hello_timeout_s=config.hello_timeout_s,
                                           max_message_bytes=config.max_message_bytes)
        pb_grpc.add_ControlPlaneServicer_to_server(session_servicer, server)
    policy_servicer = PolicyServicer(control_plane, metrics, config.max_watchers)
    pb_grpc.add_PolicyServiceServicer_to_server(policy_servicer, server)
    health_servicer = LockSafeHealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    try:
        if config.tls is not None:
            port = server.add_secure_port(address, config.tls.credentials())
        else:
            port = server.add_insecure_port(address)
    except RuntimeError as exc:
        raise RuntimeError(f"cannot bind {address}: {exc}") from exc
    if port == 0:
        raise RuntimeError(f"cannot bind {address} (address in use or invalid)")
    health_server, health_port = None, None
    if config.health_listen:
        health_server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvplane-health"),
            options=[("grpc.so_reuseport", 0), ("grpc.max_receive_message_length", 4096)],
            maximum_concurrent_rpcs=8,
        )
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, health_server)
        try:
            health_port = health_server.add_insecure_port(config.health_listen)
        except RuntimeError as exc:
            raise RuntimeError(f"--health-port: cannot bind {config.health_listen}: {exc}") from exc
        if health_port == 0:
            raise RuntimeError(f"--health-port: cannot bind {config.health_listen}")
    return (
        ControlPlaneServer(
            server, port, health_servicer, policy_servicer, metrics, health_server, health_port,
            service_names,
        ),
        port,
    )
