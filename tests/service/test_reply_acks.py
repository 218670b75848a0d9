"""Which reports a reply answers (review of session 88). A worker's session counts a report as
answered once a reply carries its step or a later one, and degrades when one stays unanswered for
``stale_after_s``; so the server must ack every report it processed, also those after a reply's
step (a batch's later reports, or one read before the writer sent the decision), and the session
must not wedge when a worker's steps go back. The control plane behind the real server here is
scripted (it decides on report 2 only), so the order of replies is deterministic; the servicer,
gRPC and the worker's session are the real ones."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import grpc
import pytest

from controlplane import api
from controlplane.model import Plan
from controlplane.policy import Policy
from controlplane.service import convert
from controlplane.service.metrics import ServiceMetrics
from controlplane.service.server import ServerConfig, create_server
from kvplane.v1 import controlplane_pb2 as pb
from kvplane.v1 import controlplane_pb2_grpc as pb_grpc

from .conftest import step_report, worker_info


def _decision(step: int) -> api.Decision:
    plan = Plan(feasible=True, paused=(), placements={"a": (1,) * 8}, predicted_step_ms=4.0, window_steps=8,
                resident_blocks=1, staging_blocks=0, solver="scripted", solve_ms=0.1)
    return api.Decision(plan=plan, apply_at_step=step + 1, expiry_step=step + 9, reason="scripted")


class _Session:
    """Decides on report 2 only; report 3 takes 50 ms, so the writer, taking report 2's decision
    under the session's lock, finds report 3 processed too (the order a busy server sees)."""

    def report(self, report: api.StepReport) -> list[api.Decision]:
        if report.step == 3:
            time.sleep(0.05)
        return [_decision(report.step)] if report.step == 2 else []

    def close(self) -> None:
        pass


class _ControlPlane:
    def open_session(self, info: api.WorkerInfo) -> _Session:
        return _Session()

    def update_policy(self, changes: dict, actor: str = "local") -> Policy:  # type: ignore[type-arg]
        raise NotImplementedError

    def get_policy(self) -> Policy:
        return Policy()

    def close(self) -> None:
        pass


@pytest.fixture
def target() -> Iterator[str]:
    server, port = create_server("127.0.0.1:0", _ControlPlane(), ServerConfig(max_sessions=4, max_watchers=1),
                                 ServiceMetrics())
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(0)


def test_a_batchs_reports_after_the_decided_one_are_acked(target: str) -> None:
    """One ReportBatch [1, 2, 3], a decision on 2: a reply for step 2 goes out, and a heartbeat
    for step 3 within the writer's idle check (1 s). Before, the writer took the decision's reply
    as acking everything processed: step 3 was never acked while the worker stayed quiet."""
    stop = threading.Event()

    def messages() -> Iterator[pb.WorkerMessage]:
        yield pb.WorkerMessage(hello=convert.worker_info_to_proto(worker_info("w-batch")))
        batch = [convert.step_report_to_proto(step_report(s, {"a": 300})) for s in (1, 2, 3)]
        yield pb.WorkerMessage(reports=pb.ReportBatch(reports=batch))
        stop.wait(10)

    steps: list[tuple[int, int]] = []
    with grpc.insecure_channel(target) as channel:
        stream = pb_grpc.ControlPlaneStub(channel).Session(messages(), timeout=10)
        assert next(stream).session_id
        deadline = time.monotonic() + 4.0
        for reply in stream:
            steps.append((reply.report_step, len(reply.decisions)))
            if reply.report_step >= 3 or time.monotonic() > deadline:
                break
        stop.set()
        stream.cancel()
    assert steps[0] == (2, 1), steps  # control: the decided report's reply comes first
    assert steps[-1][0] == 3 and steps[-1][1] == 0, steps


def test_a_quiet_worker_after_a_decided_burst_is_not_degraded(target: str, connect) -> None:  # type: ignore[no-untyped-def]
    """Reports 1-3 (a decision on 2), then 1.6 s of quiet with ``stale_after_s`` 1.0: the next
    report must not find the session degraded (before the server fix it did, whenever report 3
    reached the server before the writer sent 2's decision: the worker then dropped its pauses
    and opened its own admission for a healthy control plane)."""
    session = connect(target).open_session(worker_info("w-quiet-burst"))
    session.stale_after_s = 1.0
    assert session.wait_connected(5)
    for step in (1, 2, 3):
        session.report(step_report(step, {"a": 300}))
    time.sleep(1.6)
    session.report(step_report(4, {"a": 300}))
    assert not session.degraded and session.stats.stale_periods == 0
    session.close()


def test_steps_that_go_back_do_not_wedge_the_session(target: str, connect) -> None:  # type: ignore[no-untyped-def]
    """A worker that counts its steps again from 0 on the same stream: once the replies answer
    the new steps, nothing older stays 'unanswered' (the queue starts over)."""
    session = connect(target).open_session(worker_info("w-back"))
    session.stale_after_s = 1.0
    assert session.wait_connected(5)
    for step in (50, 51, 52, 0, 1):
        session.report(step_report(step, {"a": 300}))
        time.sleep(0.05)
    time.sleep(2.4)  # the heartbeat acks step 1, the newest processed
    session.report(step_report(2, {"a": 300}))
    assert not session.degraded, list(session._unanswered)
    session.close()
