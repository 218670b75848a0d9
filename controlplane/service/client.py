"""``GrpcControlPlane``: the :class:`api.ControlPlane` interface over gRPC.

Same Python interface as the embedded control plane, so a worker switches between in-process and
remote with one flag (``--kv-control-plane grpc://host:port``). Unary calls carry a deadline and
raise the same domain errors as the embedded mode (status codes mapped back by
:mod:`controlplane.service.errors`). Worker sessions are a :class:`GrpcWorkerSession`: a
background thread keeps the stream alive and reconnects with exponential backoff; ``report()``
never blocks and never raises into the worker's step loop.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import grpc
import structlog

from controlplane import api
from controlplane.model import Batch, Plan, SchemaError
from controlplane.policy import Policy
from controlplane.service import convert, policy_convert
from controlplane.service.errors import error_for
from controlplane.service.metrics import ClientMetrics
from controlplane.service.worker_session import Backoff, GrpcWorkerSession
from kvplane.v1 import controlplane_pb2 as pb
from kvplane.v1 import controlplane_pb2_grpc as pb_grpc

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class ClientTLS:
    """Client TLS material (PEM bytes); ``cert_chain`` + ``private_key`` present a client cert."""

    root_certificates: bytes | None = None
    """CA that signed the server certificate (None = system roots)."""
    private_key: bytes | None = None
    cert_chain: bytes | None = None
    server_name: str | None = None
    """Override of the name checked against the server certificate (tests, IP addresses)."""

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self.root_certificates,
            private_key=self.private_key,
            certificate_chain=self.cert_chain,
        )


def parse_target(target: str) -> str:
    """``grpc://host:port`` or ``host:port`` -> ``host:port`` (ValueError naming the value)."""
    t = target.strip()
    if t.startswith("grpc://"):
        t = t[len("grpc://") :]
    host, sep, port = t.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"target: {target!r} is not grpc://HOST:PORT with PORT in [1, 65535]")
    return t


REPORT_BATCH_MAX_BYTES = 1 << 20
"""Most serialized bytes of one batch of queued reports (less when this client's own message limit
is under twice it). The client does not know the server's limit: ``kvplane serve`` accepts none
below twice this (``server.MIN_SERVE_MESSAGE_BYTES``), so every batch fits."""


