"""Worker sessions over a real gRPC server: isolation, decisions, validation, cleanup."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import grpc
import pytest

from controlplane import api
from controlplane.embedded import EmbeddedControlPlane
from controlplane.service import convert
from controlplane.service.server import ServerConfig, create_server
from kvplane.v1 import controlplane_pb2 as pb
from kvplane.v1 import controlplane_pb2_grpc as pb_grpc

from .conftest import step_report, wait_until, worker_info


def test_two_concurrent_workers_get_their_own_decisions(served, connect) -> None:  # type: ignore[no-untyped-def]
    """Two workers streaming at once each get decisions that place exactly their own requests."""
    results: dict[str, list[api.Decision]] = {}
    requests = {"a": {"a1": 300, "a2": 500}, "b": {"b1": 700}}

    def worker(name: str) -> None:
        client = connect(served.target)
        session = client.open_session(worker_info(f"worker-{name}"))
        assert session.wait_connected(10)
        got: list[api.Decision] = []
        step = 0

        def more() -> bool:
            nonlocal step
            got.extend(session.report(step_report(step, requests[name])))
            step += 1
            return bool(got)

        wait_until(more, 20.0, 0.01)
        results[name] = got
        session.close()

    threads = [threading.Thread(target=worker, args=(n,)) for n in requests]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for name, reqs in requests.items():
        assert results.get(name), f"worker {name} got no decision"
        for d in results[name]:
            assert set(d.plan.placements) | set(d.plan.paused) | set(d.pause) <= set(reqs)
        assert set(results[name][-1].plan.placements) | set(results[name][-1].pause) == set(reqs)
    assert wait_until(lambda: served.metric("kvplane_sessions") == 0, 10)


def test_decisions_are_pushed_without_a_further_report(served, client) -> None:  # type: ignore[no-untyped-def]
    """A plan finished between reports reaches the worker without it sending another report."""
    session = client.open_session(worker_info("pusher"))
    assert session.wait_connected(10)
    session.report(step_report(0, {"r1": 400}))
    assert wait_until(lambda: session.stats.decisions_received >= 1, 10)
    assert session.stats.reports_sent == 1
    assert session.last_decision is not None
    assert "r1" in session.last_decision.plan.placements
    assert session.stats.latencies_ms, "the pushed decision's latency was measured"


def test_poll_hands_over_a_pushed_decision_without_a_report(served, client) -> None:  # type: ignore[no-untyped-def]
    """The worker's step boundary polls every step: a decision pushed between reports is
    handed over by poll() once (then poll is empty), and the next report does not repeat it."""
    session = client.open_session(worker_info("poller"))
    assert session.wait_connected(10)
    assert session.poll() == []  # nothing yet
    # report() queues the report and returns at once: the plan for it cannot be back yet
    assert session.report(step_report(0, {"r1": 400})) == []
    got: list[api.Decision] = []
    assert wait_until(lambda: bool(got.extend(session.poll()) or got), 10)
    assert "r1" in got[0].plan.placements and session.stats.reports_sent == 1
    assert session.poll() == []
    assert got[-1] is session.last_decision


def test_close_delivers_reports_still_queued(served, client) -> None:  # type: ignore[no-untyped-def]
    """close() right after a burst: the server reads every queued report and the worker gets
    every decision the server sent (graceful half-close, not a cancel)."""
    session = client.open_session(worker_info("burst"))
    assert session.wait_connected(10)
    for step in range(800):  # queued far faster than the server reads them
        session.report(step_report(step, {f"r{step // 10}": 300 + step}))
    session.close(drain_s=60.0)
    assert session.stats.reports_sent == 800
    assert served.metric("kvplane_reports_total") == 800
    assert session.stats.decisions_received == session.stats.decisions_announced > 0
    assert served.metric("kvplane_decisions_total") == session.stats.decisions_received


def test_session_must_start_with_hello(channel) -> None:  # type: ignore[no-untyped-def]
    """A stream whose first message is a report ends with INVALID_ARGUMENT naming `hello`."""
    stub = pb_grpc.ControlPlaneStub(channel)
    call = stub.Session(iter([pb.WorkerMessage(report=pb.StepReport(step=0))]), timeout=10)
    with pytest.raises(grpc.RpcError) as info:
        list(call)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith("hello:")


def test_bad_hello_names_field_and_range(channel) -> None:  # type: ignore[no-untyped-def]
    """A hello with model.layers = 0 gets INVALID_ARGUMENT naming hello.model.layers and its range."""
    hello = convert.worker_info_to_proto(worker_info("bad"))
    hello.model.layers = 0
    stub = pb_grpc.ControlPlaneStub(channel)
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Session(iter([pb.WorkerMessage(hello=hello)]), timeout=10))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "hello.model.layers" in info.value.details()
    assert "[1, 4096]" in info.value.details()


def test_bad_report_names_field_and_closes_session(served, channel) -> None:  # type: ignore[no-untyped-def]
    """A report with context_tokens = -4 ends the stream with INVALID_ARGUMENT naming the field."""
    stub = pb_grpc.ControlPlaneStub(channel)
    bad = pb.StepReport(step=1, now_ms=1.0)
    bad.running.add(id="r", context_tokens=-4)
    msgs = [
        pb.WorkerMessage(hello=convert.worker_info_to_proto(worker_info("v"))),
        pb.WorkerMessage(report=bad),
    ]
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Session(iter(msgs), timeout=10))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith("report.running[0].context_tokens: -4 is out of range")
    assert wait_until(lambda: served.metric("kvplane_sessions") == 0, 10)


def test_max_sessions_is_enforced_with_clear_status(serve, connect) -> None:  # type: ignore[no-untyped-def]
    """Beyond max_sessions a new stream gets RESOURCE_EXHAUSTED naming max_sessions."""
    s = serve(ServerConfig(max_sessions=2, max_watchers=1))
    client = connect(s.target)
    sessions = [client.open_session(worker_info(f"m{i}")) for i in range(2)]
    assert all(x.wait_connected(10) for x in sessions)
    stub = pb_grpc.ControlPlaneStub(grpc.insecure_channel(s.target))
    hello = pb.WorkerMessage(hello=convert.worker_info_to_proto(worker_info("m-extra")))
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Session(iter([hello]), timeout=10))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "max_sessions" in info.value.details()
    sessions[0].close()
    assert wait_until(lambda: s.metric("kvplane_sessions") == 1, 10)
    late = client.open_session(worker_info("m-late"))
    assert late.wait_connected(10), "a freed slot is usable again"


def test_client_session_never_raises_while_server_unreachable(connect) -> None:  # type: ignore[no-untyped-def]
    """With no server, report() returns [] at once and the session says it is degraded."""
    from controlplane.service.ports import free_port

    client = connect(f"grpc://127.0.0.1:{free_port()}")
    session = client.open_session(worker_info("lonely"))
    for step in range(50):
        assert session.report(step_report(step, {"r": 100})) == []
    assert session.degraded
    assert client.metrics.registry.get_sample_value("kvplane_client_degraded", {"worker": "lonely"}) == 1
    assert session.stats.reports_dropped == 49  # only the newest is kept for the reconnect
    session.close()


def test_slow_and_hung_workers_do_not_affect_others(served, connect, channel) -> None:  # type: ignore[no-untyped-def]
    """A worker that never reads its replies and one that goes silent after hello leave a third worker's decisions flowing."""
    import queue as queue_mod

    stub = pb_grpc.ControlPlaneStub(channel)
    # Hung worker: hello, then nothing (its request iterator blocks forever).
    hung_q: queue_mod.Queue[object] = queue_mod.Queue()
    hung_q.put(pb.WorkerMessage(hello=convert.worker_info_to_proto(worker_info("hung"))))
    hung = stub.Session(iter(hung_q.get, None))

    # Slow worker: floods reports that each change its batch and never reads a reply.
    def flood():  # type: ignore[no-untyped-def]
        yield pb.WorkerMessage(hello=convert.worker_info_to_proto(worker_info("slow")))
        for step in range(3000):
            yield pb.WorkerMessage(
                report=convert.step_report_to_proto(step_report(step, {f"s{step}": 300, f"t{step}": 500}))
            )

    slow = stub.Session(flood())  # replies are never consumed
    assert wait_until(lambda: served.metric("kvplane_sessions") == 2, 10)
    assert wait_until(lambda: served.metric("kvplane_reports_total") >= 500, 20)

    client = connect(served.target)
    healthy = client.open_session(worker_info("healthy"))
    assert healthy.wait_connected(10)
    got: list[api.Decision] = []
    step = 0

    def progress() -> bool:
        nonlocal step
        got.extend(healthy.report(step_report(step, {f"h{step // 5}": 400})))
        step += 1
        return len(got) >= 5

    assert wait_until(progress, 20, every_s=0.01), f"healthy worker got {len(got)} decisions"
    assert all(set(d.plan.placements) <= {f"h{i}" for i in range(step)} for d in got)
    hung.cancel()
    slow.cancel()
    healthy.close()
    assert wait_until(lambda: served.metric("kvplane_sessions") == 0, 15)


