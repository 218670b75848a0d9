"""`kvplane serve`: run the control-plane gRPC service over an embedded control plane.

Logs are structlog JSON lines on stdout; the first ``server_started`` event carries the bound
``port`` (useful with ``--listen HOST:0``) and the metrics port. SIGTERM / SIGINT stop the server
gracefully (health turns NOT_SERVING, in-flight RPCs get ``--grace-s`` seconds).
"""

from __future__ import annotations

import argparse
import logging
import math
import re
import signal
import sys
import threading
from pathlib import Path
from typing import Any

import structlog

from controlplane.api import InvalidArgument
from controlplane.controller import ControllerObserver, FanOutObserver, PrometheusObserver
from controlplane.embedded import EmbeddedControlPlane
from controlplane.model import SchemaError
from controlplane.policy import Policy
from controlplane.policy_store import PolicyStore, load_policy_file, load_token_file
from controlplane.service.decision_notifier import DecisionNotifier
from controlplane.service.metrics import ServiceMetrics
from controlplane.service.pem_files import (
    certificate_validity,
    check_ca_dates,
    check_key_pair,
)
from controlplane.service.server import (
    MIN_SERVE_MESSAGE_BYTES,
    ServerConfig,
    TLSConfig,
    create_server,
)

log = structlog.get_logger(__name__)