class GrpcControlPlane:
    """A remote control plane (implements :class:`api.ControlPlane`)."""

    def __init__(
        self,
        target: str,
        *,
        token: str | None = None,
        tls: ClientTLS | None = None,
        timeout_s: float = 5.0,
        plan_timeout_s: float = 30.0,
        backoff: Backoff | None = None,
        max_message_bytes: int = 4 * 1024 * 1024,
        metrics: ClientMetrics | None = None,
    ) -> None:
        for name, value in (("timeout_s", timeout_s), ("plan_timeout_s", plan_timeout_s)):
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 3600:
                raise ValueError(f"{name}: {value!r} is out of range (allowed (0, 3600])")
        self.target = parse_target(target)
        self._token = token
        self._timeout_s = timeout_s
        self._plan_timeout_s = plan_timeout_s
        self._backoff = backoff or Backoff()
        self._max_message_bytes = max_message_bytes
        self.metrics = metrics or ClientMetrics()
        options: list[tuple[str, Any]] = [
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.keepalive_time_ms", 5000),
            ("grpc.keepalive_timeout_ms", 5000),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0),
            ("grpc.initial_reconnect_backoff_ms", int(self._backoff.initial_s * 1000)),
            ("grpc.min_reconnect_backoff_ms", int(self._backoff.initial_s * 1000)),
            ("grpc.max_reconnect_backoff_ms", int(self._backoff.max_s * 1000)),
        ]
        if tls is not None:
            if tls.server_name:
                options.append(("grpc.ssl_target_name_override", tls.server_name))
            self._channel = grpc.secure_channel(self.target, tls.credentials(), options=options)
        else:
            self._channel = grpc.insecure_channel(self.target, options=options)
        self._cp = pb_grpc.ControlPlaneStub(self._channel)
        self._policy = pb_grpc.PolicyServiceStub(self._channel)
        self._sessions: set[GrpcWorkerSession] = set()
        self._lock = threading.Lock()
        self._closed = False

    # ------------------------------------------------------------ api.ControlPlane

    def _check_open(self) -> None:
        """After :meth:`close` every call is refused as the API's own error (before: a session
        whose thread died on the closed channel, or grpc's raw ValueError; review, session 80)."""
        if self._closed:
            raise api.Unavailable(f"control plane client for {self.target} is closed")

    def _call(self, rpc: Callable[..., Any], request: Any, **kwargs: Any) -> Any:
        """``rpc(request, **kwargs)`` with grpc's errors as the API's: a status by
        :func:`error_for`, and the channel's ValueError (a :meth:`close` racing the call) as
        ``Unavailable``."""
        self._check_open()
        try:
            return rpc(request, **kwargs)
        except grpc.RpcError as err:
            raise error_for(err) from None
        except ValueError:
            self._check_open()  # closed meanwhile: Unavailable
            raise

    def open_session(self, worker: api.WorkerInfo) -> GrpcWorkerSession:
        """Start a session; it connects in the background (see ``wait_connected``)."""
        self._check_open()
        hello = convert.worker_info_to_proto(worker)  # fails fast on a bad WorkerInfo
        session = GrpcWorkerSession(
            self._cp, hello, worker.worker_id, backoff=self._backoff, metrics=self.metrics,
            on_close=self._forget, max_batch_bytes=min(self._max_message_bytes // 2, REPORT_BATCH_MAX_BYTES),
        )
        with self._lock:  # one close() took its list of sessions: not after it (review, session 80)
            closed = self._closed
            if not closed:
                self._sessions.add(session)
        if closed:
            session.close(drain_s=0.0)
            self._check_open()
        return session

    def _forget(self, session: GrpcWorkerSession) -> None:
        with self._lock:
            self._sessions.discard(session)

    def plan(self, batch: Any) -> Plan:
        self._check_open()
        if isinstance(batch, Mapping):
            try:
                batch = Batch.from_dict(batch)
            except SchemaError as exc:  # the api.ControlPlane contract: as the embedded plane's
                raise api.InvalidArgument(str(exc)) from exc
        if not isinstance(batch, Batch):
            raise api.InvalidArgument(f"batch: expected a Batch or a mapping, got {type(batch).__name__}")
        try:
            request = pb.PlanRequest(batch=convert.batch_to_proto(batch))
        except (ValueError, OverflowError) as exc:  # protobuf's range checks: past int64, say
            raise api.InvalidArgument(f"batch: does not fit the wire format ({exc})") from exc
        response = self._call(self._cp.Plan, request, timeout=self._plan_timeout_s)
        return convert.plan_from_proto(response.plan)

    def get_policy(self) -> Policy:
        msg = self._call(self._policy.GetPolicy, pb.GetPolicyRequest(), timeout=self._timeout_s)
        return policy_convert.policy_from_proto(msg)

    def update_policy(self, changes: Mapping[str, Any], token: str | None = None) -> Policy:
        self._check_open()
        request = pb.UpdatePolicyRequest(changes=policy_convert.policy_changes_to_proto(changes))
        token = token if token is not None else self._token
        metadata = (("authorization", f"Bearer {token}"),) if token else None
        response = self._call(self._policy.UpdatePolicy, request, timeout=self._timeout_s, metadata=metadata)
        return policy_convert.policy_from_proto(response.policy)

    def watch_policy(self) -> Iterator[Policy]:
        """The current policy, then every update; closing the iterator cancels the stream."""
        call = self._call(self._policy.WatchPolicy, pb.WatchPolicyRequest())
        try:
            for event in call:
                yield policy_convert.policy_from_proto(event.policy)
        except grpc.RpcError as err:
            if err.code() != grpc.StatusCode.CANCELLED:
                raise error_for(err) from None
        finally:
            call.cancel()

    # ------------------------------------------------------------ lifecycle

    def health(self, service: str = "") -> str:
        """The server's health status name (``SERVING``, ...) for ``service``."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        self._check_open()  # a stub made on a closed channel crashed the process (segfault)
        stub = health_pb2_grpc.HealthStub(self._channel)
        got = self._call(stub.Check, health_pb2.HealthCheckRequest(service=service), timeout=self._timeout_s)
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(got.status))

    def close(self, drain_s: float = 5.0) -> None:
        """Close every session (each drains its queued reports, all within ``drain_s``), then
        the channel."""
        with self._lock:
            self._closed = True
            sessions = list(self._sessions)
        close_by = time.monotonic() + drain_s
        for s in sessions:
            s.close(drain_s=max(0.0, close_by - time.monotonic()))
        self._channel.close()

    def __enter__(self) -> GrpcControlPlane:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
