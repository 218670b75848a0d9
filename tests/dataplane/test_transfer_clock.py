"""Transfer timing of the data plane: one account (TransferTimes) for CPU and CUDA.

CUDA does not run here. The CUDA-event bookkeeping of :class:`EventClock` (recording pairs,
harvesting with ``query()``, reading ``elapsed_time`` only on completed pairs, the bounded pool,
the per-step stall) runs against :class:`FakeEvent` below. The fake only models what the
bookkeeping relies on: events recorded on an in-order stream complete when the test completes
that stream up to them; ``elapsed_time`` raises on an incomplete pair (as CUDA's
``cudaErrorNotReady`` does); ``synchronize()`` is refused. The fake stands in for CUDA events
ONLY. The CPU engine's wall-clock timing, the core and the OpAudit run for real. The same core on
a GPU, with real events, is ``tests/dataplane/test_gpu_transfer_times.py`` (``gpu``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from sglang_ext.dataplane.event_clock import EventClock
from sglang_ext.dataplane.event_pair_pool import EventPairPool
from sglang_ext.dataplane.transfer_clock import STALL
from sglang_ext.dataplane.transfer_times import TransferTimes
from sglang_ext.dataplane.wall_clock import WallClock
from sglang_ext.testing.op_audit import OpAudit, audit_core
from tests.dataplane.core_driver import offloaded_driver


class FakeStream:
    """An in-order stream: events complete in recording order, up to where the test says."""

    def __init__(self) -> None:
        self.now_ms = 0.0
        self.recorded: list[FakeEvent] = []
        self.done = 0
        """Events of ``recorded`` that have completed (a prefix: the stream is in order)."""
        self.queries = 0

    def complete(self, n: int | None = None) -> None:
        """The device ran the next ``n`` recorded events (all of them by default)."""
        self.done = len(self.recorded) if n is None else min(len(self.recorded), self.done + n)


class FakeEvent:
    """Stand-in for ``torch.cuda.Event(enable_timing=True)`` (module docstring)."""

    created = 0

    def __init__(self, default: FakeStream) -> None:
        self.default = default
        self.stream: FakeStream | None = None
        self.index = -1
        self.t_ms = 0.0
        FakeEvent.created += 1

    def record(self, stream: Any = None) -> None:
        stream = self.default if stream is None else stream
        self.stream, self.index, self.t_ms = stream, len(stream.recorded), stream.now_ms
        stream.recorded.append(self)

    def query(self) -> bool:
        assert self.stream is not None
        self.stream.queries += 1
        return self.index < self.stream.done

    def elapsed_time(self, end: FakeEvent) -> float:
        for e in (self, end):
            if e.stream is None or e.index >= e.stream.done:
                raise RuntimeError("CUDA error: device not ready (elapsed_time on an incomplete event)")
        return end.t_ms - self.t_ms

    def synchronize(self) -> None:
        raise AssertionError("the data plane must never synchronize on a timing event")


def fake_clock(capacity: int = 64, default: FakeStream | None = None, **kw: Any) -> tuple[EventClock, FakeStream]:
    stream = default or FakeStream()
    return EventClock(new_event=lambda: FakeEvent(stream), capturing=lambda: False, capacity=capacity, **kw), stream


def timed(clock: EventClock, kind: str, stream: FakeStream, ms: float) -> None:
    """One copy (or compute-stream wait) of ``ms`` on ``stream``."""
    token = clock.start(kind, stream)
    stream.now_ms += ms
    clock.stop(kind, token, stream)


# ---- EventClock: harvest and accounting (fake events) ----------------------------------------


def test_harvest_books_only_completed_pairs_in_stream_order():
    """Nothing is booked before the stream completes a pair. A partly completed stream books
    exactly its completed prefix. ``elapsed_time`` is never called on an incomplete pair (the
    fake raises if it is). Each direction has its own total."""
    clock, _ = fake_clock()
    h2d, d2h = FakeStream(), FakeStream()
    timed(clock, "h2d", h2d, 2.0)
    timed(clock, "h2d", h2d, 3.0)
    timed(clock, "d2h", d2h, 5.0)
    assert clock.harvest() == 0 and clock.times.h2d_s == clock.times.d2h_s == 0.0
    h2d.complete(2)  # the first pair only
    assert clock.harvest() == 1
    assert clock.times.h2d_s == pytest.approx(0.002) and clock.times.d2h_s == 0.0
    h2d.complete()
    d2h.complete()
    assert clock.harvest() == 2
    assert clock.times.h2d_s == pytest.approx(0.005) and clock.times.d2h_s == pytest.approx(0.005)
    assert clock.pending == 0 and clock.pool.in_use == 0


def test_the_fake_refuses_what_the_clock_must_never_do():
    """Negative control: reading an incomplete pair, or synchronizing on it, fails loudly. So the
    test above would have caught a clock that read pairs without querying them."""
    stream = FakeStream()
    start, end = FakeEvent(stream), FakeEvent(stream)
    start.record()
    end.record()
    with pytest.raises(RuntimeError, match="not ready"):
        start.elapsed_time(end)
    with pytest.raises(AssertionError, match="never synchronize"):
        end.synchronize()
    stream.complete()
    assert start.elapsed_time(end) == 0.0


def test_a_step_is_observed_once_with_all_its_stall():
    """Stall pairs are booked to the step during which they were recorded. A closed step with a
    pending pair is observed only when its last pair arrives, and then with the sum of all its
    pairs. A step that waited on nothing is observed as 0.0. The total matches the observations."""
    clock, _ = fake_clock()
    compute = FakeStream()
    times = clock.times
    timed(clock, STALL, compute, 1.5)
    timed(clock, STALL, compute, 0.5)
    clock.harvest()
    assert times.close_step() == []  # step 0: both pairs pending
    compute.complete(2)  # step 0's first pair
    clock.harvest()
    assert times.close_step() == [0.0]  # step 1 (no waits); step 0 still has a pending pair
    compute.complete()
    clock.harvest()
    observed = times.close_step()  # step 0 (late), then step 2
    assert observed == [pytest.approx(0.002), 0.0]
    assert times.stall_s == pytest.approx(0.002) and times.pending_steps == 0 and times.step == 3


def test_events_that_never_complete_keep_memory_bounded():
    """Scenario: a stream stops completing. The pool stops at its capacity and later launches
    are counted as untimed. A harvest queries each FIFO's head only, so its work does not grow
    with the pool. Once the stream completes everything is booked, and the pool never grows
    again in steady state."""
    clock, _ = fake_clock(capacity=8)
    stream = FakeStream()
    for _ in range(20):
        timed(clock, "h2d", stream, 1.0)
    assert clock.pool.created == 8 and clock.times.untimed == 12 and clock.pending == 8
    for _ in range(5):
        before = stream.queries
        assert clock.harvest() == 0
        assert stream.queries - before == 1  # one query: the h2d FIFO's head
    stream.complete()
    assert clock.harvest() == 8 and clock.times.h2d_s == pytest.approx(0.008)
    created = FakeEvent.created
    for _ in range(100):  # steady state: 3 copies per step, completed by the next boundary
        for _ in range(3):
            timed(clock, "h2d", stream, 1.0)
        stream.complete()
        clock.harvest()
        clock.times.close_step()
    assert clock.pool.created == 8 and FakeEvent.created == created and clock.pool.in_use == 0
    assert clock.times.untimed == 12


def test_nothing_is_recorded_during_graph_capture():
    """Under CUDA-graph capture, start records nothing and the launch is untimed."""
    stream = FakeStream()
    clock = EventClock(new_event=lambda: FakeEvent(stream), capturing=lambda: True)
    timed(clock, "h2d", stream, 1.0)
    assert stream.recorded == [] and clock.pending == 0 and clock.times.untimed == 1


def test_sampled_clock_books_a_timed_step_with_its_weight():
    """``interval`` 4 with gaps fixed at 4 and nothing closing steps: boundaries decide, the steps
    they open are timed on boundaries 3, 7, ... (the first a gap away, not at once); a timed pair is booked with weight 4 in the
    running totals (seconds and bytes alike, so the estimate's bytes over seconds is the
    measured bandwidth; the unweighted measured figures beside them), while the step's own
    stall observation is the measured value. An untimed step counts its copies and waits as
    sampled out and is never observed (no 0.0 for a step nobody timed). Negative control:
    interval 1 times and observes every step."""

    def run(interval: int) -> tuple[list[bool], list[list[float]], TransferTimes, EventClock]:
        clock, _ = fake_clock(interval=interval, gap=lambda n: n)
        copies, waits = FakeStream(), FakeStream()
        timing, observed = [], []
        for _ in range(8):
            clock.boundary()
            timing.append(clock.timing)
            token = clock.start("h2d", copies)
            copies.now_ms += 2.0
            clock.stop("h2d", token, copies, 1 << 20)
            timed(clock, STALL, waits, 0.5)
            copies.complete()
            waits.complete()
            clock.harvest()
            observed.append(clock.times.close_step())
        return timing, observed, clock.times, clock

    timing, observed, times, clock = run(4)
    assert timing == [False, False, False, True, False, False, False, True]
    assert observed == [[], [], [], [pytest.approx(0.0005)], [], [], [], [pytest.approx(0.0005)]]
    assert times.h2d_s == pytest.approx(8 * 0.002) and times.h2d_bytes == 8 << 20  # 2 timed x weight 4
    assert (times.h2d_timed_s, times.h2d_timed_bytes) == (pytest.approx(0.004), 2 << 20)
    assert times.stall_s == pytest.approx(8 * 0.0005)
    assert times.sampled_out == 12 and times.untimed == 0  # 6 untimed steps x (a copy + a wait)
    assert clock.pool.created == 2  # untimed steps took no pair
    timing, observed, times, _ = run(1)
    assert all(timing) and [len(o) for o in observed] == [1] * 8 and times.sampled_out == 0
    assert times.h2d_s == pytest.approx(8 * 0.002) and times.h2d_bytes == 8 << 20
    with pytest.raises(ValueError, match="interval=0 must be an int >= 1"):
        EventClock(new_event=object, interval=0)


def test_before_any_decision_everything_is_timed_with_weight_one():
    """A clock at interval 8 that no boundary or close has reached yet (measuring code that drives
    the engine directly) times every copy once, not 8 times; so does one just given a new
    interval (``set_interval``), whose next decision is not forced to time (the first timed step
    is a gap away). Negative control: a decided timed step's copy counts 8 times."""
    clock, _ = fake_clock(interval=8, gap=lambda n: n)
    stream = FakeStream()
    for _ in range(3):
        timed(clock, "h2d", stream, 1.0)
    stream.complete()
    clock.harvest()
    assert clock.times.h2d_s == pytest.approx(0.003)
    decisions = []
    for _ in range(8):
        clock.opened()
        decisions.append(clock.timing)
    assert decisions == [False] * 7 + [True]
    timed(clock, "h2d", stream, 1.0)
    stream.complete()
    clock.harvest()
    assert clock.times.h2d_s == pytest.approx(0.003 + 0.008)
    clock.set_interval(8)
    assert clock.timing
    timed(clock, "h2d", stream, 1.0)
    stream.complete()
    clock.harvest()
    assert clock.times.h2d_s == pytest.approx(0.011 + 0.001)
    clock.opened()
    assert not clock.timing


