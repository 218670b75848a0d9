"""``PolicyEndpoint``: the live policy API of the embedded control plane (``--kv-policy-listen``).

The scheduler of TP rank 0 owns the embedded control plane (the other ranks have none: they
install what rank 0 broadcasts), so it alone serves, on the one port the flag names (one server
per model instance; ``--dp-size > 1`` is refused at launch). What it serves is
``kvplane.v1.PolicyService`` exactly as ``kvplane serve`` does -- the same servicer, interceptors
(bearer token for ``UpdatePolicy``: UNAUTHENTICATED without it; error mapping), TLS / mTLS,
health and reflection (:func:`controlplane.service.server.create_server` with
``sessions=False``: no worker sessions). Clients: ``kvplane policy get|update|watch``, any gRPC
client of ``proto/kvplane/v1``.

An accepted update reaches the controller at its next report (sessions read the live policy at
every report; a new version triggers a ``policy-change`` re-plan). The scheduler follows too:
with the endpoint on, the worker does not pin ``--kv-scheduler`` in its session -- it is written
into the live policy at start (actor ``launch``), and the policy's ``scheduler`` decides from then
on; on a single-rank scheduler the admission gate follows the live value at every step boundary
(``layerkv`` / ``lvf`` gate prefills, ``fcfs`` does not). With ``--tp-size > 1`` the gate keeps
the launch choice (every rank must gate alike; the controller still follows the policy).

Start-up never fails the server: a port taken since the launcher checked it (or any bind error)
is one ``policy_endpoint_unavailable`` log line, and the scheduler serves on without the
endpoint. Shutdown: :meth:`PolicyEndpoint.stop` ends open watches and stops the server; it runs
before the interpreter joins worker threads, so an open ``WatchPolicy`` never holds the process
up. No torch, no SGLang.
"""

from __future__ import annotations

import atexit
import threading
from typing import Any

import structlog

from sglang_ext.admission import GATED_SCHEDULERS
from sglang_ext.args import LayeredKVArgs
from sglang_ext.policy_endpoint_config import PolicyEndpointConfig

log = structlog.get_logger(__name__)

STOP_GRACE_S = 1.0
"""Grace for in-flight policy RPCs when the endpoint stops."""


def _stop_before_thread_join(stop: Any) -> None:
    """Run ``stop`` at interpreter exit before non-daemon threads are joined (gRPC's pool threads
    serving an open watch would otherwise hold the exit up); ``atexit`` where that hook is absent."""
    register = getattr(threading, "_register_atexit", None)
    try:
        if register is not None:
            register(stop)
            return
    except RuntimeError:  # the interpreter is already shutting down
        return
    atexit.register(stop)


class PolicyEndpoint:
    """A started policy-only gRPC server over one control plane."""

    def __init__(self, server: Any, port: int, config: PolicyEndpointConfig, control_plane: Any) -> None:
        self.server = server
        self.port = port
        """The bound port (the one asked for, or the free one picked for port 0)."""
        self.config = config
        self._cp = control_plane
        self._stopped = False
        self._lock = threading.Lock()

    @classmethod
    def launch(cls, args: LayeredKVArgs, control_plane: Any) -> PolicyEndpoint | None:
        """The scheduler's start: None without ``--kv-policy-listen`` or when it cannot serve
        (logged); the launch ``--kv-scheduler`` is written into the live policy first."""
        try:
            config = PolicyEndpointConfig.from_args(args)
        except ValueError as exc:  # the launcher checked it; a changed file since then
            log.error("policy_endpoint_unavailable", error=str(exc), action="serving without the policy endpoint")
            return None
        if config is None:
            return None
        current = control_plane.get_policy()
        if current.scheduler != args.kv_scheduler:
            control_plane.update_policy({"scheduler": args.kv_scheduler}, actor="launch (--kv-scheduler)")
        return cls.start(control_plane, config)

    @classmethod
    def start(cls, control_plane: Any, config: PolicyEndpointConfig) -> PolicyEndpoint | None:
        """Bind and start; None (one log line) when the port cannot be bound."""
        from controlplane.service.server import create_server

        try:
            server, port = create_server(config.listen, control_plane, config.server_config(), sessions=False)
        except (RuntimeError, OSError, ValueError) as exc:
            log.error(
                "policy_endpoint_unavailable",
                listen=config.listen,
                error=str(exc),
                action="serving without the policy endpoint (the live policy keeps its value)",
            )
            return None
        server.start()
        endpoint = cls(server, port, config, control_plane)
        _stop_before_thread_join(endpoint.stop)
        log.info(
            "policy_endpoint_started",
            listen=config.listen,
            port=port,
            tls=config.tls,
            mtls=config.tls_ca is not None,
            token=config.token_file is not None,
            policy_version=control_plane.get_policy().version,
        )
        return endpoint

    def scheduler_gated(self) -> bool:
        """Whether the live policy's scheduler gates admissions (``layerkv``, ``lvf``)."""
        return self._cp.get_policy().scheduler in GATED_SCHEDULERS

    @property
    def stopped(self) -> bool:
        return self._stopped

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """End open watches and stop serving (idempotent, never raises)."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        try:
            self.server.stop(grace_s)
        except Exception:
            log.warning("policy_endpoint_stop_failed", exc_info=True)
        log.info("policy_endpoint_stopped", port=self.port)
