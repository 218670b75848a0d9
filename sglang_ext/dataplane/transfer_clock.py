"""TransferClock: how a transfer engine times its copies and its stream waits.

Primitives (all are called on the scheduler thread. None of them may wait for a device):

* ``start(kind, stream) -> token`` and ``stop(kind, token, stream)`` bracket one batched copy
  (``kind`` is ``h2d`` or ``d2h``; on CUDA the token marks the copy's own stream, after that stream
  has waited for what the copy is ordered after). With ``kind`` ``stall`` they bracket one stream
  wait of the compute stream. A None token means "not timed": ``stop`` ignores it.
* ``harvest()``: book what has been measured by now into :attr:`times`. It never blocks. The core
  calls it when a step is closed for the metrics.
* ``boundary()``: a step boundary (the core calls it at every one): ``harvest()``; and
  ``opened()``: the metrics closed a step. A clock that samples decides there whether the
  opening step is timed (:class:`EventClock`'s interval).

:class:`~sglang_ext.dataplane.wall_clock.WallClock` (the synchronous CPU engine) and
:class:`~sglang_ext.dataplane.event_clock.EventClock` (CUDA events) implement it, and both feed a
:class:`~sglang_ext.dataplane.transfer_times.TransferTimes`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from sglang_ext.dataplane.transfer_times import TransferTimes

STALL = "stall"
"""The ``kind`` of a compute-stream wait on transfer events."""
KINDS = ("h2d", "d2h", STALL)


class TransferClock(ABC):
    """Times copies and stream waits into :attr:`times` (module docstring)."""

    def __init__(self, times: TransferTimes | None = None) -> None:
        self.times = TransferTimes() if times is None else times
        """The account this clock feeds."""

    @abstractmethod
    def start(self, kind: str, stream: Any = None) -> Any:
        """Before a copy (``h2d`` / ``d2h``) or a compute-stream wait (``stall``): a token, or None."""

    @abstractmethod
    def stop(self, kind: str, token: Any, stream: Any = None, nbytes: int = 0) -> None:
        """After it, with ``start``'s token (None: not timed, nothing to do); ``nbytes``: what the
        copy moves (booked with its seconds)."""

    @abstractmethod
    def harvest(self) -> int:
        """Book what has completed into :attr:`times`, without blocking. Returns how many
        measurements were booked."""

    def boundary(self) -> int:
        """A step boundary: :meth:`harvest` (a sampling clock may also pick the step's timing)."""
        return self.harvest()

    def opened(self) -> None:  # noqa: B027 - nothing to do unless the clock samples
        """The account's step was closed and the next opened (a sampling clock picks its timing)."""
