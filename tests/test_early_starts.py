"""EarlyStarts (the suite's set-ups started at the end of collection): order, results, errors,
the shared value made once, close() stopping what was started, and the jobs' lower priority --
each with its control."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from sglang_ext.testing.early_starts import NICE, EarlyStarts


def test_jobs_run_one_at_a_time_in_submission_order_and_results_are_taken_by_name():
    early = EarlyStarts()
    order: list[str] = []
    running = threading.Semaphore(1)

    def job(name: str) -> str:
        assert running.acquire(blocking=False), "two jobs ran at once"
        time.sleep(0.02)
        order.append(name)
        running.release()
        return name.upper()

    for name in ("a", "b", "c"):
        early.submit(name, lambda name=name: job(name))
    assert early.take("c", timeout_s=10) == "C"
    assert order == ["a", "b", "c"]
    assert early.take("a") == "A" and early.take("b") == "B"
    assert early.take("never") is None
    with pytest.raises(ValueError, match="already submitted"):
        early.submit("a", lambda: None)
    early.close()


def test_a_jobs_exception_reaches_the_taker_and_the_next_job_still_runs():
    early = EarlyStarts()
    early.submit("bad", lambda: (_ for _ in ()).throw(RuntimeError("server did not start")))
    early.submit("good", lambda: 1)
    with pytest.raises(RuntimeError, match="server did not start"):
        early.take("bad")
    assert early.take("good") == 1  # control: the worker survived the failure
    early.close()


def test_shared_is_made_once_for_every_caller_even_from_two_threads():
    early = EarlyStarts()
    made: list[int] = []
    got: list[int] = []
    entered, gate = threading.Event(), threading.Event()

    def make() -> int:
        entered.set()
        assert gate.wait(10)
        made.append(1)
        return 42

    early.submit("job", lambda: early.shared("model", make))
    assert entered.wait(10)  # the job is inside make(): the value is being made
    other = threading.Thread(target=lambda: got.append(early.shared("model", make)))
    other.start()
    gate.set()
    other.join(10)
    assert early.take("job") == 42 and made == [1] and got == [42]  # made once; the other caller got it
    other_made: list[int] = []
    assert early.shared("other", lambda: other_made.append(1) or 7) == 7 and other_made == [1]  # control
    with pytest.raises(ZeroDivisionError):
        early.shared("broken", lambda: 1 // 0)
    with pytest.raises(ZeroDivisionError):  # the same error again, not a second make()
        early.shared("broken", lambda: 3)
    early.close()


def test_close_cancels_queued_jobs_stops_what_the_running_one_waits_for_then_runs_the_rest():
    """The running job's cleanup (registered before its wait) runs first and ends its wait; the
    queued job never runs; a cleanup the job registers after that runs once it has finished."""
    early = EarlyStarts()
    stopped: list[str] = []
    ran: list[str] = []
    started, release = threading.Event(), threading.Event()

    def slow() -> None:
        early.cleanup(lambda: (stopped.append("slow"), release.set()))
        started.set()
        released = release.wait(30)
        early.cleanup(lambda: stopped.append("late"))
        ran.append(f"slow released={released}")

    early.cleanup(lambda: stopped.append("first"))
    early.submit("slow", slow)
    early.submit("queued", lambda: ran.append("queued"))
    assert started.wait(10)
    t0 = time.monotonic()
    early.close()
    assert ran == ["slow released=True"]  # its wait ended by the cleanup, not by its 30 s timeout
    assert time.monotonic() - t0 < 20
    assert stopped == ["slow", "first", "late"]
    with pytest.raises(RuntimeError, match="closed"):
        early.submit("late", lambda: None)


def test_a_failing_cleanup_does_not_skip_the_others_and_is_raised():
    early = EarlyStarts()
    stopped: list[str] = []
    early.cleanup(lambda: stopped.append("a"))
    early.cleanup(lambda: 1 // 0)
    early.cleanup(lambda: stopped.append("c"))
    with pytest.raises(ZeroDivisionError):
        early.close()
    assert stopped == ["c", "a"]


def child_nice() -> int:
    """The niceness of a process started from the calling thread."""
    out = subprocess.run([sys.executable, "-c", "import os; print(os.nice(0))"], capture_output=True, text=True,
                         check=True)
    return int(out.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice is Linux's")
def test_jobs_and_the_processes_they_start_run_niced_while_the_caller_keeps_its_priority():
    """The worker thread runs at nice >= NICE and its child processes inherit it; the calling
    thread's own niceness is untouched. Control: ``nice=0`` leaves the jobs at the caller's."""
    base = os.getpriority(os.PRIO_PROCESS, 0)
    if base >= NICE:
        pytest.skip(f"the test process already runs at nice {base}: niced and control jobs would agree")
    early = EarlyStarts()
    early.submit("own", lambda: os.getpriority(os.PRIO_PROCESS, 0))
    early.submit("child", child_nice)
    assert early.take("own", timeout_s=30) == max(NICE, base)
    assert early.take("child", timeout_s=30) == max(NICE, base)
    early.close()
    assert os.getpriority(os.PRIO_PROCESS, 0) == base
    assert child_nice() == base

    control = EarlyStarts(nice=0)
    control.submit("child", child_nice)
    assert control.take("child", timeout_s=30) == base
    control.close()