def test_boundaries_decide_when_closes_stop():
    """The metrics' closes decide; a boundary with no close since the last one decides itself
    (closes that stop -- a failing metrics hook, a tool that closed once -- do not freeze the
    clock's last decision). Negative control: with a close before each boundary, the boundaries
    decide nothing (one decision a step, not two)."""
    clock, _ = fake_clock(interval=4, gap=lambda n: n)
    clock.opened()
    clock.opened()
    seen = []
    for _ in range(8):
        clock.boundary()
        seen.append(clock.timing)
    assert sum(seen) == 2
    clock, _ = fake_clock(interval=4, gap=lambda n: n)
    seen = []
    for _ in range(8):
        clock.opened()
        clock.boundary()
        seen.append(clock.timing)
    assert sum(seen) == 2 and seen == [False, False, False, True] * 2


def test_random_gaps_time_about_one_step_in_n_without_a_period():
    """The default gaps: 1 to 2N - 1 steps (mean N), so over 8,000 steps at N = 8 about 1,000 are
    timed, and the timed steps fall on every residue of 16 (a batch opening pages every 16 steps
    is sampled in every phase; fixed gaps of 8 hit two residues only: negative control)."""
    for gap, residues in ((None, 16), (lambda n: n, 2)):
        clock, _ = fake_clock(interval=8, gap=gap)
        hits = []
        for step in range(8000):
            clock.opened()
            if clock.timing:
                hits.append(step)
        if gap is None:
            assert 900 <= len(hits) <= 1100, len(hits)
        assert len({h % 16 for h in hits}) == residues