def _good_then_bad(worker: str) -> list[pb.WorkerMessage]:
    """Hello, then one ReportBatch: a report admitting a request (the controller decides on it at
    once), then a report with context_tokens = -4."""
    good = convert.step_report_to_proto(step_report(0, {f"{worker}-r": 500}))
    bad = pb.StepReport(step=1, now_ms=10.0)
    bad.running.add(id=f"{worker}-r", context_tokens=-4)
    return [
        pb.WorkerMessage(hello=convert.worker_info_to_proto(worker_info(worker))),
        pb.WorkerMessage(reports=pb.ReportBatch(reports=[good, bad])),
    ]


def _replies_until_error(call) -> tuple[list[pb.SessionReply], grpc.RpcError]:  # type: ignore[no-untyped-def]
    replies: list[pb.SessionReply] = []
    try:
        for reply in call:
            replies.append(reply)
    except grpc.RpcError as exc:
        return replies, exc
    raise AssertionError(f"the stream ended without an error after {len(replies)} replies")


@pytest.fixture
def sync_served() -> Iterator[str]:
    """A real server on port 0 fronting a control plane that plans inline (``synchronous``): a
    report's decision is in that report's answer, so which reports of a batch decided is certain."""
    cp = EmbeddedControlPlane(synchronous=True)
    server, port = create_server("127.0.0.1:0", cp, ServerConfig(max_sessions=4, max_watchers=1))
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(0.5)
    cp.close()


