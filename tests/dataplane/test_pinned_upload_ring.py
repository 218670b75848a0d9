"""PinnedUploadRing: slots rotate, a slot is written again only after its release event, host
views survive ``slots - 1`` takes (and not ``slots``: the negative control), buffers grow by
powers of two, and the served store's tables and mirror upload through it. The bookkeeping runs
on the CPU with fake events; the pinned round trip is a ``gpu`` test."""

import numpy as np
import pytest
import torch

from sglang_ext.dataplane.pinned_upload_ring import MIN_BYTES, PinnedUploadRing


class FakeEvent:
    """An event that completes only when the test says so (or on synchronize)."""

    def __init__(self) -> None:
        self.done = False
        self.records = 0
        self.syncs = 0

    def record(self, stream=None) -> None:  # noqa: ANN001
        self.records += 1
        self.done = False
        self.stream = stream

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.syncs += 1
        self.done = True


def ring(slots: int = 3, done: bool = True, current_stream=None) -> tuple[PinnedUploadRing, list[FakeEvent]]:  # noqa: ANN001
    events: list[FakeEvent] = []

    def new_event() -> FakeEvent:
        e = FakeEvent()
        if done:
            e.record = lambda stream=None, e=e: setattr(e, "records", e.records + 1)  # type: ignore[method-assign]
            e.done = True
        events.append(e)
        return e

    return PinnedUploadRing(torch.device("cpu"), slots, pin=False, new_event=new_event,
                            current_stream=current_stream), events


def test_host_views_survive_slots_minus_one_takes_and_not_slots():
    r, _ = ring(slots=3)
    first = r.stage(np.arange(5, dtype=np.int64))
    r.stage(np.full(5, 7, dtype=np.int64))
    r.stage(np.full(5, 8, dtype=np.int64))  # two more takes: the first view is intact
    assert first.tolist() == [0, 1, 2, 3, 4]
    r.stage(np.full(5, 9, dtype=np.int64))  # the third: its slot comes round again
    assert first.tolist() == [9] * 5, "negative control: a view older than slots - 1 takes is reused"
    assert r.takes == 4 and r.grown == 3 and r.waits == 0


def test_a_busy_slot_gets_a_fresh_one_in_front_until_the_cap_then_a_wait():
    """Events never complete: the ring grows to GROW_TO x its slots (no wait, no view reused),
    then waits; views taken stay intact while the ring grows."""
    from sglang_ext.dataplane.pinned_upload_ring import GROW_TO

    r, _ = ring(slots=2, done=False)
    views = [r.stage(np.full(4, i, dtype=np.int64)) for i in range(2 * GROW_TO)]
    assert r.slots == 2 * GROW_TO and r.waits == 0 and r.added == 2 * GROW_TO - 2
    assert [v.tolist() for v in views] == [[i] * 4 for i in range(2 * GROW_TO)]
    r.take(8)
    assert r.waits == 1 and r.slots == 2 * GROW_TO


def test_release_event_is_recorded_at_the_next_take_and_waited_before_reuse():
    r, events = ring(slots=2, done=False)
    r.max_slots = 2  # no growth: the wait itself
    r.take(16)
    assert events == [], "the slot taken last is not released yet: a consumer may still copy it"
    r.take(16)
    assert len(events) == 1 and events[0].records == 1  # slot 0 released at the second take
    r.take(16)  # slot 0 again: its release event has not completed -> one wait
    assert events[0].syncs == 1 and r.waits == 1
    events[1].done = True  # slot 1's copies finished
    r.take(16)  # slot 1 again: its release event completed -> no wait
    assert events[1].syncs == 0 and r.waits == 1
    r.take(16)  # slot 0: released at the last take, not completed -> a second wait
    assert events[0].syncs == 2 and r.waits == 2


def test_a_slot_is_released_on_the_stream_it_was_taken_on():
    """Taken on stream A, the next take on stream B: the release is recorded on A, where the
    slot's readers were enqueued (not on B, which would not order after them)."""
    current = ["A"]
    r, events = ring(slots=2, done=False, current_stream=lambda: current[0])
    r.take(8)
    current[0] = "B"
    r.take(8)
    assert events[0].stream == "A"
    r.take(8)  # slot 0 taken on B now; slot 1 (taken on B) released on B
    assert events[1].stream == "B"


def test_no_wait_when_the_release_event_completed():
    r, events = ring(slots=2, done=True)
    for _ in range(6):
        r.take(32)
    assert r.waits == 0 and all(e.syncs == 0 for e in events)


def test_slots_grow_by_powers_of_two_and_keep_their_buffer():
    r, _ = ring(slots=2)
    assert r.take(10).numel() == 10 and r.grown == 1
    r.take(10)
    big = r.take(MIN_BYTES + 1)  # slot 0 again, too small now
    assert big.numel() == MIN_BYTES + 1 and r.grown == 3
    assert r._buffers[0] is not None and r._buffers[0].numel() == 2 * MIN_BYTES
    r.take(10)
    r.take(100)  # slot 0 again: big enough, no new buffer
    assert r.grown == 3


@pytest.mark.parametrize("dtype", [np.int64, np.int32, np.uint8])
def test_stage_round_trips_the_dtype(dtype):
    r, _ = ring()
    values = (np.arange(37) * 3).astype(dtype)
    host = r.stage(values)
    assert host.dtype == torch.from_numpy(values).dtype
    assert np.array_equal(host.numpy(), values)


def test_cpu_upload_bypasses_the_ring():
    r, _ = ring()
    values = np.arange(4, dtype=np.int64)
    dev, host = r.upload(values)
    assert dev is host and dev.tolist() == [0, 1, 2, 3] and r.takes == 0


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="slots=1"):
        PinnedUploadRing(torch.device("cpu"), 1, pin=False)
    r, _ = ring()
    with pytest.raises(ValueError, match="nbytes=-1"):
        r.take(-1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_uploads_are_pinned_and_arrive():
    r = PinnedUploadRing(torch.device("cuda"))
    sent = []
    for i in range(3 * r.slots):
        values = np.arange(1000 + i, dtype=np.int64) * (i + 1)
        dev, host = r.upload(values)
        assert host.is_pinned()
        sent.append((values, dev))
    torch.cuda.synchronize()
    for values, dev in sent:
        assert np.array_equal(dev.cpu().numpy(), values)
    assert r.grown <= 2 * r.slots
