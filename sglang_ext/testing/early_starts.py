"""EarlyStarts: slow test set-ups started at the end of collection, beside the suite's first tests.

Test-harness only. A few of the suite's set-ups must start fresh processes on purpose -- the demo
(the product's own command), the one layered server started as ``python -m
sglang.launch_server`` -- and each takes ~50 s on the 2-core CI host, almost all of it imports
on one core while the other idles. Started when collection ends, one after another on a worker
thread, they run while the first (single-threaded) tests take the other core, and their tests
find them ready::

    early = EarlyStarts()
    early.submit("demo", lambda: run_demo(...))
    ...
    result = early.take("demo")   # waits; re-raises the job's exception; None if never submitted
    early.close()                 # queued jobs cancelled, cleanups run (newest first)

The jobs call the fixtures' own start-up code, with the session's environment as it was when
collection ended (the tests that run meanwhile change ``os.environ``); what differs is when they
run, and that the suite's first tests share the host with them -- at a lower priority: the worker
thread runs at nice :data:`NICE` (on Linux a thread's own; the processes and threads it starts
inherit it, e.g. a tokenizer's thread pool first used by a job), so the foreground tests, some of
which bound wall-clock times, get a core first.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")

NICE = 10
"""The jobs' niceness (at least; a worker already nicer keeps its own)."""


def lower_priority(nice: int) -> None:
    """Make the calling thread (and what it starts) at least ``nice``: Linux keeps a nice value
    per thread (``setpriority(2)``, "a caveat"), so ``PRIO_PROCESS, 0`` is this thread only.
    Elsewhere that would be the whole process: nothing is done there, nor when the call fails
    (the jobs then run at the caller's priority; a failed initializer would break the pool)."""
    if nice <= 0 or not sys.platform.startswith("linux"):
        return
    try:
        os.setpriority(os.PRIO_PROCESS, 0, max(nice, os.getpriority(os.PRIO_PROCESS, 0)))
    except OSError:
        pass


class EarlyStarts:
    """Jobs run in submission order on one worker thread; results taken by name."""

    def __init__(self, env: Mapping[str, str] | None = None, nice: int = NICE) -> None:
        self.env: dict[str, str] = dict(os.environ if env is None else env)
        """The environment the jobs' processes start with: the session's when it was made (at
        the end of collection); the tests running meanwhile may change ``os.environ``."""
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="early-start",
                                        initializer=lower_priority, initargs=(nice,))
        self._jobs: dict[str, Future[Any]] = {}
        self._shared: dict[str, Future[Any]] = {}
        self._cleanups: list[Callable[[], object]] = []
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, name: str, job: Callable[[], object]) -> None:
        """Queue ``job`` under ``name`` (a name is submitted once)."""
        with self._lock:
            if self._closed:
                raise RuntimeError("EarlyStarts is closed")
            if name in self._jobs:
                raise ValueError(f"early start {name!r} already submitted")
            self._jobs[name] = self._pool.submit(job)

    def take(self, name: str, timeout_s: float | None = None) -> Any:
        """The result of job ``name`` (waiting for it; its exception re-raised), or None if no
        job of that name was submitted."""
        future = self._jobs.get(name)
        return None if future is None else future.result(timeout_s)

    def shared(self, name: str, make: Callable[[], T]) -> T:
        """``make()``'s result, made once by whichever thread asks first (a fixture or a job);
        other callers wait for it. Its exception is re-raised to every caller."""
        with self._lock:
            future = self._shared.get(name)
            mine = future is None
            if mine:
                future = self._shared[name] = Future()
        assert future is not None
        if mine:
            try:
                future.set_result(make())
            except BaseException as exc:
                future.set_exception(exc)
        return future.result()

    def cleanup(self, fn: Callable[[], object]) -> None:
        """Run ``fn`` at :meth:`close` (newest first). A job registers how to stop a process as
        soon as it has one, before waiting for it: a session that ends while the job waits stops
        the process, and the job's wait ends with it."""
        with self._lock:
            self._cleanups.append(fn)

    def close(self) -> None:
        """Cancel the jobs not started; run the cleanups registered so far (which stop what a
        running job is waiting for); wait for that job; run the cleanups it registered since.
        Each runs once; an exception in one does not skip the others (the first is re-raised)."""
        with self._lock:
            self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)
        first = self._run_cleanups()
        self._pool.shutdown(wait=True)
        first = self._run_cleanups() or first
        if first is not None:
            raise first

    def _run_cleanups(self) -> BaseException | None:
        with self._lock:
            cleanups, self._cleanups = self._cleanups[::-1], []
        first: BaseException | None = None
        for fn in cleanups:
            try:
                fn()
            except BaseException as exc:  # noqa: BLE001 - every cleanup runs; the first error is raised
                first = first or exc
        return first