def test_a_late_stall_of_an_unobserved_step_is_not_observed():
    """A stall timed in a step marked unobserved (the interval was reset inside it) arrives late:
    its seconds join the total, but the step is not observed, on time or late (negative control:
    the same late stall of an unmarked step is observed)."""
    for marked in (True, False):
        clock, _ = fake_clock()
        waits = FakeStream()
        if marked:
            clock.times.unobserved()
        timed(clock, STALL, waits, 1.0)
        assert clock.times.close_step() == []  # the stall is pending
        waits.complete()
        clock.harvest()
        assert clock.times.stall_s == pytest.approx(0.001)
        # the late stall (step 0) when its step was not marked, then step 1 (nothing)
        assert clock.times.close_step() == ([0.0] if marked else [pytest.approx(0.001), 0.0])


def test_served_core_records_timing_events_on_one_step_in_n():
    """``--kv-timing-interval``: the served core's placed decode steps (fetches, write-backs,
    layer waits) record timing events on one step in 4 and none on the others -- the host cost
    sampling saves -- and the metrics observe exactly the timed steps: also when a plan install
    moves data between two forwards (it belongs to the step it precedes) and on steps that copy
    nothing (the batch back on the GPU). Negative control: interval 1 records on every step."""

    def run(interval: int) -> tuple[list[int], list[int], list[bool], TransferTimes]:
        stream = FakeStream()
        clock = EventClock(new_event=lambda: FakeEvent(stream), capturing=lambda: False, interval=interval,
                           gap=lambda n: n)
        d = offloaded_driver(clock=clock)
        stream.complete()
        d.core.close_transfer_step()
        records, observed, timing = [], [], []
        for i in range(16):
            before = len(stream.recorded)
            timing.append(clock.timing)
            if i % 3 == 1:  # an install between forwards (timed and untimed steps alike): b's layers move
                d.want("b", [True, i % 2 == 0, False])
            if i >= 12:  # the batch back on the GPU: nothing copied or awaited
                d.want("a", [True] * 3)
                d.want("b", [True] * 3)
            assert d.step([("a", 1), ("b", 1)])
            records.append(len(stream.recorded) - before)
            stream.complete()
            observed.append(len(d.core.close_transfer_step()))
        return records, observed, timing, clock.times

    records, observed, timing, times = run(4)
    assert sum(timing) == 4 and timing == timing[4:] + timing[:4]  # one step in 4
    assert [bool(n) for n in records[:12]] == timing[:12], records  # events only in timed steps
    assert observed == [int(t) for t in timing]  # every timed step observed, no other
    assert times.sampled_out > 0 and times.untimed == 0
    records, observed, timing, times = run(1)
    assert all(records[:12]) and observed == [1] * 16 and times.sampled_out == 0