_DEFAULTS = ServerConfig()
MAX_PORT = 65535
MAX_GRACE_S = 3600.0
"""Longest ``--grace-s`` (the Helm chart's ``server.graceSeconds`` allows (0, 3600])."""
CERT_EXPIRY_WARNING_S = 7 * 86400.0
"""A server certificate expiring sooner than this after start is logged as a warning."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--listen", default="127.0.0.1:50051", help="HOST:PORT to serve gRPC on (port 0 = any free)")
    parser.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus metrics on this port (0 = any free)")
    parser.add_argument("--metrics-host", default=None, help="metrics bind address (default: the --listen host)")
    parser.add_argument("--health-port", type=int, default=None, help="also serve grpc.health.v1 in plaintext on this port (kubelet probes under TLS)")
    parser.add_argument("--policy", type=Path, default=None, help="initial policy, JSON or YAML (partial; missing fields take defaults)")
    parser.add_argument("--policy-token-file", type=Path, default=None, help="file holding the bearer token required for policy updates")
    parser.add_argument("--tls-cert", type=Path, default=None, help="server certificate chain (PEM)")
    parser.add_argument("--tls-key", type=Path, default=None, help="server private key (PEM)")
    parser.add_argument("--tls-ca", type=Path, default=None, help="CA for worker certificates: enables mutual TLS")
    parser.add_argument("--max-sessions", type=int, default=_DEFAULTS.max_sessions, help="concurrent worker sessions")
    parser.add_argument("--max-watchers", type=int, default=_DEFAULTS.max_watchers, help="concurrent policy watches")
    parser.add_argument("--max-message-bytes", type=int, default=_DEFAULTS.max_message_bytes, help="largest accepted message")
    parser.add_argument("--rate-limit-rps", type=float, default=_DEFAULTS.rate_limit_rps, help="RPC calls per second per client host (0 = unlimited)")
    parser.add_argument("--grace-s", type=float, default=5.0, help=f"graceful-stop grace period in seconds, [0, {MAX_GRACE_S:g}]")
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))


def configure_logging(level: str) -> None:
    """structlog JSON lines on stdout (one event per line)."""
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(default=str),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper())),
        logger_factory=structlog.PrintLoggerFactory(sys.stdout),
        cache_logger_on_first_use=True,
    )


def check_port(flag: str, port: int | None) -> None:
    """``port`` (when given) is a TCP port in [0, 65535], 0 meaning any free one."""
    if port is not None and not 0 <= port <= MAX_PORT:
        raise ValueError(f"{flag}={port} is out of range [0, {MAX_PORT}]")


def check_listen(listen: str) -> None:
    """``--listen`` is HOST:PORT with PORT an integer in [0, 65535] (gRPC would wrap 70000 to 4464)."""
    _host, sep, port = listen.rpartition(":")
    if not sep:
        raise ValueError(f"--listen={listen!r}: expected HOST:PORT (e.g. 0.0.0.0:50051, [::]:50051)")
    if not re.fullmatch(r"-?[0-9]+", port):
        raise ValueError(f"--listen={listen!r}: port {port!r} is not an integer in [0, {MAX_PORT}]")
    if not 0 <= int(port) <= MAX_PORT:
        raise ValueError(f"--listen={listen!r}: port {int(port)} is out of range [0, {MAX_PORT}]")


MAX_MESSAGE_BYTES = 1 << 30
"""Largest ``--max-message-bytes`` (ServerConfig's bound)."""


def check_message_bytes(value: int) -> None:
    """``--max-message-bytes`` in [2 MiB, 1 GiB]: workers batch queued reports into messages of up
    to 1 MiB without knowing the server's limit, and a lower limit drops their streams under load."""
    if not MIN_SERVE_MESSAGE_BYTES <= value <= MAX_MESSAGE_BYTES:
        raise ValueError(
            f"--max-message-bytes={value} is out of range [{MIN_SERVE_MESSAGE_BYTES}, {MAX_MESSAGE_BYTES}] "
            f"(2 MiB at least: workers send queued reports in batches of up to 1 MiB, which a lower "
            f"limit refuses with RESOURCE_EXHAUSTED, dropping their streams under load)"
        )


def check_grace(grace_s: float) -> None:
    """``--grace-s`` in [0, 3600] seconds."""
    if not math.isfinite(grace_s) or not 0.0 <= grace_s <= MAX_GRACE_S:
        raise ValueError(f"--grace-s={grace_s!r} is out of range [0, {MAX_GRACE_S:g}] (seconds)")


def build_config(args: argparse.Namespace) -> ServerConfig:
    """The server's config from the command line; ValueError naming the flag of a bad value."""
    check_listen(args.listen)
    check_port("--metrics-port", args.metrics_port)
    check_port("--health-port", args.health_port)
    check_grace(args.grace_s)
    check_message_bytes(args.max_message_bytes)
    tls = None
    if args.tls_cert or args.tls_key or args.tls_ca:
        if not (args.tls_cert and args.tls_key):
            raise ValueError("--tls-cert and --tls-key must be given together (and --tls-ca needs both)")
        check_key_pair("--tls-cert", args.tls_cert, "--tls-key", args.tls_key)
        if args.tls_ca:
            check_ca_dates("--tls-ca", args.tls_ca)
        tls = TLSConfig.from_files(args.tls_cert, args.tls_key, args.tls_ca)
    token = None
    if args.policy_token_file:
        try:
            token = load_token_file(args.policy_token_file)
        except InvalidArgument as exc:
            raise ValueError(f"--policy-token-file: {exc}") from None
    return ServerConfig(
        max_sessions=args.max_sessions,
        max_watchers=args.max_watchers,
        max_message_bytes=args.max_message_bytes,
        rate_limit_rps=args.rate_limit_rps,
        policy_token=token,
        tls=tls,
        health_listen=(
            f"{args.listen.rpartition(':')[0]}:{args.health_port}" if args.health_port is not None else None
        ),
    )


def report_certificate(cert: str | Path, metrics: ServiceMetrics, now: float | None = None) -> None:
    """Log the server certificate's notAfter (a warning when it is less than
    :data:`CERT_EXPIRY_WARNING_S` away) and export it as ``kvplane_tls_cert_not_after_seconds``.
    Read once: a renewed certificate takes effect (and is reported) on the next start."""
    import time

    _not_before, not_after = certificate_validity("--tls-cert", cert, now)
    now = time.time() if now is None else now
    metrics.tls_cert_not_after.set(not_after)
    fields: dict[str, Any] = {
        "tls_cert": str(cert),
        "not_after": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(not_after)),
        "expires_in_days": round((not_after - now) / 86400.0, 2),
    }
    if not_after - now < CERT_EXPIRY_WARNING_S:
        log.warning("tls_certificate_expires_soon", **fields, renew="replace the Secret and restart the pods")
    else:
        log.info("tls_certificate", **fields)


