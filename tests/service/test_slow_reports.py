"""A slow or hostile report never stalls the server: the session's termination callback (run by
gRPC on the server's one event thread) only signals, and the token-deposit account's work per
report is bounded whatever the report claims (found by a review of the control plane, session 41).
"""

from __future__ import annotations

import queue
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from controlplane.controller.session_controller import SessionController
from controlplane.controller.token_deposit import RUN_LOOP_MAX, TokenDeposit
from controlplane.service import convert
from kvplane.v1 import controlplane_pb2 as pb
from kvplane.v1 import controlplane_pb2_grpc as pb_grpc

from .conftest import step_report, wait_until, worker_info


def _health_s(target: str) -> float:
    """Seconds a Health.Check took (raises if it failed)."""
    with grpc.insecure_channel(target) as channel:
        t0 = time.perf_counter()
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        return time.perf_counter() - t0


def _hold_report_2(monkeypatch, seconds: float) -> tuple[threading.Event, threading.Event]:  # noqa: ANN001
    """The real controller's report of step 2 waits (at most ``seconds``) for the returned
    ``release``; ``entered`` is set once it waits."""
    entered, release = threading.Event(), threading.Event()
    real = SessionController.report

    def slow(self, report):  # noqa: ANN001, ANN202
        if report.step == 2:
            entered.set()
            release.wait(seconds)
        return real(self, report)

    monkeypatch.setattr(SessionController, "report", slow)
    return entered, release


def test_a_worker_leaving_during_a_slow_report_does_not_stall_the_server(serve, monkeypatch):
    """A report the controller takes 4 s over (held here by an event inside the real report) is
    in flight when its worker drops the stream. The server still answers at once, and the
    session closes once the report is done."""
    served = serve()
    entered, release = _hold_report_2(monkeypatch, 4.0)
    sent: queue.Queue = queue.Queue()

    def messages():  # noqa: ANN202
        yield pb.WorkerMessage(hello=convert.worker_info_to_proto(worker_info("w-slow")))
        while (item := sent.get()) is not None:
            yield item

    channel = grpc.insecure_channel(served.target)
    call = pb_grpc.ControlPlaneStub(channel).Session(messages())

    def drain() -> None:  # the replies, until the test cancels the call (CANCELLED: expected)
        try:
            for _ in call:
                pass
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED:
                raise

    threading.Thread(target=drain, daemon=True).start()
    for step in (1, 2):
        sent.put(pb.WorkerMessage(report=convert.step_report_to_proto(step_report(step, {"a": 500}))))
    assert entered.wait(10), "the slow report never started"
    call.cancel()
    channel.close()
    time.sleep(0.3)  # the termination callback has run by now
    took = _health_s(served.target)
    in_flight = not release.is_set()
    release.set()
    assert in_flight and took < 2.0, took
    assert wait_until(lambda: served.metric("kvplane_sessions") == 0, 10)
    assert wait_until(lambda: "w-slow" not in served.control_plane.sessions(), 5)


def test_a_run_of_a_trillion_tokens_at_a_vanishing_slo_is_counted_at_once():
    """A report claiming 10^12 tokens at an SLO of 1e-300 ms (one step of which does not move the
    clock) is delivered in closed form past RUN_LOOP_MAX tokens: at once, every token due."""
    d = TokenDeposit(1e-300)
    d.generate(10.0, 1, deliveries=False)
    t0 = time.perf_counter()
    d.generate(20.0, 10**12, deliveries=False)
    assert time.perf_counter() - t0 < 1.0
    # one violation: the run's first token, 10 ms after the last delivery (the deposit ran dry)
    assert d.delivered == 10**12 + 1 and d.balance == 0 and d.violations == 1


def test_the_closed_form_delivers_what_the_token_by_token_loop_does():
    """Tokens due by a clock past RUN_LOOP_MAX deliveries: the same counts and violations as the
    per-token path (Delivery objects), the last delivery time to the last bit's rounding; control:
    the clock one SLO earlier delivers one token fewer."""
    n, slo = 3 * RUN_LOOP_MAX, 0.5
    now = 10.0 + (RUN_LOOP_MAX * 2 + 10) * slo
    lean, full = TokenDeposit(slo), TokenDeposit(slo)
    for d, keep in ((lean, False), (full, True)):
        d.generate(10.0, n, deliveries=keep)
        d.advance(now, deliveries=keep)
    assert lean.delivered == full.delivered == 2 * RUN_LOOP_MAX + 11
    assert lean.balance == full.balance and lean.violations == full.violations
    assert abs(lean.last_delivery_ms - full.last_delivery_ms) <= 1e-9 * now
    early = TokenDeposit(slo)
    early.generate(10.0, n, deliveries=False)
    early.advance(now - slo, deliveries=False)
    assert early.delivered == lean.delivered - 1


