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
A stop whose handler ran inside a finalizer (``__del__``, a ``weakref.finalize`` callback, where
Python prints an exception and drops it) is not lost: :func:`raise_if_stopped`, at every phase's
edges, raises it again.
"""

from __future__ import annotations

import contextlib
import math
import signal
import threading
import time
from collections.abc import Iterator
from types import FrameType
from typing import Any


class GpuCheckDeadline(BaseException):
    """The check's time is up (``--deadline-s``) or the process was told to stop (SIGTERM)."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


@contextlib.contextmanager
def deadline(seconds: float | None) -> Iterator[None]:
    """Raise :class:`GpuCheckDeadline` in this (the main) thread after ``seconds`` (None: never)
    or on SIGTERM, while the block runs; the previous handlers come back after it, and a timer
    armed before (pytest-timeout's) is re-armed for what was left of it."""
    if seconds is not None and not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"--deadline-s: {seconds} is out of range (allowed > 0)")
    if threading.current_thread() is not threading.main_thread():
        yield  # signals reach the main thread only (tests call the check from others)
        return

    def stop(signum: int, frame: FrameType | None) -> None:
        why = (f"--deadline-s {seconds:g} reached" if signum == signal.SIGALRM
               else f"stopped by signal {signal.Signals(signum).name}")
        if state["held"]:  # inside stop_deferred (or this block's own exit): later
            state["pending"] = state["pending"] or why
            return
        state["fired"] = state["fired"] or why  # raised again at a phase's edge if it is dropped
        raise GpuCheckDeadline(why)

    state: dict[str, Any] = {"held": 0, "pending": None, "fired": None}
    stop.state = state  # type: ignore[attr-defined]  # how stop_deferred finds it (the installed handler)
    old_term = signal.signal(signal.SIGTERM, stop)
    old_alarm = old_timer = None
    t0 = time.monotonic()
    if seconds is not None:
        old_alarm = signal.signal(signal.SIGALRM, stop)
        old_timer = signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        state["held"] += 1  # a stop arriving now is dropped, not raised inside this cleanup
        if seconds is not None:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old_alarm)
            if old_timer is not None and old_timer[0] > 0:  # what was left of the timer before
                signal.setitimer(signal.ITIMER_REAL, max(old_timer[0] - (time.monotonic() - t0), 1e-3),
                                 old_timer[1])
        signal.signal(signal.SIGTERM, old_term)


def _armed_state() -> dict[str, Any] | None:
    """The running :func:`deadline`'s state (via its installed handler), None outside one or off
    the main thread."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return getattr(signal.getsignal(signal.SIGTERM), "state", None)


def raise_if_stopped() -> None:
    """Raise a stop that was delivered but did not reach the check: its handler ran in a finalizer
    and Python dropped the exception (or a ``BaseException`` handler ate it). Nothing while a stop
    is held back (:func:`stop_deferred`) or outside :func:`deadline`."""
    state = _armed_state()
    if state is not None and not state["held"] and state["fired"]:
        raise GpuCheckDeadline(state["fired"])


@contextlib.contextmanager
def stop_deferred(drop: bool = False) -> Iterator[None]:
    """Hold a stop (``--deadline-s``, SIGTERM) back while the block runs; it is raised as the block
    ends (``drop``: forgotten instead -- the report being written after a first stop). At the
    Python level: the signal may land on any thread of the process (torch's, the driver's), but
    its handler runs in the main thread, which records it here instead of raising. Outside
    :func:`deadline` (no stop armed) it does nothing."""
    state = _armed_state()
    if state is None:
        yield
        return
    state["held"] += 1
    try:
        yield
    finally:
        state["held"] -= 1
        pending = state["pending"]
        if drop:
            state["pending"] = None
        elif pending is not None and not state["held"]:
            state["pending"] = None
            state["fired"] = state["fired"] or pending
            raise GpuCheckDeadline(pending)
