"""StepBlock's two pinned host twins: a twin is written again only after the device has read its
last copy (the event recorded after that copy is waited for when it has not completed). On a CPU
device there is no event; the wait runs here with stand-in events (as ``PinnedUploadRing``'s
tests do), the real CUDA path in ``tests/dataplane/test_gpu.py``."""

from __future__ import annotations

import numpy as np
import torch

from sglang_ext.dataplane.step_block import TWINS, StepBlock
from tests.dataplane.test_pinned_upload_ring import FakeEvent


def _block() -> tuple[StepBlock, list[FakeEvent], list[object]]:
    events: list[FakeEvent] = []
    streams: list[object] = []

    def new_event() -> FakeEvent:
        events.append(FakeEvent())
        return events[-1]

    def current_stream() -> object:
        streams.append("compute")
        return "compute"

    block = StepBlock([("rows", torch.int64, (4,)), ("flat", torch.int32, (6,))], "cpu",
                      new_event=new_event, current_stream=current_stream)
    return block, events, streams


def _step(block: StepBlock, value: int) -> None:
    h = block.host()
    h["rows"][:] = value
    h["flat"][:] = -value
    block.send()


def test_a_twin_whose_copy_is_unread_is_waited_for_before_it_is_written_again() -> None:
    """Each send records its twin's event on the current stream. When a twin comes round again
    and its copy has not completed, ``host`` synchronizes on it first (``waits``): three steps
    with copies that never complete on their own wait once, at the third (the first twin's second turn),
    and every step's values reach the device buffer. Found by a mutation audit (session 87): the
    wait skipped, the CPU suite passed (no events on a CPU device). Control: copies that complete
    are not waited for."""
    block, events, streams = _block()
    assert len(events) == TWINS == 2
    for value in (1, 2, 3):
        _step(block, value)
        assert block.views["rows"].tolist() == [value] * 4 and block.views["flat"].tolist() == [-value] * 6
    assert sorted(e.records for e in events) == [1, 2] and streams == ["compute"] * 3
    assert block.waits == 1 and sorted(e.syncs for e in events) == [0, 1]
    assert block.sends == 3

    block, events, _ = _block()  # control: each copy done before its twin comes round
    for value in (1, 2, 3, 4):
        _step(block, value)
        for e in events:
            e.done = True
    assert block.waits == 0 and all(e.syncs == 0 for e in events)


def test_a_cpu_block_without_events_copies_synchronously() -> None:
    """The default on a CPU device: no events, nothing waited, each send a synchronous copy."""
    block = StepBlock([("rows", torch.int64, (3,))], "cpu")
    for value in range(5):
        h = block.host()
        h["rows"][:] = np.arange(3) + value
        block.send()
        assert block.views["rows"].tolist() == [value, value + 1, value + 2]
    assert block.waits == 0 and block.sends == 5
