"""A worker's session against a control plane that misbehaves after its hello (review, session 66):
one that stops answering while the stream stays up (hung: the worker degrades, so its fallback
runs), one that sends an undecodable decision among good ones (that one is refused, the stream
stays), one that ends every stream right after its hello (the reconnects back off instead of
retrying at 20 Hz). And the real server's heartbeat: answered reports are acked when no decision
goes out, which is what tells a quiet control plane from a hung one."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest

from controlplane.service.worker_session import Backoff
from kvplane.v1 import controlplane_pb2 as pb
from kvplane.v1 import controlplane_pb2_grpc as pb_grpc

from .conftest import step_report, wait_until, worker_info


class _Scripted(pb_grpc.ControlPlaneServicer):
    """Acks the hello, then: ``hang`` (never answers), ``bad`` (per report a good decision and
    one whose recompute names no placed request), ``end`` (ends the stream at once), ``lag``
    (answers each message, a report or a batch of them, 0.1 s after the last: ever further
    behind a worker reporting faster)."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.streams = 0
        self.stop = threading.Event()

    def Session(self, requests, context):  # type: ignore[no-untyped-def]  # noqa: N802
        self.streams += 1
        next(requests)
        yield pb.SessionReply(session_id=f"s{self.streams}")
        if self.mode == "end":
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "scripted: the stream ends after its hello")
        for message in requests:
            if self.mode == "hang":
                self.stop.wait(30)
                return
            step = message.reports.reports[-1].step if message.HasField("reports") else message.report.step
            if self.mode == "lag":
                if self.stop.wait(0.1):
                    return
                yield pb.SessionReply(report_step=step)
                continue
            good = pb.Decision(plan=pb.Plan(placements={"a": pb.Placement(on_gpu=[1] * 8)}),
                               apply_at_step=step + 1, expiry_step=step + 5, reason="good")
            bad = pb.Decision(plan=pb.Plan(placements={"a": pb.Placement(on_gpu=[1] * 8)},
                                           recompute_blocks={"ghost": 3}),
                              apply_at_step=step + 1, expiry_step=step + 5, reason="bad")
            yield pb.SessionReply(report_step=step, decisions=[good, bad], decisions_sent=2)


@pytest.fixture
def scripted() -> Iterator:  # type: ignore[type-arg]
    started: list[tuple[grpc.Server, _Scripted]] = []

    def start(mode: str) -> tuple[str, _Scripted]:
        servicer = _Scripted(mode)
        server = grpc.server(futures.ThreadPoolExecutor(8))
        pb_grpc.add_ControlPlaneServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        started.append((server, servicer))
        return f"127.0.0.1:{port}", servicer

    yield start
    for server, servicer in started:
        servicer.stop.set()
        server.stop(0)


def _reporting(session, seconds: float, every_s: float = 0.02) -> list[bool]:  # type: ignore[no-untyped-def]
    """Report for ``seconds``; the session's ``degraded`` after each report."""
    seen, step, end = [], 0, time.monotonic() + seconds
    while time.monotonic() < end:
        session.report(step_report(step, {"a": 300}))
        seen.append(session.degraded)
        step += 1
        time.sleep(every_s)
    return seen


def test_a_hung_control_plane_degrades_the_session(scripted, connect) -> None:  # type: ignore[no-untyped-def]
    """The stream stays up but no report is answered: after ``stale_after_s`` the session says
    degraded (the worker's fallback runs, ``kvplane_control_plane_degraded`` is 1) once; before,
    it stayed 'healthy' for good and a worker under LayerKV admission served one request at a time."""
    target, _ = scripted("hang")
    session = connect(target).open_session(worker_info("w-hung"))
    session.stale_after_s = 0.4
    assert session.wait_connected(5)
    seen = _reporting(session, 1.2)
    assert not seen[0] and seen[-1], seen[:3]
    assert session.stats.stale_periods == 1 and "unanswered" in (session.last_error or "")
    session.close()


def test_a_control_plane_answering_ever_further_behind_degrades_the_session(scripted, connect) -> None:  # type: ignore[no-untyped-def]
    """Every report is answered, but each reply answers an older one than the worker's last: once
    the oldest unanswered report is ``stale_after_s`` old the session says degraded. Before,
    any reply counted: a 512-request worker saw its decisions planned 7 s behind it, half expired
    on arrival, and was never degraded (scale review, session 88)."""
    target, servicer = scripted("lag")
    session = connect(target).open_session(worker_info("w-lag"))
    session.stale_after_s = 0.4
    assert session.wait_connected(5)
    seen = _reporting(session, 1.5, every_s=0.01)
    assert not seen[0] and seen[-1], seen[:3]
    assert session.stats.stale_periods == 1 and "unanswered" in (session.last_error or "")
    servicer.stop.set()
    session.close()