def _session_replies(target: str, messages: list[pb.WorkerMessage]) -> tuple[list[pb.SessionReply], grpc.RpcError]:
    with grpc.insecure_channel(target) as ch:
        return _replies_until_error(pb_grpc.ControlPlaneStub(ch).Session(iter(messages), timeout=10))


def test_bad_report_in_a_batch_keeps_the_decisions_before_it(sync_served) -> None:  # type: ignore[no-untyped-def]
    """A ReportBatch whose second report is invalid: the decision the first one produced (the
    controller now counts it delivered) still reaches the worker, then the stream ends with
    INVALID_ARGUMENT naming the bad entry."""
    replies, error = _session_replies(sync_served, _good_then_bad("gb"))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details().startswith("reports.reports[1].running[0].context_tokens: -4 is out of range")
    decided = [r for r in replies if r.decisions]  # the first reply only acknowledges the hello
    assert [r.report_step for r in decided] == [0]
    assert len(decided[0].decisions) == 1 and "gb-r" in decided[0].decisions[0].plan.placements


def test_bad_first_report_in_a_batch_sends_nothing(sync_served) -> None:  # type: ignore[no-untyped-def]
    """Control for the test above: with the invalid report first, no decision goes out (the one
    above is the first report's, not an artefact of the stream's end)."""
    msgs = _good_then_bad("bg")
    batch = msgs[1].reports.reports
    first = pb.StepReport()
    first.CopyFrom(batch[1])
    first.step = 0
    del batch[:]
    batch.append(first)
    replies, error = _session_replies(sync_served, msgs)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details().startswith("reports.reports[0].running[0].context_tokens")
    assert len(replies) == 1 and replies[0].session_id and not replies[0].decisions  # the hello's


def test_a_hello_that_replaces_a_live_session_is_counted(served, connect, channel) -> None:  # type: ignore[no-untyped-def]
    """Without TLS a second hello with a live worker id replaces that session (a reconnect looks
    the same); it is counted in kvplane_sessions_replaced (and logged with both peers), so two
    workers sharing one id show up. Control: a hello after the id's session closed is not."""
    name = "kvplane_sessions_replaced_total"
    solo = connect(served.target).open_session(worker_info("solo"))
    assert solo.wait_connected(10)
    solo.close()
    assert wait_until(lambda: served.metric("kvplane_sessions") == 0, 10)
    again = connect(served.target).open_session(worker_info("solo"))
    assert again.wait_connected(10)
    assert served.metric(name) == 0  # the old session was gone: nothing replaced
    hello = pb.WorkerMessage(hello=convert.worker_info_to_proto(worker_info("solo")))
    call = pb_grpc.ControlPlaneStub(channel).Session(iter([hello]), timeout=10)
    assert next(call).session_id  # took the id over from the live session
    assert served.metric(name) >= 1
    call.cancel()
    again.close()