def test_accounting_rejects_what_no_clock_sends():
    """Error messages name the value: an unknown copy kind, a stall delivered without being
    announced, a pool without room."""
    times = TransferTimes()
    with pytest.raises(ValueError, match=r"kind='x2y'"):
        times.add_copy("x2y", 1.0)
    with pytest.raises(ValueError, match="step 0 had no pending stall"):
        times.add_stall(1.0, 0, expected=True)
    with pytest.raises(ValueError, match="capacity=0"):
        EventPairPool(object, capacity=0)


# ---- the core on the CPU: the same account --------------------------------------------------


def test_cpu_copies_are_wall_timed_and_are_the_steps_stall():
    """CPU engine (WallClock): copies are timed as they run, each step's stall is its copy
    seconds, and the pool's stats carry the same totals as the account. A step without copies
    observes 0.0 (negative control)."""
    d = offloaded_driver()
    core, times = d.core, d.core.transfer_times
    assert isinstance(core.store.engine.clock, WallClock)
    before = times.h2d_s + times.d2h_s
    assert d.step([("a", 1), ("b", 1)])
    [stall] = core.close_transfer_step()
    assert stall > 0 and stall == pytest.approx(times.h2d_s + times.d2h_s - before)
    stats = core.stats()
    assert (stats.h2d_seconds_total, stats.d2h_seconds_total, stats.stall_seconds_total) == (
        times.h2d_s, times.d2h_s, times.stall_s)
    assert stats.h2d_seconds_total > 0 and stats.d2h_seconds_total > 0
    assert core.close_transfer_step() == [0.0]


