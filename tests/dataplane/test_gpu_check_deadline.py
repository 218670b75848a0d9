"""`kvplane gpu-check --deadline-s`: a check stopped before its end (its deadline, or SIGTERM from
the GPU host's command limit) still writes its report, with what finished and a failed
``deadline`` figure naming where it stopped; an unstopped check has neither."""

from __future__ import annotations

import json
import os
import signal

import pytest

from kvplane.cli import main
from sglang_ext.tools import gpu_check_overlap
from sglang_ext.tools.gpu_check_deadline import GpuCheckDeadline, deadline

QUICK = ["gpu-check", "--device", "cpu", "--skip-tests", "--repeat", "1"]
BASE_KEYS = {"step_ms.resident", "step_ms.placed", "stall_rel_err", "kvplane_cpu_share",
             "host_syncs_per_step.kvplane", "transfer_events.h2d_gbps"}
"""Figures of the core check's base measurements (before its overlap phase)."""


def _report(tmp_path):
    [path] = tmp_path.glob("gpu-check-cpu-*.json")
    body = json.loads(path.read_text())
    assert (path.with_suffix(".md")).exists()
    return body, {f["key"]: f for f in body["figures"]}


def test_a_sigterm_inside_the_core_check_writes_what_it_measured(tmp_path, monkeypatch):
    """SIGTERM in the overlap phase (what the host's `timeout` sends): the base measurements'
    figures are reported, the overlap, recompute, graph, turnover and extend phases' are not, and
    the failed ``deadline`` figure names the stage; the signal handler is restored after."""
    def stop_here(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        os.kill(os.getpid(), signal.SIGTERM)
        raise AssertionError("the signal was not delivered")

    monkeypatch.setattr(gpu_check_overlap.OverlapCheck, "run", stop_here)
    before = signal.getsignal(signal.SIGTERM)
    assert main([*QUICK, "--out-dir", str(tmp_path)]) == 1
    assert signal.getsignal(signal.SIGTERM) is before
    body, figs = _report(tmp_path)
    assert body["status"] == "FAIL"
    assert figs["deadline"]["status"] == "FAIL"
    assert figs["deadline"]["note"].startswith("stopped by signal SIGTERM after ")
    assert "in the served-core measurements (CoreCheck)" in figs["deadline"]["note"]
    assert BASE_KEYS <= set(figs), sorted(figs)
    assert not any(k.startswith(("overlap.", "graph.", "recompute_", "turnover.", "extend.")) for k in figs)
    assert body["details"]["stopped"]["stage"] == "the served-core measurements (CoreCheck)"
    assert body["details"]["resident_step_ms"] > 0  # the details measured before the stop
    assert "transfer_events" in body["details"]  # ...and those the base figures' build writes


def test_the_deadline_stops_a_running_check_and_the_report_is_written(tmp_path):
    """A deadline far shorter than the run (the dry run takes seconds): it stops, says where."""
    assert main([*QUICK, "--deadline-s", "0.2", "--out-dir", str(tmp_path)]) == 1
    body, figs = _report(tmp_path)
    note = figs["deadline"]["note"]
    assert note.startswith("--deadline-s 0.2 reached after "), note
    assert body["details"]["stopped"]["why"] == "--deadline-s 0.2 reached"
    assert body["details"]["stopped"]["stage"] in note


def test_a_deadline_that_is_not_reached_changes_nothing(tmp_path):
    """Control: the whole dry run under a generous deadline passes, with no deadline figure and
    no stop in the details; a timer armed before (here pytest-timeout's, or the test's own) gets
    its handler and what was left of it back."""
    fired = []
    own = signal.getitimer(signal.ITIMER_REAL)[0] == 0
    if own:  # no pytest-timeout timer: arm one, as it would
        previous = signal.signal(signal.SIGALRM, lambda *_: fired.append(True))
        signal.setitimer(signal.ITIMER_REAL, 500.0)
    handler, (left, _) = signal.getsignal(signal.SIGALRM), signal.getitimer(signal.ITIMER_REAL)
    try:
        assert main([*QUICK, "--deadline-s", "600", "--out-dir", str(tmp_path)]) == 0
        body, figs = _report(tmp_path)
        assert "deadline" not in figs and "stopped" not in body["details"]
        assert BASE_KEYS <= set(figs) and any(k.startswith("overlap.") for k in figs)
        assert signal.getsignal(signal.SIGALRM) is handler
        assert 0 < signal.getitimer(signal.ITIMER_REAL)[0] < left
    finally:
        if own:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
    assert not fired


@pytest.mark.parametrize("value", ["0", "-5", "nan", "inf"])
def test_a_bad_deadline_is_refused_naming_the_flag(value, tmp_path):
    with pytest.raises(SystemExit) as info:
        main([*QUICK, "--deadline-s", value, "--out-dir", str(tmp_path)])
    assert str(info.value) == f"kvplane gpu-check: --deadline-s: {float(value)} is out of range (allowed > 0)"
    assert not list(tmp_path.iterdir())


def test_the_stop_is_not_an_exception_a_guarded_phase_swallows():
    """The phases catch ``Exception`` to keep the others' figures; the stop must pass through."""
    assert not issubclass(GpuCheckDeadline, Exception)
    with pytest.raises(GpuCheckDeadline, match="reached"), deadline(0.05):
        try:
            signal.pause()
        except Exception:  # noqa: BLE001 - what a guarded phase does
            pytest.fail("the stop was caught as an Exception")


def test_a_stop_during_a_capture_waits_for_its_end():
    """What a CUDA graph capture runs under (``CudaGraph.capture``): the deadline passes inside
    the block, which still completes; the stop arrives right after it. Control: the same sleep
    outside the block is cut short."""
    import time

    from sglang_ext.tools.gpu_check_deadline import stop_deferred

    finished = []
    t0 = time.perf_counter()
    with pytest.raises(GpuCheckDeadline), deadline(0.05):
        with stop_deferred():
            time.sleep(0.3)
            finished.append(True)
        time.sleep(5)  # not reached: the stop was pending
    assert finished == [True] and time.perf_counter() - t0 < 2  # the 5 s sleep never ran
    t0 = time.perf_counter()
    with pytest.raises(GpuCheckDeadline), deadline(0.05):
        time.sleep(5)
    assert time.perf_counter() - t0 < 2


def test_a_stop_delivered_to_another_thread_still_waits_for_the_block():
    """The signal goes to the process: with other threads running (torch's, the driver's), the
    kernel may hand it to any of them; the block still completes and the stop follows it."""
    import threading
    import time

    from sglang_ext.tools.gpu_check_deadline import stop_deferred

    running = threading.Event()
    done = threading.Event()

    def spin() -> None:  # a thread that does not block the signal (created outside the block)
        running.set()
        while not done.is_set():
            sum(range(1000))

    worker = threading.Thread(target=spin, daemon=True)
    worker.start()
    running.wait(5)
    finished = []
    try:
        with pytest.raises(GpuCheckDeadline, match="SIGTERM"), deadline(None):
            with stop_deferred():
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.3)
                finished.append(True)
    finally:
        done.set()
        worker.join(5)
    assert finished == [True]


def test_a_second_stop_while_the_report_is_written_is_dropped(tmp_path, monkeypatch):
    """A stop, then another one during the report's writing (the host's `timeout` repeating
    itself): the report is written all the same."""
    from sglang_ext.tools import gpu_check_report

    write = gpu_check_report.GpuCheckReport.write

    def write_twice_stopped(self, out_dir):  # noqa: ANN001, ANN202
        os.kill(os.getpid(), signal.SIGTERM)
        return write(self, out_dir)

    def stop_here(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(gpu_check_overlap.OverlapCheck, "run", stop_here)
    monkeypatch.setattr(gpu_check_report.GpuCheckReport, "write", write_twice_stopped)
    assert main([*QUICK, "--out-dir", str(tmp_path)]) == 1
    _, figs = _report(tmp_path)
    assert figs["deadline"]["status"] == "FAIL"