def test_a_watcher_that_stopped_reading_leaves_without_stalling_the_server(serve):
    """A policy watcher stops reading (its stream window is a few hundred bytes, so the server's
    writer blocks after a few events) while updates keep coming, until its queue is full; then
    it drops its stream. The termination callback ends the watch without blocking gRPC's event
    thread, so the server keeps answering, and a server stop does not block either."""
    served = serve()
    servicer = served.server._policy
    options = [("grpc.http2.lookahead_bytes", 256), ("grpc.http2.bdp_probe", 0)]
    channel = grpc.insecure_channel(served.target, options=options)
    watch = pb_grpc.PolicyServiceStub(channel).WatchPolicy(pb.WatchPolicyRequest())
    assert next(watch).policy.version >= 0  # the watch is open: its queue is registered
    assert wait_until(lambda: len(servicer._watchers) == 1, 5)
    (q,) = servicer._watchers
    with grpc.insecure_channel(served.target) as admin:
        stub = pb_grpc.PolicyServiceStub(admin)
        for i in range(5000):
            if q.full():
                break
            stub.UpdatePolicy(pb.UpdatePolicyRequest(changes=pb.Policy(alpha=0.5 + (i % 400) * 1e-3)), timeout=5)
    assert q.full(), f"the watcher's queue holds {q.qsize()} after the updates"
    watch.cancel()
    channel.close()
    time.sleep(0.3)
    assert _health_s(served.target) < 2.0
    assert wait_until(lambda: not servicer._watchers, 5)
    t0 = time.perf_counter()
    servicer.stop()
    assert time.perf_counter() - t0 < 1.0


def _queued_reports_after_a_slow_one(serve, connect, monkeypatch, max_batch_bytes: int | None):  # noqa: ANN001, ANN202
    """A worker with 150 running requests (~5 KB a report) on a client whose messages may be at
    most 64 KiB; the controller holds report 2 until 30 more have queued up, then lets go."""
    served = serve()
    entered, release = _hold_report_2(monkeypatch, 20.0)
    client = connect(served.target, max_message_bytes=64 << 10)
    session = client.open_session(worker_info("w-batch"))
    assert session.wait_connected(10)
    if max_batch_bytes is not None:  # the negative control: batches by count only, as before
        session.max_batch_bytes = max_batch_bytes
    running = {f"request-{i:04d}-{'x' * 20}": 300 for i in range(150)}
    session.report(step_report(1, running))
    session.report(step_report(2, running))
    assert entered.wait(10), "the slow report never started"
    for step in range(3, 33):
        session.report(step_report(step, running))
    release.set()
    wait_until(lambda: session.stats.reconnects > 0 or served.metric("kvplane_reports_total") >= 32, 30)
    return session, served


def test_queued_reports_are_batched_within_the_message_limit(serve, connect, monkeypatch):
    """Reports that queued up behind a slow one go out as ReportBatches no larger than half the
    client's message limit: every report arrives on the one stream (control-plane review, session
    54: 64 of them made one batch past gRPC's limit, which dropped the stream under load).
    Control: batching by count alone breaks the stream and reconnects."""
    session, served = _queued_reports_after_a_slow_one(serve, connect, monkeypatch, None)
    assert session.stats.reconnects == 0 and session.stats.batches_sent >= 2, session.stats
    assert served.metric("kvplane_reports_total") >= 32


def test_batching_by_count_alone_breaks_the_stream(serve, connect, monkeypatch):
    session, _ = _queued_reports_after_a_slow_one(serve, connect, monkeypatch, 1 << 40)
    assert session.stats.reconnects >= 1, session.stats


def test_a_stream_that_never_says_hello_gives_its_session_slot_back(serve, connect):
    """Streams that open and send nothing held their ``max_sessions`` slots for good (keepalive
    kept them up; control-plane review, session 54): after ``hello_timeout_s`` the server cancels
    them and a worker gets a session. Control: before the timeout the slot is still taken."""
    from controlplane.service.server import ServerConfig

    served = serve(ServerConfig(max_sessions=1, hello_timeout_s=1.5))
    silent = threading.Event()

    def nothing():  # noqa: ANN202
        silent.wait(30)
        yield from ()

    channel = grpc.insecure_channel(served.target)
    call = pb_grpc.ControlPlaneStub(channel).Session(nothing())
    time.sleep(0.5)  # the silent stream holds the one slot
    hello = pb.WorkerMessage(hello=convert.worker_info_to_proto(worker_info("w-after")))
    with grpc.insecure_channel(served.target) as ch:
        try:
            next(pb_grpc.ControlPlaneStub(ch).Session(iter([hello]), timeout=5))
            early = "served"
        except grpc.RpcError as exc:
            early = exc.code().name
    assert early == "RESOURCE_EXHAUSTED", early
    with pytest.raises(grpc.RpcError) as info:
        list(call)
    assert info.value.code() == grpc.StatusCode.CANCELLED, info.value
    session = connect(served.target).open_session(worker_info("w-after"))
    assert session.wait_connected(10)
    silent.set()
    channel.close()
