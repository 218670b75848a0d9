"""Fault tests: the service killed and restarted under streaming workers, vanished workers,
graceful stop. The server runs as a real `kvplane serve` subprocess where a crash is simulated."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import threading

import pytest

from controlplane.service.ports import free_ports

from .conftest import (
    ServeProcess,
    step_report,
    subprocess_env,
    wait_until,
    worker_info,
)


class StreamingWorker:
    """A simulated worker: a step loop reporting every `period_s`, keeping its last plan."""

    def __init__(self, client, name: str, period_s: float = 0.005) -> None:  # type: ignore[no-untyped-def]
        self.session = client.open_session(worker_info(name))
        self.period_s = period_s
        self.errors: list[BaseException] = []
        self.steps = 0
        self.plans_seen = 0
        self.plan = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                for d in self.session.report(step_report(self.steps, {f"{self.session.worker_id}-r": 500})):
                    self.plan = d.plan
                    self.plans_seen += 1
                self.steps += 1
                self._stop.wait(self.period_s)
        except BaseException as exc:  # the step loop must never see an exception
            self.errors.append(exc)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self.session.close()


@pytest.fixture
def serve_process(tmp_path):  # type: ignore[no-untyped-def]
    proc = ServeProcess(*free_ports(2), tmp_path / "serve.log")
    yield proc
    proc.kill()


def test_service_restart_workers_keep_plan_and_reconnect(serve_process, connect) -> None:  # type: ignore[no-untyped-def]
    """Kill -9 the service mid-stream: workers go degraded but keep their plan and loop; after restart they reconnect and get fresh decisions."""
    serve_process.start()
    client = connect(serve_process.target)
    workers = [StreamingWorker(client, f"fw{i}") for i in range(4)]
    try:
        assert wait_until(lambda: all(w.plan is not None for w in workers), 20)
        serve_process.kill()
        assert wait_until(lambda: all(w.session.degraded for w in workers), 10)
        plans_before = [w.plan for w in workers]
        steps_before = [w.steps for w in workers]
        assert wait_until(lambda: all(w.steps > s + 20 for w, s in zip(workers, steps_before, strict=True)), 10), "step loops stalled while the service was down"
        assert [w.plan for w in workers] == plans_before, "workers lost their last plan"
        seen_before = [w.plans_seen for w in workers]
        serve_process.start()
        assert wait_until(lambda: not any(w.session.degraded for w in workers), 20)
        assert wait_until(
            lambda: all(w.plans_seen > s for w, s in zip(workers, seen_before, strict=True)), 20
        ), "no fresh decision after reconnect"
        assert all(w.session.stats.reconnects >= 1 for w in workers)
        assert wait_until(lambda: serve_process.metric("kvplane_sessions") == len(workers), 10)
    finally:
        for w in workers:
            w.stop()
    assert not [e for w in workers for e in w.errors]


WORKER_SCRIPT = textwrap.dedent(
    """
    import sys, time
    from controlplane import api
    from controlplane.model import Hardware, ModelSpec, Profile
    from controlplane.service.client import GrpcControlPlane
    cp = GrpcControlPlane(sys.argv[1])
    info = api.WorkerInfo("doomed", ModelSpec(8, 16, 65536), Hardware(4000, 25.0), Profile((0.5,) * 8))
    s = cp.open_session(info)
    s.wait_connected(20)
    print("WORKER-READY", flush=True)
    sys.stdout = open("/dev/null", "w")
    step = 0
    while True:
        s.report(api.StepReport(step=step, now_ms=step * 10.0,
                 running=(api.RequestState("x", 300 + step),)))
        step += 1
        time.sleep(0.005)
    """
)


def test_vanished_worker_session_is_cleaned_up(served) -> None:  # type: ignore[no-untyped-def]
    """A worker process killed mid-stream has its session closed (sessions gauge back to 0)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", WORKER_SCRIPT, served.target],
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        assert proc.stdout is not None
        lines: list[bytes] = []
        # Client log lines come first, written by another thread: the marker may share a line
        # with one of them, so look for it inside lines.
        while not any(b"WORKER-READY" in line for line in lines) and len(lines) < 50:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line.strip())
        assert any(b"WORKER-READY" in line for line in lines), lines
        assert wait_until(lambda: served.metric("kvplane_sessions") == 1, 10)
        assert wait_until(lambda: served.metric("kvplane_reports_total") > 10, 10)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        assert wait_until(lambda: served.metric("kvplane_sessions") == 0, 15)
        assert wait_until(lambda: "doomed" not in served.control_plane.sessions(), 5)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_sigterm_stops_gracefully(serve_process, connect) -> None:  # type: ignore[no-untyped-def]
    """SIGTERM ends `kvplane serve` with exit code 0 and a server_stopped log line; workers go degraded, not down."""
    serve_process.start()
    client = connect(serve_process.target)
    worker = StreamingWorker(client, "graceful")
    try:
        assert wait_until(lambda: worker.plan is not None, 20)
        assert serve_process.terminate() == 0
        events = [json.loads(line)["event"] for line in serve_process.output().splitlines() if line.startswith("{")]
        assert "serving" in events and "server_stopped" in events
        assert wait_until(lambda: worker.session.degraded, 10)
    finally:
        worker.stop()
    assert not worker.errors
