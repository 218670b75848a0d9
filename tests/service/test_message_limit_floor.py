"""The smallest server message limit `kvplane serve` accepts (2 MiB) takes every report batch a
worker sends: the client batches queued reports up to 1 MiB without knowing the server's limit
(reviewer's finding: under a 64 KiB limit the batch was refused with RESOURCE_EXHAUSTED and the
stream dropped). Real server and client in-process; the real controller's report of step 2 is held
(as in test_slow_reports) so that reports queue up behind it.
"""

from __future__ import annotations

import threading

from controlplane.controller.session_controller import SessionController
from controlplane.service.client import REPORT_BATCH_MAX_BYTES
from controlplane.service.server import MIN_SERVE_MESSAGE_BYTES, ServerConfig

from .conftest import step_report, wait_until, worker_info

REPORTS = 40
"""Reports queued behind the held one: about 3.7 MB, several 1 MiB batches."""


def _queue_reports_behind_a_slow_one(serve, connect, monkeypatch, server_limit: int):  # noqa: ANN001, ANN202
    """A worker with 1,000 running requests (~90 KB a report) on a default client (batches up to
    1 MiB) against a server whose limit is ``server_limit``; the controller holds report 2 until
    ``REPORTS`` more have queued up, then lets go."""
    entered, release = threading.Event(), threading.Event()
    real = SessionController.report

    def slow(self, report):  # noqa: ANN001, ANN202
        if report.step == 2:
            entered.set()
            release.wait(20.0)
        return real(self, report)

    monkeypatch.setattr(SessionController, "report", slow)
    served = serve(ServerConfig(max_sessions=2, max_watchers=1, max_message_bytes=server_limit))
    session = connect(served.target).open_session(worker_info("w-floor"))
    assert session.wait_connected(10)
    running = {f"request-{i:05d}-{'x' * 16}": 3000 for i in range(1000)}
    session.report(step_report(1, running))
    session.report(step_report(2, running))
    assert entered.wait(10), "the slow report never started"
    for step in range(3, 3 + REPORTS):
        session.report(step_report(step, running))
    release.set()
    wait_until(
        lambda: session.stats.reconnects > 0 or served.metric("kvplane_reports_total") >= 2 + REPORTS, 30
    )
    return session, served


def test_the_smallest_accepted_limit_takes_full_report_batches(serve, connect, monkeypatch):
    """At 2 MiB (MIN_SERVE_MESSAGE_BYTES) batches of up to 1 MiB arrive on the one stream."""
    assert MIN_SERVE_MESSAGE_BYTES >= 2 * REPORT_BATCH_MAX_BYTES
    session, served = _queue_reports_behind_a_slow_one(serve, connect, monkeypatch, MIN_SERVE_MESSAGE_BYTES)
    assert session.stats.reconnects == 0 and session.stats.batches_sent >= 1, session.stats
    assert served.metric("kvplane_reports_total") >= 2 + REPORTS


def test_a_limit_below_the_floor_drops_the_stream(serve, connect, monkeypatch):
    """Control (why `kvplane serve` refuses such a limit, which it accepted before): at 512 KiB each
    ~90 KB report fits, but the same batches break the stream and the worker reconnects."""
    session, _ = _queue_reports_behind_a_slow_one(serve, connect, monkeypatch, 512 << 10)
    assert session.stats.reconnects >= 1, session.stats
