"""``EventClock.book``: copies timed by pairs a replayed CUDA graph's event nodes record
(``GraphStaging.copy_marks``), on the fakes of ``test_transfer_clock.py`` (CUDA does not run here;
the GPU twin is ``test_graph_staging_gpu.py``)."""

from __future__ import annotations

import pytest

from tests.dataplane.test_transfer_clock import FakeEvent, FakeStream, fake_clock, timed


def test_a_pair_a_replayed_graph_records_is_booked_with_its_bytes_never_pooled():
    """``book``: a pair recorded by a CUDA graph's event nodes (every replay stamps the same two
    events; each booking hands them over in a new tuple, as ``GraphStaging`` does) is booked for
    the open step with the bytes it moved, harvested once the stream runs it, and never released
    to the pool. Booked again before its harvest -- also by a replay that moves nothing -- the
    earlier booking is dropped unread. An untimed step books nothing (sampled out)."""
    clock, _ = fake_clock()
    h2d = FakeStream()
    start, end = FakeEvent(h2d), FakeEvent(h2d)

    def replay(ms: float) -> None:  # the graph's nodes stamp the pair
        start.record(h2d)
        h2d.now_ms += ms
        end.record(h2d)

    clock.book("h2d", (start, end), 4_000_000)
    replay(2.0)
    h2d.complete()
    assert clock.harvest() == 1
    assert clock.times.h2d_timed_bytes == 4_000_000 and clock.times.h2d_timed_s == pytest.approx(0.002)
    assert clock.pool.in_use == 0 and clock.pool.created == 0  # the graph's pair, not the pool's
    clock.book("h2d", (start, end), 1_000)
    replay(1.0)
    clock.book("h2d", (start, end), 2_000)  # the next step's replay before the harvest: the first dropped
    replay(3.0)
    h2d.complete()
    assert clock.harvest() == 1 and clock.times.h2d_timed_bytes == 4_002_000
    assert clock.times.h2d_timed_s == pytest.approx(0.005) and clock.times.untimed == 1
    clock.book("h2d", (start, end), 1_000)
    replay(1.0)
    clock.book("h2d", (start, end), 0)  # a replay moving nothing stamps the pair too: dropped, nothing booked
    replay(1.0)
    h2d.complete()
    assert clock.harvest() == 0 and clock.times.untimed == 2 and clock.pending == 0
    clock.set_interval(1_000_000, gap=lambda n: n)
    clock.boundary()  # the step opening now is not timed
    clock.book("h2d", (start, end), 5_000)
    assert clock.pending == 0 and clock.times.sampled_out == 1


def test_a_graph_pair_a_platform_cannot_time_is_counted_untimed_not_raised():
    """HIP does not time events recorded inside graphs (``elapsed_time`` raises): the harvest at
    the step boundary counts the booking untimed and goes on (a pooled pair still raises: the
    clock's own events always time)."""
    clock, _ = fake_clock()
    h2d = FakeStream()

    class Untimed(FakeEvent):
        def elapsed_time(self, end: FakeEvent) -> float:
            raise RuntimeError("HIP error: invalid handle")

    pair = (Untimed(h2d), Untimed(h2d))
    clock.book("h2d", pair, 1_000)
    timed(clock, "h2d", h2d, 1.0)
    pair[0].record(h2d)
    pair[1].record(h2d)
    h2d.complete()
    assert clock.harvest() == 1 and clock.times.untimed == 1 and clock.times.h2d_timed_bytes == 0