def start_metrics(port: int, host: str, registry: Any, *, dual_stack: bool) -> Any:
    """The Prometheus endpoint on ``host:port``; returns its HTTP server (``OSError`` when it cannot
    bind). With ``dual_stack`` (the host follows ``--listen``), the IPv4 wildcard ``0.0.0.0`` binds
    as gRPC binds it: ``::`` taking IPv4 too, so an IPv6-only or dual-stack pod's metrics answer
    on its IPv6 address; ``0.0.0.0`` alone where the host has no IPv6 or binds ``::`` IPv6-only
    (``net.ipv6.bindv6only``). An explicit ``--metrics-host`` is bound as given."""
    import errno
    import socket

    from prometheus_client import start_http_server

    if dual_stack and host == "0.0.0.0" and socket.has_ipv6:
        try:
            http_server, _thread = start_http_server(port, addr="::", registry=registry)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:  # taken, if only on IPv6: IPv4 alone would leave an
                raise  # IPv6 pod's metrics unanswered with no error
            # no IPv6 here: IPv4 alone
        else:
            if not http_server.socket.getsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY):
                return http_server
            http_server.shutdown()
            http_server.server_close()
    http_server, _thread = start_http_server(port, addr=host, registry=registry)
    return http_server


def build_control_plane(
    policy: Policy | None, token: str | None, metrics: ServiceMetrics | None = None
) -> tuple[EmbeddedControlPlane, DecisionNotifier]:
    """The embedded control plane the service fronts, and the notifier to give create_server.

    With ``metrics``, the controller's Prometheus observer (plans, pauses, triggers) is registered
    on the service's registry so one /metrics endpoint shows both.
    """
    notifier = DecisionNotifier()
    observers: list[ControllerObserver] = [notifier]
    if metrics is not None:
        observers.append(PrometheusObserver(metrics.registry))
    control_plane = EmbeddedControlPlane(
        PolicyStore(policy, token=token), observer=FanOutObserver(observers)
    )
    return control_plane, notifier


def run(args: argparse.Namespace) -> int:
    configure_logging(args.log_level)
    try:
        config = build_config(args)
        policy = load_policy_file(args.policy) if args.policy else None
    except InvalidArgument as exc:  # only the policy file's (build_config names its flags)
        print(f"kvplane serve: --policy: {exc}", file=sys.stderr)
        return 2
    except (OSError, ValueError, SchemaError) as exc:
        print(f"kvplane serve: {exc}", file=sys.stderr)
        return 2
    metrics = ServiceMetrics()
    if config.tls is not None:
        try:
            report_certificate(args.tls_cert, metrics)
        except ValueError as exc:  # expired since build_config checked it (a second ago)
            print(f"kvplane serve: {exc}", file=sys.stderr)
            return 2
    control_plane, notifier = build_control_plane(policy, config.policy_token, metrics)
    try:
        server, port = create_server(args.listen, control_plane, config, metrics, notifier)
    except RuntimeError as exc:
        print(f"kvplane serve: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()

    def on_signal(signum: int, _frame: Any) -> None:
        log.info("signal_received", signal=signal.Signals(signum).name)
        stop.set()

    metrics_port = None
    if args.metrics_port is not None:  # bound before serving: a taken port refuses the start
        host = args.metrics_host or args.listen.rpartition(":")[0].strip("[]") or "0.0.0.0"
        try:
            http_server = start_metrics(
                args.metrics_port, host, server.metrics.registry, dual_stack=args.metrics_host is None
            )
        except OSError as exc:  # a taken port, an unresolvable --metrics-host
            server.stop(0)
            print(
                f"kvplane serve: --metrics-host/--metrics-port: cannot serve metrics on "
                f"{host}:{args.metrics_port}: {exc}",
                file=sys.stderr,
            )
            return 2
        metrics_port = http_server.server_port
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    server.start()
    log.info(
        "serving",
        listen=args.listen,
        port=port,
        metrics_port=metrics_port,
        health_port=server.health_port,
        tls=config.tls is not None,
        mtls=config.tls is not None and config.tls.client_ca is not None,
        policy_token=config.policy_token is not None,
        max_sessions=config.max_sessions,
    )
    sys.stdout.flush()
    while not stop.wait(1.0):
        pass
    server.stop(args.grace_s)
    close = getattr(control_plane, "close", None)
    if callable(close):
        close()
    return 0