def test_a_quiet_real_control_plane_is_not_taken_for_a_hung_one(served, connect) -> None:  # type: ignore[no-untyped-def]
    """Control: the real server answers reports that need no decision with its heartbeat (an ack
    once its writer has been idle a second), so a session reporting steadily for 4 s with a
    3 s ``stale_after_s`` never degrades, though decisions stop after the first plans."""
    session = connect(f"127.0.0.1:{served.port}").open_session(worker_info("w-quiet"))
    session.stale_after_s = 3.0
    assert session.wait_connected(5)
    seen = _reporting(session, 4.0)
    assert not any(seen) and session.stats.stale_periods == 0
    session.close()


def test_the_real_server_acks_answered_reports_without_decisions(served) -> None:  # type: ignore[no-untyped-def]
    """A raw stream: hello, then reports with nothing running (no decision is due): a reply with
    the report's step and no decision arrives within a few seconds."""
    from controlplane.service import convert

    stop = threading.Event()

    def messages():  # type: ignore[no-untyped-def]
        yield pb.WorkerMessage(hello=convert.worker_info_to_proto(worker_info("w-ack")))
        yield pb.WorkerMessage(report=convert.step_report_to_proto(step_report(7, {})))
        stop.wait(10)

    with grpc.insecure_channel(f"127.0.0.1:{served.port}") as ch:
        stream = pb_grpc.ControlPlaneStub(ch).Session(messages(), timeout=10)
        assert next(stream).session_id
        ack = next(stream)
        stop.set()
        stream.cancel()
    assert ack.report_step == 7 and not ack.decisions


def test_the_heartbeat_goes_out_however_often_the_writer_wakes(served) -> None:  # type: ignore[no-untyped-def]
    """Heartbeat starvation (review, session 66): the writer used to ack only after a second with
    no wake-up, so a stream woken more often than that without a decision (the notifier's
    pushes) never acked, and its worker took the control plane for hung. Woken every 0.2 s with
    nothing to send, the stream still acks the answered report within a few seconds, after
    several wake-ups (checked against the code before the fix: no ack in 10 s)."""
    from controlplane.service import convert

    stop, wakes = threading.Event(), [0]

    def messages():  # type: ignore[no-untyped-def]
        yield pb.WorkerMessage(hello=convert.worker_info_to_proto(worker_info("w-woken")))
        yield pb.WorkerMessage(report=convert.step_report_to_proto(step_report(7, {})))
        stop.wait(10)

    def wake() -> None:
        while not stop.wait(0.2):
            served.notifier.on_plan("w-woken", "test", 0.0, True)
            wakes[0] += 1

    waker = threading.Thread(target=wake, daemon=True)
    with grpc.insecure_channel(f"127.0.0.1:{served.port}") as ch:
        stream = pb_grpc.ControlPlaneStub(ch).Session(messages(), timeout=10)
        assert next(stream).session_id
        waker.start()
        t0 = time.monotonic()
        ack = next(stream)
        waited, woken = time.monotonic() - t0, wakes[0]
        stop.set()
        stream.cancel()
    waker.join(2)
    assert ack.report_step == 7 and not ack.decisions
    assert woken >= 3 and waited < 5, (woken, waited)


def test_an_undecodable_decision_is_refused_alone(scripted, connect) -> None:  # type: ignore[no-untyped-def]
    """Each reply carries a good decision and one whose recompute names a request it does not
    place: the good ones arrive, each bad one is counted and logged, and the stream stays up
    (before, the whole reply was dropped with the stream, and the worker reconnected forever)."""
    target, servicer = scripted("bad")
    session = connect(target).open_session(worker_info("w-bad"))
    assert session.wait_connected(5)
    got = []
    for step in range(10):
        got += session.report(step_report(step, {"a": 300}))
        time.sleep(0.02)
    assert wait_until(lambda: session.stats.decisions_refused >= 5, 5)
    got += session.poll()
    assert got and {d.reason for d in got} == {"good"}
    assert servicer.streams == 1 and session.stats.reconnects == 0
    session.close()


@pytest.mark.parametrize("healthy_after_s", [5.0, 0.0], ids=["backs-off", "control-resets"])
def test_streams_that_end_after_their_hello_back_off(scripted, connect, healthy_after_s: float) -> None:  # type: ignore[no-untyped-def]
    """Every stream is acked, then ended: the delays before the next attempt grow (50 ms doubling
    to 400 ms: at most ~8 streams in 1.5 s); they reset only after a stream stayed up
    ``healthy_after_s``. Control: with 0 every stream counts as healthy and the worker retries
    at the first delay each time (the old behaviour: many more streams)."""
    target, servicer = scripted("end")
    session = connect(target, backoff=Backoff(initial_s=0.05, max_s=0.4, jitter=0.0)).open_session(
        worker_info("w-end"))
    session.healthy_after_s = healthy_after_s
    time.sleep(1.5)
    session.close()
    if healthy_after_s:
        assert servicer.streams <= 8, servicer.streams
    else:
        assert servicer.streams >= 14, servicer.streams
