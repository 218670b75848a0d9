"""LockSafeHealthServicer: no status send waits under the lock a closing Watch needs (the stock
servicer's deadlock, reproduced deterministically as a control), the stock answers otherwise,
and on a real server: watches get each status in order, ended ones are forgotten, a stop with
watches open and closing returns."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from controlplane.service.lock_safe_health_servicer import LockSafeHealthServicer

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN


class _Context:
    """A Watch stream's context as gRPC's server gives it: end-of-stream callbacks, run by
    :meth:`end` (what the poller does when the client cancels)."""

    def __init__(self, ended: bool = False) -> None:
        self.callbacks: list[Callable[[], None]] = []
        self.ended = ended
        self.code: grpc.StatusCode | None = None

    def add_callback(self, callback: Callable[[], None]) -> bool:
        if self.ended:
            return False
        self.callbacks.append(callback)
        return True

    def end(self) -> None:
        self.ended = True
        for callback in self.callbacks:
            callback()

    def set_code(self, code: grpc.StatusCode) -> None:
        self.code = code


def _watch(servicer: Any, service: str = "", ended: bool = False) -> tuple[list[int], _Context]:
    got: list[int] = []
    context = _Context(ended)
    servicer.Watch(health_pb2.HealthCheckRequest(service=service), context, lambda r: r is not None and got.append(r.status))  # None: the stock's close
    return got, context


@pytest.mark.parametrize("kind", ["stock", "lock-safe"])
def test_a_send_does_not_wait_under_the_lock_a_closing_stream_needs(kind: str) -> None:
    """Watcher A's send completes only once the poller has run what it is running: here, the
    end-of-stream callback of watcher B, cancelled meanwhile (as gRPC's ``send_response`` waits on
    the poller). The stock servicer sends under its lock, which B's callback needs: the poller
    waits for the sender, the sender for the poller -- a deadlock (the control; here the send
    gives up after a second instead of hanging). The lock-safe one sends outside it."""
    servicer = health.HealthServicer() if kind == "stock" else LockSafeHealthServicer()
    _, closing = _watch(servicer)
    outcome: list[str] = []
    armed = [False]

    def send_a(response: health_pb2.HealthCheckResponse) -> None:
        if not armed[0]:
            return
        poller = threading.Thread(target=closing.end, daemon=True)  # B's end-of-stream, on the poller
        poller.start()
        poller.join(timeout=1.0)
        outcome.append("deadlock" if poller.is_alive() else "sent")

    servicer.Watch(health_pb2.HealthCheckRequest(), _Context(), send_a)
    armed[0] = True
    done = threading.Thread(target=servicer.enter_graceful_shutdown, daemon=True)
    done.start()
    done.join(timeout=5.0)
    assert not done.is_alive()
    assert outcome == (["deadlock"] if kind == "stock" else ["sent"])
    if kind == "lock-safe":
        assert servicer.watchers() == 1  # B forgotten, A kept


def test_the_stock_answers() -> None:
    """Check: known services' status, NOT_FOUND for another; Watch: the status now, then each
    change in order, SERVICE_UNKNOWN for an unknown service until it is set; a stream that ended
    gets nothing more and is forgotten; one that ended before its callback could be added is never
    kept; a send that raises does not stop the others; a graceful shutdown sets every known
    service NOT_SERVING, for good."""
    s = LockSafeHealthServicer()
    s.set("svc", SERVING)
    context = _Context()
    assert s.Check(health_pb2.HealthCheckRequest(service="svc"), context).status == SERVING and context.code is None
    assert s.Check(health_pb2.HealthCheckRequest(service="nope"), context) == health_pb2.HealthCheckResponse()
    assert context.code == grpc.StatusCode.NOT_FOUND
    a, _ = _watch(s, "svc")
    b, b_context = _watch(s, "svc")
    later, _ = _watch(s, "later")
    _watch(s, "svc", ended=True)  # ended before it was registered: not kept
    assert s.watchers() == 3
    s.Watch(health_pb2.HealthCheckRequest(service="svc"), _Context(), _raise)  # its sends raise: the others still get theirs
    s.set("svc", NOT_SERVING)
    b_context.end()
    s.set("svc", SERVING)
    s.set("later", SERVING)
    assert a == [SERVING, NOT_SERVING, SERVING] and b == [SERVING, NOT_SERVING]  # b ended: nothing more
    assert later == [UNKNOWN, SERVING]
    s.enter_graceful_shutdown()
    s.set("svc", SERVING)  # ignored from now on
    assert a[-1] == NOT_SERVING and later[-1] == NOT_SERVING and s.Check(
        health_pb2.HealthCheckRequest(service="svc"), _Context()).status == NOT_SERVING
    with pytest.raises(RuntimeError, match="non-blocking"):
        s.Watch(health_pb2.HealthCheckRequest(), _Context())


def _raise(response: health_pb2.HealthCheckResponse) -> None:
    raise RuntimeError("stream gone")


def test_on_a_real_server_watches_follow_the_status_and_a_stop_with_watches_closing_returns(serve: Any) -> None:
    """A real server on port 0: Watch streams see SERVING; cancelled ones are forgotten (gRPC's
    poller ran their end-of-stream callback); a stop while some watches are open and others are
    being cancelled returns, and the open ones see NOT_SERVING."""
    served = serve()
    servicer = served.server.health
    assert isinstance(servicer, LockSafeHealthServicer)
    channel = grpc.insecure_channel(served.target)
    stub = health_pb2_grpc.HealthStub(channel)
    watches = [stub.Watch(health_pb2.HealthCheckRequest()) for _ in range(4)]
    assert all(next(w).status == SERVING for w in watches)
    watches[0].cancel()
    deadline = time.monotonic() + 5
    while servicer.watchers() != 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert servicer.watchers() == 3
    for w in watches[1:3]:
        w.cancel()  # closing while the stop sends
    stopper = threading.Thread(target=served.server.stop, args=(0.5,), daemon=True)
    stopper.start()
    stopper.join(timeout=20)
    assert not stopper.is_alive(), "the stop hung"
    try:
        assert next(watches[3]).status == NOT_SERVING
    except grpc.RpcError as exc:  # the stop's grace ended it first: never SERVING again
        assert exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
    channel.close()
