"""TransferTimes: the data plane's one account of copy and stall seconds, CPU and CUDA alike.

The transfer engine's clock feeds it: :class:`~sglang_ext.dataplane.wall_clock.WallClock` on the
CPU, where copies are synchronous, and :class:`~sglang_ext.dataplane.event_clock.EventClock` on
CUDA (CUDA-event pairs, harvested later without a sync). Two readers use it:
``LayeredKVCore.stats()`` (the pool's stats line: ``h2d_seconds_total``, ``d2h_seconds_total``,
``stall_seconds_total``) and the worker metrics (``kvplane:h2d_seconds_total``,
``kvplane:d2h_seconds_total``, the ``kvplane:stall_seconds`` histogram, fed by
``LayeredKVCore.close_transfer_step()``).

**Steps.** ``step`` numbers the open step. A stall is booked to the step that was open when it
was *recorded*. On CUDA its seconds arrive later, when the events are harvested. A clock announces
such a stall with :meth:`expect_stall` and delivers it with ``add_stall(..., expected=True)``.
:meth:`close_step` closes the open step. It returns the stall of every closed step that is now
complete: that step, if nothing of it is still pending, and earlier steps whose last pending
stall arrived since the previous close. A step is observed once, with all its stall seconds (0.0
for a step that waited on nothing).

**Sampled timing** (the CUDA engine, ``--kv-timing-interval N``): the clock times the copies and
waits of about one step in N (:class:`~sglang_ext.dataplane.event_clock.EventClock`). A timed
measurement is booked with weight N into the running totals (``h2d_s``, ``d2h_s``, their bytes,
``stall_s``), which therefore estimate what every step moved and waited; the unweighted
``h2d_timed_bytes`` / ``h2d_timed_s`` are what the events measured (the link's bandwidth sample
reads them). A step the clock leaves untimed is marked when it opens (:meth:`unobserved`) and
:meth:`close_step` never observes it: the stall observations are the timed steps', each at its
own (unweighted) value, never a 0.0 for a step nobody timed.

Memory: one float and one count per step that still has pending stalls, and the unobserved mark
of at most those steps and the open one. Pending stalls are bounded by the clock's event pool,
so this is bounded too, even if the events never complete.
"""

from __future__ import annotations

COPY_KINDS = ("h2d", "d2h")
"""The copy directions."""


class TransferTimes:
    """Running totals of copy seconds per direction and of stall seconds, and the stall per step."""

    def __init__(self) -> None:
        self.h2d_s = 0.0
        """Seconds of host -> device copies measured so far."""
        self.d2h_s = 0.0
        """Seconds of device -> host copies measured so far."""
        self.h2d_bytes = 0
        """Bytes of the host -> device copies whose seconds are in :attr:`h2d_s` (a copy's bytes
        are booked with its seconds: their ratio is the link's bandwidth, never bytes still in
        flight over seconds already measured)."""
        self.d2h_bytes = 0
        """Bytes of the device -> host copies whose seconds are in :attr:`d2h_s`."""
        self.h2d_timed_bytes = 0
        """Bytes of the host -> device copies the clock timed (unweighted: what was measured)."""
        self.h2d_timed_s = 0.0
        """Their seconds (unweighted): ``h2d_timed_bytes / h2d_timed_s`` is the measured link."""
        self.stall_s = 0.0
        """Seconds steps waited on transfers, measured so far."""
        self.step = 0
        """Number of the open step (steps closed so far)."""
        self.untimed = 0
        """Copies or waits the clock could not time (event pool exhausted, CUDA-graph capture)."""
        self.sampled_out = 0
        """Copies or waits left untimed by sampling (in steps the clock does not time)."""
        self._stall: dict[int, float] = {}
        self._unobserved: set[int] = set()
        """Steps the clock does not time (:meth:`unobserved`): :meth:`close_step` never observes them."""
        self._pending: dict[int, int] = {}
        self._ready: list[float] = []

    def add_copy(self, kind: str, seconds: float, nbytes: int = 0, weight: int = 1) -> None:
        """A copy of direction ``kind`` (``h2d`` / ``d2h``) of ``nbytes`` took ``seconds``;
        ``weight``: the copies it stands for (sampled timing, module docstring)."""
        if kind == "h2d":
            self.h2d_s += seconds * weight
            self.h2d_bytes += nbytes * weight
            self.h2d_timed_s += seconds
            self.h2d_timed_bytes += nbytes
        elif kind == "d2h":
            self.d2h_s += seconds * weight
            self.d2h_bytes += nbytes * weight
        else:
            raise ValueError(f"TransferTimes.add_copy: kind={kind!r}, allowed {COPY_KINDS}")

    def expect_stall(self, step: int) -> None:
        """A stall of ``step`` was recorded and its seconds will arrive later."""
        self._pending[step] = self._pending.get(step, 0) + 1

    def unobserved(self) -> None:
        """The clock does not time the open step: it is not observed (module docstring)."""
        self._unobserved.add(self.step)

    def add_stall(self, seconds: float, step: int | None = None, *, expected: bool = False,
                  weight: int = 1) -> None:
        """``step`` (default: the open one) waited ``seconds`` on transfers; ``expected``: the
        delivery of a stall announced with :meth:`expect_stall`; ``weight``: the waits it stands
        for in the running total (sampled timing; the step's own stall takes ``seconds``)."""
        step = self.step if step is None else step
        self.stall_s += seconds * weight
        self._stall[step] = self._stall.get(step, 0.0) + seconds
        if not expected:
            return
        left = self._pending.get(step, 0) - 1
        if left < 0:
            raise ValueError(f"TransferTimes.add_stall: step {step} had no pending stall")
        if left:
            self._pending[step] = left
            return
        del self._pending[step]
        if step < self.step:  # closed earlier, and now complete
            self._complete(step)

    def close_step(self) -> list[float]:
        """Close the open step. Returns the stall seconds of each step complete since the last
        close. That is this step if none of its stalls is pending, plus any earlier steps that
        completed late; never a step the clock did not time (:meth:`unobserved`)."""
        step = self.step
        self.step += 1
        if step not in self._pending:
            self._complete(step)
        out, self._ready = self._ready, []
        return out

    def _complete(self, step: int) -> None:
        """Closed ``step`` has all its stall: observed, unless the clock did not time it."""
        seconds = self._stall.pop(step, 0.0)
        if step in self._unobserved:
            self._unobserved.discard(step)
        else:
            self._ready.append(seconds)

    @property
    def pending_steps(self) -> int:
        """Closed or open steps whose stall is not completely known yet."""
        return len(self._pending)
