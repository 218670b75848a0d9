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
  time on the scheduler thread (a half-offloaded Llama-3-8B step recorded ~100 for timing alone
  on the H200), so about one step in N is timed. The decision is made when a step opens: at
  :meth:`opened` (the core's ``close_transfer_step``: with ``--enable-metrics`` the metrics close
  every forward), so a plan install between two forwards belongs to the step it precedes; where
  no close came since the last boundary (no metrics), at :meth:`boundary` (an install then
  follows the previous step's decision; there are no per-step observations to skew). The gaps
  between timed steps are random, 1 to 2N - 1 steps (mean N, the clock's own generator), so no
  periodic pattern of the workload (a batch opening pages every ``page_size`` steps) lines up
  with them. An untimed step is marked
  :meth:`TransferTimes.unobserved` when it opens and ``start`` returns None at once (counted in
  ``sampled_out``); a pair timed in a sampled step is booked with weight N. Until the first
  decision (and after :meth:`set_interval`) everything is timed with weight 1: code that calls
  the engine outside steps (the GPU check's transfer loops) times all of it. The first timed
  step after a (re)start is a random gap away, so a restart does not force one.

* A replayed CUDA graph's copies: the graph's own event nodes stamp a pair every replay
  (:class:`~sglang_ext.dataplane.graph_staging.GraphStaging`); :meth:`EventClock.book` queues it
  for the open step with the bytes moved, never releasing it to the pool.

The event factory and the capture test are parameters so that the bookkeeping can run on the CPU
against a fake event in tests (``tests/dataplane/test_transfer_clock.py``). CUDA does not run
there.
"""

from __future__ import annotations

import functools
import random
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
                 interval: int = 1, gap: Callable[[int], int] | None = None) -> None:
        super().__init__(times)
        self.pool = EventPairPool(
            new_event if new_event is not None else functools.partial(torch.cuda.Event, enable_timing=True),
            capacity,
        )
        self._capturing = capturing if capturing is not None else torch.cuda.is_current_stream_capturing
        self._fifo: dict[str, deque[tuple[tuple[Any, Any], int, int, int, bool]]] = {kind: deque() for kind in KINDS}
        """Per kind, in recording order: (pair, step, bytes, weight, the pool's pair)."""
        self._gap = gap if gap is not None else _random_gaps()
        """Steps from a timed step to the next one, given N (module docstring); tests fix it."""
        self._opened = False
        """:meth:`opened` decided since the last :meth:`boundary` (which then does not)."""
        self.set_interval(interval)

    def set_interval(self, interval: int, gap: Callable[[int], int] | None = None) -> None:
        """Time about one step in ``interval`` from the next decision on; until it, everything
        (weight 1). The first timed step is ``gap(interval) - 1`` decisions away (random, so a
        reset does not force one). ``gap``: the steps between timed ones (tests fix it)."""
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise ValueError(f"EventClock: interval={interval!r} must be an int >= 1")
        if gap is not None:
            self._gap = gap
        self.interval = interval
        """Time about one step in ``interval`` (module docstring); 1: every step."""
        self.timing = True
        """Whether the open step is timed."""
        self._weight = 1
        """Weight of what is timed now (``interval`` once sampling has picked the step)."""
        self._countdown = self._gap(interval) - 1 if interval > 1 else 0
        """Decisions left before the next timed step."""

    def _decide(self) -> None:
        """The step now opening: timed or not (module docstring)."""
        if self.interval == 1:
            self.timing, self._weight = True, 1
            return
        self._weight = self.interval
        self.timing = self._countdown <= 0
        if self.timing:
            self._countdown = self._gap(self.interval)
        else:
            self.times.unobserved()
        self._countdown -= 1

    def boundary(self) -> int:
        """A step boundary: harvest; decide whether this step is timed unless :meth:`opened` did
        since the last boundary (the metrics close every forward; without them, or if their
        closes stop, the boundaries decide)."""
        booked = self.harvest()
        if not self._opened:
            self._decide()
        self._opened = False
        return booked

    def opened(self) -> None:
        """The metrics closed a step (``close_transfer_step``): decide whether the next is timed."""
        self._opened = True
        self._decide()

    def start(self, kind: str, stream: Any = None) -> tuple[Any, Any] | None:
        if not self.timing:
            self.times.sampled_out += 1
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
        self._fifo[kind].append((token, step, nbytes, self._weight, True))

    def book(self, kind: str, pair: tuple[Any, Any], nbytes: int = 0) -> None:
        """A copy timed by a pair recorded elsewhere -- a replayed CUDA graph's event nodes
        (:class:`~sglang_ext.dataplane.graph_staging.GraphStaging`), stamped again by every
        replay -- booked for the step now open if it is timed and moved bytes. Not the pool's:
        never released to it. The same events still waiting from an earlier booking are dropped
        unread first, whatever this step moves (its replay stamps them again before they could
        be read): call it for every replay of the graph."""
        fifo = self._fifo[kind]
        for i, entry in enumerate(fifo):
            if entry[0][0] is pair[0] and entry[0][1] is pair[1]:
                del fifo[i]
                self.times.untimed += 1
                break
        if not nbytes:
            return
        if not self.timing:
            self.times.sampled_out += 1
            return
        fifo.append((pair, self.times.step, nbytes, self._weight, False))

    def harvest(self) -> int:
        booked = 0
        times = self.times
        for kind, fifo in self._fifo.items():
            while fifo:
                pair, step, nbytes, weight, pooled = fifo[0]
                start, end = pair
                if not (end.query() and start.query()):
                    break
                fifo.popleft()
                if pooled:
                    seconds = max(0.0, float(start.elapsed_time(end))) / 1e3
                    self.pool.release(pair)
                else:
                    try:  # a graph's event nodes: a platform without timing in graphs (ROCm) raises
                        seconds = max(0.0, float(start.elapsed_time(end))) / 1e3
                    except RuntimeError:
                        times.untimed += 1
                        continue
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


def _random_gaps() -> Callable[[int], int]:
    """Gaps of 1 to 2N - 1 steps, uniform (mean N), from a generator of the clock's own."""
    rng = random.Random(0x5EED)
    return lambda n: rng.randint(1, 2 * n - 1)
