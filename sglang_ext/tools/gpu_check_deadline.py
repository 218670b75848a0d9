"""``kvplane gpu-check --deadline-s``: stop the check in time to write what it measured.

A lent GPU runs one command under a hard limit; a check killed at that limit leaves no report,
only its log. Under :func:`deadline` the check's main thread gets :class:`GpuCheckDeadline` when
``seconds`` have passed (``SIGALRM``) or when the process is asked to stop (``SIGTERM``, what
``timeout`` sends first), wherever it is; ``gpu_check`` then writes the report with the figures
of the phases that finished and the details measured so far, and one failed ``deadline`` figure
naming the phase it stopped in.

:class:`GpuCheckDeadline` is a ``BaseException``: the guarded phases catch ``Exception`` (a phase
that raises keeps the others' figures) and must not swallow the stop. A pytest child running the
``gpu`` tests is killed by ``subprocess.run`` as the exception passes through it. Python handles
the signal between bytecodes: a long CUDA call (a synchronise) returns first. A CUDA graph capture
runs under :func:`stop_deferred`: a stop inside it would end the capture with an error of its own
(which then replaces the stop, and a guarded phase swallows that); the stop arrives after it.
"""

from __future__ import annotations

import contextlib
import math
import signal
import threading
from collections.abc import Iterator
from types import FrameType


class GpuCheckDeadline(BaseException):
    """The check's time is up (``--deadline-s``) or the process was told to stop (SIGTERM)."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


@contextlib.contextmanager
def deadline(seconds: float | None) -> Iterator[None]:
    """Raise :class:`GpuCheckDeadline` in this (the main) thread after ``seconds`` (None: never)
    or on SIGTERM, while the block runs; the previous handlers come back after it."""
    if seconds is not None and not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"--deadline-s: {seconds} is out of range (allowed > 0)")
    if threading.current_thread() is not threading.main_thread():
        yield  # signals reach the main thread only (tests call the check from others)
        return

    def stop(signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGALRM:
            raise GpuCheckDeadline(f"--deadline-s {seconds:g} reached")
        raise GpuCheckDeadline(f"stopped by signal {signal.Signals(signum).name}")

    old_term = signal.signal(signal.SIGTERM, stop)
    old_alarm = signal.signal(signal.SIGALRM, stop) if seconds is not None else None
    if seconds is not None:
        signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        if seconds is not None:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old_alarm)
        signal.signal(signal.SIGTERM, old_term)


@contextlib.contextmanager
def stop_deferred() -> Iterator[None]:
    """Hold a stop (SIGALRM, SIGTERM) back while the block runs, in the main thread; it arrives
    as soon as the block ends."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM, signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
