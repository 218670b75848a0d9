"""EventClock: the CUDA engine's clock. CUDA-event pairs are recorded on the streams and read later without a sync.

* A copy: ``start`` records the pair's first event on the transfer stream, after the stream has
  waited for what the copy is ordered after. ``stop`` records the second event right after the
  copy. ``elapsed_time`` of the pair is then the copy's time on its stream, without the wait.
* A stall: the same pair around the compute stream's ``wait_event`` calls (a layer's fetch
  events, a step start's fence). The first event completes when the compute stream reaches the
  wait, and the second when the awaited copies have finished, so the pair measures how long
  the compute stream waited.
* ``harvest()`` (at step boundaries, or later) walks one FIFO per kind in recording order. It
  uses the non-blocking ``event.query()`` and stops at the first pair that has not completed: a
  stream runs its work in order, so later pairs on that stream have not completed either. Only a
  completed pair is read with ``elapsed_time``, and then it goes back to the pool. The work per
  call is the number of pairs booked plus one query per non-empty FIFO. It is proportional to the
  copies and waits issued, not to the pool's size.

* Sampling (``interval`` N, ``--kv-timing-interval``): each event record and query costs host
  time on the scheduler thread (a half-offloaded Llama-3-8B step records ~100 for timing alone), so
  only one step in N is timed. :meth:`boundary` (every step boundary) decides. On the other
  steps ``start`` returns None at once and marks the step :meth:`TransferTimes.unobserved`; a timed
  pair is booked with weight N (:class:`TransferTimes`). Pairs timed before the switch are still
  harvested. Measuring code that calls the engine outside steps (no boundary) times everything.

Never here: ``event.synchronize()``, ``torch.cuda.synchronize()``, ``elapsed_time`` on a pair that
may be incomplete, or ``.item()``. During CUDA-graph capture nothing is recorded (the launch is
counted as untimed). Pairs come from an :class:`EventPairPool`, so the number of events is
bounded even if a stream never completes.

The event factory and the capture test are parameters so that the bookkeeping can run on the CPU
against a fake event in tests (``tests/dataplane/test_transfer_clock.py``). CUDA does not run
there.
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from sglang_ext.dataplane.event_pair_pool import DEFAULT_CAPACITY, EventPairPool
from sglang_ext.dataplane.transfer_clock import KINDS, STALL, TransferClock
from sglang_ext.dataplane.transfer_times import TransferTimes


class EventClock(TransferClock):
    """Event pairs per copy and per compute-stream wait, harvested without a sync (module docstring)."""

    def __init__(self, times: TransferTimes | None = None, *, new_event: Callable[[], Any] | None = None,
                 capturing: Callable[[], bool] | None = None, capacity: int = DEFAULT_CAPACITY,
                 interval: int = 1) -> None:
        super().__init__(times)
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise ValueError(f"EventClock: interval={interval!r} must be an int >= 1")
        self.interval = interval
        """Time one step in ``interval`` (module docstring); 1: every step."""
        self.timing = True
        """Whether the open step is timed (set by :meth:`boundary`)."""
        self._boundaries = 0
        self.pool = EventPairPool(
            new_event if new_event is not None else functools.partial(torch.cuda.Event, enable_timing=True),
            capacity,
        )
        self._capturing = capturing if capturing is not None else torch.cuda.is_current_stream_capturing
        self._fifo: dict[str, deque[tuple[tuple[Any, Any], int, int, int]]] = {kind: deque() for kind in KINDS}

    def boundary(self) -> int:
        """A step boundary: harvest, then decide whether the step now opening is timed."""
        booked = self.harvest()
        self.timing = self._boundaries % self.interval == 0
        self._boundaries += 1
        return booked

    def start(self, kind: str, stream: Any = None) -> tuple[Any, Any] | None:
        if not self.timing:
            self.times.unobserved()
            return None
        if self._capturing():
            self.times.untimed += 1
            return None
        pair = self.pool.acquire()
        if pair is None:
            self.times.untimed += 1
            return None
        pair[0].record(stream)
        return pair

    def stop(self, kind: str, token: Any, stream: Any = None, nbytes: int = 0) -> None:
        if token is None:
            return
        token[1].record(stream)
        step = self.times.step
        if kind == STALL:
            self.times.expect_stall(step)
        self._fifo[kind].append((token, step, nbytes, self.interval))

    def harvest(self) -> int:
        booked = 0
        times = self.times
        for kind, fifo in self._fifo.items():
            while fifo:
                pair, step, nbytes, weight = fifo[0]
                start, end = pair
                if not (end.query() and start.query()):
                    break
                fifo.popleft()
                seconds = max(0.0, float(start.elapsed_time(end))) / 1e3
                self.pool.release(pair)
                if kind == STALL:
                    times.add_stall(seconds, step, expected=True, weight=weight)
                else:
                    times.add_copy(kind, seconds, nbytes, weight)
                booked += 1
        return booked

    @property
    def pending(self) -> int:
        """Pairs recorded and not yet harvested."""
        return sum(len(fifo) for fifo in self._fifo.values())
