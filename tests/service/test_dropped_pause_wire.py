"""A dropped pause named over the wire: the real gRPC server and controller hold the request.

The worker reports ``pauses_dropped`` (proto field 10) in the report of the step the pause was
due for; the controller counts the request running at once and pauses another in its place, in
that report's answer (a control plane that plans inline). Control: the same report without the
name is answered with nothing (the pause is still awaited, a step of slack).
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc

from controlplane import api
from controlplane.embedded import EmbeddedControlPlane
from controlplane.service import convert
from controlplane.service.server import ServerConfig, create_server
from kvplane.v1 import controlplane_pb2 as pb
from kvplane.v1 import controlplane_pb2_grpc as pb_grpc
from tests.controlplane.test_controller_harness import worker_info


def report(step: int, paused_a: bool, dropped: tuple[str, ...] = ()) -> pb.WorkerMessage:
    running = (api.RequestState("a", 700 + step, 1 + step, 8.0, paused=paused_a),
               api.RequestState("b", 300 + step, 1 + step, 8.0))
    rep = api.StepReport(step=step, now_ms=10.0 * step, running=running, observed_step_ms=None,
                         pauses_dropped=dropped)
    return pb.WorkerMessage(report=convert.step_report_to_proto(rep))


def decisions(dropped: tuple[str, ...]) -> dict[int, list[api.Decision]]:
    """Report steps -> the decisions answering them, over a real server on port 0."""
    cp = EmbeddedControlPlane(synchronous=True)
    server, port = create_server("127.0.0.1:0", cp, ServerConfig(max_sessions=2, max_watchers=1))
    server.start()
    hello = pb.WorkerMessage(hello=convert.worker_info_to_proto(worker_info(budget_blocks=48, h2d_gbps=1.0)))

    def messages() -> Iterator[pb.WorkerMessage]:
        yield hello
        yield report(0, False)  # the first plan pauses 'a' (it does not fit beside 'b')
        yield report(1, False, dropped)  # due at step 1: dropped (named) or not shown yet
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            replies = list(pb_grpc.ControlPlaneStub(ch).Session(messages(), timeout=10))
    finally:
        server.stop(0.5)
        cp.close()
    return {r.report_step: [convert.decision_from_proto(d) for d in r.decisions] for r in replies if r.decisions}


def test_a_dropped_pause_named_in_a_report_is_held_at_once() -> None:
    got = decisions(("a",))
    assert [d.pause for d in got[0]] == [("a",)]
    assert [d.pause for d in got[1]] == [("b",)] and "a" in got[1][0].plan.placements


def test_control_unnamed_the_pause_is_still_awaited() -> None:
    got = decisions(())
    assert [d.pause for d in got[0]] == [("a",)] and 1 not in got
