"""A session's decisions reach the worker in the order the controller handed them out, and a hello
that replaces a live session ends the old stream (control-plane review, session 65).

Each report of the order test adds one request, so the requests a decision's plan holds say which
report's state it was planned from; in arrival order that must never go down. Before the fix the
reader kept a ``ReportBatch``'s decisions until the batch ended while the writer sent a plan the
controller finished meanwhile: 41 of 81 decisions arrived after a newer one."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from controlplane.service.server import ServerConfig
from kvplane.v1 import controlplane_pb2 as pb
from kvplane.v1 import controlplane_pb2_grpc as pb_grpc

from .conftest import wait_until

BACKGROUND = 400
"""Requests in every report besides the ones it adds (each report costs real ingest time)."""


class RawStream:
    """A Session stream fed from a queue, its replies (or its error) collected on a thread."""

    def __init__(self, stub: pb_grpc.ControlPlaneStub, first: pb.WorkerMessage) -> None:
        self.sent: queue.Queue[pb.WorkerMessage | None] = queue.Queue()
        self.sent.put(first)
        self.replies: list[pb.SessionReply] = []
        self.error: grpc.StatusCode | None = None
        self.call = stub.Session(self._messages())
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _messages(self) -> Iterator[pb.WorkerMessage]:
        while (message := self.sent.get()) is not None:
            yield message

    def _read(self) -> None:
        try:
            for reply in self.call:
                self.replies.append(reply)
        except grpc.RpcError as exc:
            self.error = exc.code()

    def end(self) -> None:
        self.sent.put(None)


def _hello(worker_id: str) -> pb.WorkerMessage:
    return pb.WorkerMessage(hello=pb.WorkerInfo(
        worker_id=worker_id, model=pb.ModelSpec(layers=8, block_size=16, block_bytes=65536),
        hardware=pb.Hardware(gpu_kv_budget_blocks=10**7, h2d_gbps=25.0),
        profile=pb.Profile(layer_compute_ms=[0.5])))


def _report(step: int) -> pb.StepReport:
    report = pb.StepReport(step=step, now_ms=step * 20.0, observed_step_ms=4.0)
    for i in range(BACKGROUND):
        report.running.add(id=f"bg{i}", context_tokens=500 + step, generated_tokens=step, slo_tbt_ms=200.0)
    for k in range(step):
        report.running.add(id=f"r{k}", context_tokens=100 + step, generated_tokens=step - k, slo_tbt_ms=200.0)
    return report


def _planned_requests(stream: RawStream) -> list[int]:
    return [len(d.plan.placements) + len(d.plan.paused) - BACKGROUND
            for reply in stream.replies[1:] for d in reply.decisions]


def test_decisions_arrive_in_the_order_they_were_planned(serve: Any) -> None:
    served = serve()
    with grpc.insecure_channel(served.target) as channel:
        stream = RawStream(pb_grpc.ControlPlaneStub(channel), _hello("w0"))
        assert wait_until(lambda: len(stream.replies) >= 1)
        step = 1
        for _ in range(4):  # a worker catching up: ReportBatch messages of 32 reports
            stream.sent.put(pb.WorkerMessage(reports=pb.ReportBatch(reports=[_report(step + i) for i in range(32)])))
            step += 32
        assert wait_until(lambda: any(n == step - 1 for n in _planned_requests(stream)), timeout_s=60)
        stream.end()
        stream.thread.join(10)
    planned = _planned_requests(stream)
    assert len(planned) > 10 and stream.error is None
    late = [(i, n) for i, n in enumerate(planned) if n < max(planned[:i], default=-1)]
    assert not late, f"{len(late)} of {len(planned)} decisions arrived after a newer one: {late[:5]}"
    steps = [reply.report_step for reply in stream.replies[1:]]
    assert steps == sorted(steps)


@pytest.mark.parametrize("replace", [True, False])
def test_a_replaced_session_stream_ends_and_frees_its_slot(serve: Any, replace: bool) -> None:
    """With ``max_sessions`` 2, a reconnect of ``w0`` (a hello replacing its live session) ends
    the old stream at once (UNAVAILABLE, naming the replacement), so another worker still gets a
    slot. Control: two distinct workers fill both slots and a third is refused."""
    served = serve(ServerConfig(max_sessions=2, max_watchers=1))
    with grpc.insecure_channel(served.target) as channel:
        stub = pb_grpc.ControlPlaneStub(channel)
        old = RawStream(stub, _hello("w0"))
        assert wait_until(lambda: len(old.replies) >= 1)
        second = RawStream(stub, _hello("w0" if replace else "w1"))
        assert wait_until(lambda: len(second.replies) >= 1)
        if replace:
            assert wait_until(lambda: old.error is not None, timeout_s=5)
            assert old.error == grpc.StatusCode.UNAVAILABLE
        third = RawStream(stub, _hello("w2"))
        assert wait_until(lambda: len(third.replies) >= 1 or third.error is not None, timeout_s=5)
        assert (third.error is None) == replace
        if not replace:
            assert third.error == grpc.StatusCode.RESOURCE_EXHAUSTED
        for s in (old, second, third):
            s.end()
        time.sleep(0.1)


def test_open_health_watches_and_reflection_streams_leave_the_server_answering(serve: Any) -> None:
    """Health ``Watch`` streams as a service mesh opens them (one per channel), as many as the
    server has threads, take no RPC slot: a worker's session, health ``Check`` and ``GetPolicy``
    still answer. Reflection streams beyond the server's limit are refused, naming it, and the
    ones admitted leave room too. (Before: every slot taken, all refused with gRPC's "Concurrent
    RPC limit exceeded!".)"""
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    config = ServerConfig(max_sessions=4, max_watchers=2, unary_workers=2, rate_limit_rps=5.0)
    served = serve(config)
    with grpc.insecure_channel(served.target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        watches = [health.Watch(health_pb2.HealthCheckRequest()) for _ in range(config.threads)]
        for watch in watches:
            assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
        feeds: list[queue.Queue[Any]] = []
        streams = []
        for _ in range(3):
            feed: queue.Queue[Any] = queue.Queue()
            feed.put(reflection_pb2.ServerReflectionRequest(list_services=""))
            feeds.append(feed)
            streams.append(reflect.ServerReflectionInfo(iter(feed.get, None)))
        assert next(streams[0]).list_services_response.service  # admitted, held open
        with pytest.raises(grpc.RpcError) as refused:
            for stream in streams[1:]:
                next(stream)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "reflection" in (refused.value.details() or "")
        session = RawStream(pb_grpc.ControlPlaneStub(channel), _hello("w0"))
        assert wait_until(lambda: len(session.replies) >= 1 or session.error is not None, timeout_s=5)
        assert session.error is None
        assert health.Check(health_pb2.HealthCheckRequest(), timeout=3).status == health_pb2.HealthCheckResponse.SERVING
        assert pb_grpc.PolicyServiceStub(channel).GetPolicy(pb.GetPolicyRequest(), timeout=3).version >= 0
        session.end()
        for watch in watches:
            watch.cancel()
        for feed in feeds:
            feed.put(None)


def test_a_decision_over_the_send_limit_ends_the_stream_naming_the_limit(serve: Any) -> None:
    """An 80-layer model with 1,000 running requests under ``--max-message-bytes`` 65,536: its
    decision (~80 KB) cannot be sent. The stream ends with RESOURCE_EXHAUSTED naming the limit and
    the size, counted and logged (before: gRPC's own "Sent message larger than max", no log, no
    metric, and the worker reconnected into it for ever). Control: at the default 4 MiB the same
    report gets its decision."""
    for limit, fits in ((65_536, False), (4 * 1024 * 1024, True)):
        served = serve(ServerConfig(max_sessions=2, max_watchers=1, max_message_bytes=limit))
        hello = pb.WorkerMessage(hello=pb.WorkerInfo(
            worker_id="w0", model=pb.ModelSpec(layers=80, block_size=16, block_bytes=65536),
            hardware=pb.Hardware(gpu_kv_budget_blocks=4_600_000, h2d_gbps=25.0),
            profile=pb.Profile(layer_compute_ms=[0.2] * 80)))
        with grpc.insecure_channel(served.target) as channel:
            stream = RawStream(pb_grpc.ControlPlaneStub(channel), hello)
            assert wait_until(lambda stream=stream: len(stream.replies) >= 1)
            for step in (1, 2):
                report = pb.StepReport(step=step, now_ms=step * 30.0, observed_step_ms=16.0)
                for i in range(1000):
                    report.running.add(id=f"r{i}", context_tokens=1000 + step, generated_tokens=step, slo_tbt_ms=200.0)
                stream.sent.put(pb.WorkerMessage(report=report))
            # a heartbeat (a reply without decisions) may come first when planning is slow
            got = wait_until(lambda stream=stream: stream.error is not None
                             or any(r.decisions for r in stream.replies), timeout_s=30)
            assert got
            if fits:
                assert stream.error is None and any(r.decisions for r in stream.replies)
            else:
                assert stream.error == grpc.StatusCode.RESOURCE_EXHAUSTED
                details = stream.call.details() or ""
                assert "max_message_bytes" in details and "65536" in details
                assert served.metric("kvplane_rejected_total", {"limit": "max_message_bytes"}) >= 1
            stream.end()


def test_decisions_over_the_limit_together_go_out_as_several_replies() -> None:
    """Five 1 KB decisions under a 2,500-byte limit leave as replies of at most two, in order,
    each reply's ``decisions_sent`` counting through its last decision; one decision over the
    limit alone is refused naming it. Control: under a 1 MB limit they leave as one reply."""
    from controlplane import api
    from controlplane.service.metrics import ServiceMetrics
    from controlplane.service.session_servicer import SessionServicer

    decisions = [pb.Decision(reason=f"d{i}", pause=["x" * 1000]) for i in range(5)]
    small = SessionServicer(None, ServiceMetrics(), 1, max_message_bytes=2500)  # type: ignore[arg-type]
    replies = list(small._reply(7, decisions, 12))
    assert [[d.reason for d in r.decisions] for r in replies] == [["d0", "d1"], ["d2"], ["d3", "d4"]]
    assert [r.decisions_sent for r in replies] == [9, 10, 12] and {r.report_step for r in replies} == {7}
    assert all(r.ByteSize() <= 2500 for r in replies)
    big = SessionServicer(None, ServiceMetrics(), 1, max_message_bytes=1 << 20)  # type: ignore[arg-type]
    assert len(list(big._reply(7, decisions, 12))) == 1
    with pytest.raises(api.ResourceExhausted, match="max_message_bytes"):
        list(SessionServicer(None, ServiceMetrics(), 1, max_message_bytes=500)._reply(7, decisions[:1], 1))  # type: ignore[arg-type]


class _ActiveContext:
    """The one call of ``grpc.ServicerContext`` a session's writer makes."""

    def is_active(self) -> bool:
        return True


def _writer_ends(outbox: Any) -> Exception | None:
    """Run a session writer (``SessionServicer._replies``) over ``outbox`` to its end, on a real
    embedded control plane's session: the error it ends the stream with, or None (ended OK)."""
    from controlplane import api
    from controlplane.cli.serve_cmd import build_control_plane
    from controlplane.service.metrics import ServiceMetrics
    from controlplane.service.session_servicer import SessionServicer, _LiveSession

    from .conftest import worker_info

    metrics = ServiceMetrics()
    cp, notifier = build_control_plane(None, None, metrics)
    live = _LiveSession(cp.open_session(worker_info("w0")))
    try:
        list(SessionServicer(cp, metrics, 4, notifier, idle_check_s=0.05)._replies(live, outbox, _ActiveContext()))
    except api.Unavailable as exc:
        return exc
    finally:
        live.close()
        close = getattr(cp, "close", None)
        if callable(close):
            close()
    return None


NOTICE = "session replaced: a newer hello of worker 'w0' took it over"


@pytest.mark.parametrize("error", [True, False])
def test_a_full_outbox_still_ends_a_replaced_stream_with_its_status(error: bool) -> None:
    """Scenario: the replaced session's worker had stopped reading, so its stream's outbox was
    full when the newer hello came: the replacement notice (queued beside the wake-ups) was
    dropped, and the stream ended OK once drained -- the worker could not tell it was replaced.
    The notice is the outbox's end status now: after what was queued, the writer raises it
    (UNAVAILABLE, naming the replacement). Control: an outbox ended without one ends OK."""
    from controlplane import api
    from controlplane.service.session_servicer import _WAKE, _Outbox

    outbox = _Outbox(maxsize=2)
    outbox.offer(_WAKE)
    outbox.offer(_WAKE)
    assert outbox.queue.full()
    outbox.end(api.Unavailable(NOTICE) if error else None)
    ended = _writer_ends(outbox)
    assert (ended is not None and NOTICE in str(ended)) if error else ended is None


def test_a_replacement_between_the_idle_writers_reads_is_not_lost() -> None:
    """Scenario (review of session 81's fix): the idle writer read ``ended`` twice -- for the
    error, then to return -- and a replacement (``end(error)``) landing between the two reads
    ended the stream OK. Forced here: the replacement runs right after the writer's first read
    of ``ended``; the stream still ends UNAVAILABLE naming it."""
    from controlplane import api
    from controlplane.service.session_servicer import _Outbox

    outbox = _Outbox(maxsize=2)

    class RacyEnded(threading.Event):
        reads = 0

        def is_set(self) -> bool:
            value = super().is_set()
            RacyEnded.reads += 1
            if RacyEnded.reads == 1:  # the newer hello's thread runs here, between the reads
                replacement = threading.Thread(target=outbox.end, args=(api.Unavailable(NOTICE),))
                replacement.start()
                replacement.join()
            return value

    outbox.ended = RacyEnded()
    ended = _writer_ends(outbox)
    assert RacyEnded.reads >= 1 and ended is not None and NOTICE in str(ended)