def test_per_layer_event_timing_adds_no_host_sync():
    """The CUDA bookkeeping inside layers, run on the CPU with fake events: a decode step with
    fetched layers records a stall pair for each layer that waits, and a pair for each copy. The
    OpAudit (TorchDispatchMode) finds no host-sync op inside any layer. Closing the step observes
    one stall, once the fake streams have completed."""
    stream = FakeStream()
    clock, _ = fake_clock(default=stream)
    d = offloaded_driver(clock=clock)
    core = d.core
    stream.complete()
    core.close_transfer_step()
    waits = core.pipeline.layer_waits
    audit = OpAudit()
    audit_core(core, audit)
    with audit:
        assert d.step([("a", 1), ("b", 1)])
    assert audit.violations == [], audit.violations
    stall_pairs = len(clock._fifo[STALL])
    assert core.pipeline.layer_waits - waits >= 1 and stall_pairs == core.pipeline.layer_waits - waits
    assert clock.pending > stall_pairs  # copies were timed too
    assert core.close_transfer_step() == []  # pending: the fake streams have not run
    stream.complete()
    assert len(core.close_transfer_step()) == 2  # the audited step, then the empty one
    assert clock.pending == 0 and clock.times.h2d_s == 0.0  # fake copies take no time here


def test_a_sync_in_the_timing_path_would_be_caught(monkeypatch):
    """Negative control for the test above: a host read slipped into ``EventClock.start`` is
    flagged inside the layer that waits."""
    real = EventClock.start

    def start_with_a_sync(self, kind, stream=None):  # noqa: ANN001, ANN202
        int(torch.zeros(1)[0])
        return real(self, kind, stream)

    monkeypatch.setattr(EventClock, "start", start_with_a_sync)
    stream = FakeStream()
    clock, _ = fake_clock(default=stream)
    d = offloaded_driver(clock=clock)
    audit = OpAudit()
    audit_core(d.core, audit)
    with audit:
        assert d.step([("a", 1), ("b", 1)])
    assert audit.violations and all(name == "aten._local_scalar_dense.default" for _, name in audit.violations)


def test_bytes_are_booked_with_their_seconds():
    """A copy's bytes join the account when its seconds do (EventClock: at harvest, never while
    the pair is pending), so bytes / seconds is the link's bandwidth; the CPU engine books every
    copy it launched: the account's H2D bytes are the store's (negative control: a copy still in
    flight is not counted)."""
    clock, _ = fake_clock()
    h2d = FakeStream()
    for ms, nbytes in ((2.0, 4 << 20), (3.0, 6 << 20)):
        token = clock.start("h2d", h2d)
        h2d.now_ms += ms
        clock.stop("h2d", token, h2d, nbytes)
    h2d.complete(2)  # the first copy only
    clock.harvest()
    assert (clock.times.h2d_bytes, clock.times.h2d_s) == (4 << 20, pytest.approx(0.002))
    h2d.complete()
    clock.harvest()
    assert clock.times.h2d_bytes == 10 << 20 and clock.times.d2h_bytes == 0
    d = offloaded_driver()
    times, store = d.core.transfer_times, d.core.store
    assert d.step([("a", 1), ("b", 1)])
    assert times.h2d_bytes == store.h2d_bytes > 0 and times.h2d_s > 0
    assert times.d2h_bytes > 0
