"""LockSafeHealthServicer: ``grpc.health.v1.Health`` (Check, Watch) whose status sends never wait
while holding the lock a closing Watch stream needs.

grpc-health-checking's ``HealthServicer`` (1.85, pinned) sends each watcher's update while holding
its lock, and a non-blocking Watch's send waits until gRPC's poller thread completes it. That
poller also runs the callbacks of streams that end, and the stock callback takes the same lock.
So a Watch stream cancelled while a status is being sent (a client going away as the server
stops) deadlocks the poller and the sender. ``ControlPlaneServer.stop`` hung for good this way in
a full test run (session 76: the teardown of
``tests/service/test_session_order.py::test_open_health_watches_and_reflection_streams_leave_the_server_answering``,
its health watches cancelled just before the stop).

Here the status and the watchers live under one lock that nothing holds while sending, and the
sends happen under a second lock that only senders take (so a watcher sees its updates in order,
and a new watcher's first status is never older than one sent to it after). The poller's
end-of-stream callback takes only the first. A send that raises (its stream gone) does not stop
the others. Same answers as the stock servicer otherwise: ``Check`` of an unknown service is
NOT_FOUND, a Watch of one gets SERVICE_UNKNOWN, and ``enter_graceful_shutdown`` sets every known
service NOT_SERVING for good.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

import grpc
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc

log = structlog.get_logger(__name__)

Status = int
Send = Callable[[health_pb2.HealthCheckResponse], Any]


class LockSafeHealthServicer(health_pb2_grpc.HealthServicer):
    """Health Check and Watch (module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        """Guards the statuses and the watchers; never held while sending."""
        self._send_lock = threading.Lock()
        """Orders the sends; only senders take it (never the poller's end-of-stream callback)."""
        self._status: dict[str, Status] = {"": health_pb2.HealthCheckResponse.SERVING}
        self._watchers: dict[str, set[Send]] = {}
        self._shutting_down = False

    def Check(self, request: health_pb2.HealthCheckRequest,  # noqa: N802 - the RPC's name
              context: grpc.ServicerContext) -> health_pb2.HealthCheckResponse:
        with self._lock:
            status = self._status.get(request.service)
        if status is None:
            context.set_code(grpc.StatusCode.NOT_FOUND)
            return health_pb2.HealthCheckResponse()
        return health_pb2.HealthCheckResponse(status=status)

    def Watch(self, request: health_pb2.HealthCheckRequest,  # noqa: N802 - the RPC's name
              context: grpc.ServicerContext, send_response_callback: Send | None = None) -> None:
        """A non-blocking stream (the server passes ``send_response_callback``): the current
        status now, each change after, until the client ends it."""
        if send_response_callback is None:
            raise RuntimeError("LockSafeHealthServicer.Watch runs as a non-blocking handler "
                               "(grpc passes send_response_callback); this server did not")
        service, send = request.service, send_response_callback
        with self._send_lock:
            with self._lock:
                status = self._status.get(service, health_pb2.HealthCheckResponse.SERVICE_UNKNOWN)
                self._watchers.setdefault(service, set()).add(send)
            if not context.add_callback(functools.partial(self._closed, service, send)):
                self._closed(service, send)  # the stream ended already: nothing to send
                return
            self._send(send, status)

    Watch.experimental_non_blocking = True  # type: ignore[attr-defined]  # grpc's server reads it

    def set(self, service: str, status: Status) -> None:
        """``service``'s status (ignored once shutting down), sent to its watchers."""
        with self._send_lock:
            with self._lock:
                if self._shutting_down:
                    return
                self._status[service] = status
                watchers = list(self._watchers.get(service, ()))
            for send in watchers:
                self._send(send, status)

    def enter_graceful_shutdown(self) -> None:
        """Every known service NOT_SERVING, for good (later :meth:`set` calls are ignored)."""
        not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
        with self._send_lock:
            with self._lock:
                if self._shutting_down:
                    return
                self._shutting_down = True
                watchers: list[Send] = []
                for service in self._status:
                    self._status[service] = not_serving
                    watchers += self._watchers.get(service, ())
            for send in watchers:
                self._send(send, not_serving)

    def watchers(self) -> int:
        """Open Watch streams."""
        with self._lock:
            return sum(len(sends) for sends in self._watchers.values())

    def _closed(self, service: str, send: Send) -> None:
        """A Watch stream ended (gRPC's poller runs this): forgotten. Takes only :attr:`_lock`."""
        with self._lock:
            sends = self._watchers.get(service)
            if sends is not None:
                sends.discard(send)
                if not sends:
                    del self._watchers[service]

    @staticmethod
    def _send(send: Send, status: Status) -> None:
        try:
            send(health_pb2.HealthCheckResponse(status=status))
        except Exception as exc:  # noqa: BLE001 - a stream gone mid-send; the others still get theirs
            log.debug("health_watch_send_failed", error=repr(exc))
