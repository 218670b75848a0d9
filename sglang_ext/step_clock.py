"""StepClock: a scheduler step's wall time, paired by order under SGLang's overlap loop.

Without the overlap loop a step is ``run_batch`` then ``process_batch_result``, and its time is
the span between them. SGLang's overlap loop launches step k+1 before it processes step k, so the
span of step k is from its launch or the end of step k-1's processing, whichever is later, to the
end of its own processing: while the scheduler is busy, the gap between consecutive results --
the time between two tokens of a request, which is what the controller's TBT model predicts
(OrbitFlow §3.4, profile refresh). Without overlap, step k-1's processing always ended before
step k's launch, so the same rule gives the plain span.
"""

from __future__ import annotations

import time
from collections import deque

MAX_IN_FLIGHT = 4
"""Launches kept unpaired (SGLang's overlap loop has one in flight)."""


class StepClock:
    """One :meth:`launched` per ``run_batch``, one :meth:`processed` per ``process_batch_result``,
    in the same order."""

    def __init__(self) -> None:
        self._launched: deque[float] = deque(maxlen=MAX_IN_FLIGHT)
        self._last_processed: float | None = None

    def launched(self, now: float | None = None) -> None:
        """``run_batch`` starts a step."""
        self._launched.append(time.perf_counter() if now is None else now)

    def processed(self, now: float | None = None) -> float | None:
        """The oldest launched step's results were processed: its ms (module docstring), None when
        no launch is waiting (a result the clock did not see start)."""
        now = time.perf_counter() if now is None else now
        last, self._last_processed = self._last_processed, now
        if not self._launched:
            return None
        start = self._launched.popleft()
        if last is not None and last > start:
            start = last
        return (now - start) * 1e3
