"""Prometheus metrics of the control-plane service and of its gRPC client.

Each server (and each client) owns its own :class:`CollectorRegistry`: no process-global state, so
tests can run several servers in one process. ``kvplane serve --metrics-port`` exposes the
server's registry over HTTP.

Server metrics:

* ``kvplane_solve_ms`` (histogram): planner solve time of every plan the service hands out
  (decisions and what-if plans).
* ``kvplane_whatif_plans_total``: plans served by the Plan RPC.
* ``kvplane_sessions`` (gauge): open worker sessions.
* ``kvplane_decision_latency_ms`` (histogram): server-side time from receiving a report to
  handing the decisions it produced to gRPC.
* ``kvplane_decisions_total``, ``kvplane_reports_total``, ``kvplane_rpc_errors_total{method,code}``,
  ``kvplane_rejected_total{limit}``, ``kvplane_policy_version`` (gauge).
* ``kvplane_tls_cert_not_after_seconds`` (gauge): Unix time the server certificate (``--tls-cert``)
  expires, as read at start (0 without TLS; a renewed certificate needs a restart).

``kvplane_plans_total{feasible}``, ``kvplane_pauses_total``, ``kvplane_resumes_total``,
``kvplane_controller_triggers_total{reason}`` and ``kvplane_plan_solve_seconds`` come from the
controller's :class:`~controlplane.controller.PrometheusObserver`, which ``kvplane serve``
registers on the same registry (see :func:`controlplane.cli.serve_cmd.build_control_plane`).

Client metrics: ``kvplane_client_degraded{worker}`` (1 while a session has no live stream and the
worker runs on its last plan) and ``kvplane_client_reconnects_total{worker}``.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_MS_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 1000.0, 5000.0)


class ServiceMetrics:
    """The server's metrics, registered in ``registry`` (a fresh one by default)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.solve_ms = Histogram(
            "kvplane_solve_ms", "Planner solve time per plan (ms)", buckets=_MS_BUCKETS, registry=r
        )
        self.whatif_plans = Counter(
            "kvplane_whatif_plans", "What-if plans served by the Plan RPC", registry=r
        )
        self.sessions = Gauge("kvplane_sessions", "Open worker sessions", registry=r)
        self.replaced = Counter(
            "kvplane_sessions_replaced",
            "Hellos that replaced a live session of the same worker id (a reconnect, or two workers "
            "sharing one id when it keeps rising)",
            registry=r,
        )
        self.decision_latency_ms = Histogram(
            "kvplane_decision_latency_ms",
            "Server time from a report's arrival to sending its decisions (ms)",
            buckets=_MS_BUCKETS,
            registry=r,
        )
        self.decisions = Counter("kvplane_decisions", "Decisions sent to workers", registry=r)
        self.reports = Counter("kvplane_reports", "Step reports received", registry=r)
        self.rpc_errors = Counter(
            "kvplane_rpc_errors", "RPCs ended with an error status", ["method", "code"], registry=r
        )
        self.rejected = Counter(
            "kvplane_rejected", "Calls rejected by a limit", ["limit"], registry=r
        )
        self.policy_version = Gauge(
            "kvplane_policy_version", "Version of the active policy", registry=r
        )
        self.tls_cert_not_after = Gauge(
            "kvplane_tls_cert_not_after_seconds",
            "Unix time the server certificate (--tls-cert) expires, read at start (0 without TLS)",
            registry=r,
        )

    def value(self, name: str, labels: dict[str, str] | None = None) -> float:
        """Current value of a sample (e.g. ``kvplane_sessions``); 0.0 when absent."""
        got = self.registry.get_sample_value(name, labels or {})
        return 0.0 if got is None else float(got)


class ClientMetrics:
    """The gRPC client's metrics (pass the worker process's registry to export them)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.degraded = Gauge(
            "kvplane_client_degraded",
            "1 while the worker session has no live stream (running on its last plan)",
            ["worker"],
            registry=self.registry,
        )
        self.reconnects = Counter(
            "kvplane_client_reconnects",
            "Session streams re-established after a failure",
            ["worker"],
            registry=self.registry,
        )
