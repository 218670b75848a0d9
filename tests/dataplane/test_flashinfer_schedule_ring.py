"""FlashInfer's split schedule under a GPU that lags the host (``FlashInferLayeredDecode``'s
schedule ring, ``flashinfer_attention.py``'s module docstring).

FlashInfer's ``plan`` writes the step's split schedule into the wrapper's pinned int workspace and
copies it to the device asynchronously, on the stream. Here the stream is emulated: its copies run
only when the test says (a GPU still busy with an earlier step), and events complete when the
stream has run past them. Each plan of the stand-in wrapper writes its own schedule into the
pinned buffer it finds and enqueues the copy; the test then runs the stream and checks what each
copy delivered. With the ring every copy delivers its own plan's schedule; without it (the
control: one pinned buffer per wrapper, FlashInfer's own) the earlier step's copy delivers the
later step's schedule. The ring grows before it waits, and a wait runs the stream up to the event.
The CUDA version: ``test_flashinfer_schedule_ring_gpu.py`` (a plan copy held behind a sleep)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from sglang_ext.dataplane.flashinfer_attention import (
    SCHEDULE_SLOTS,
    AttentionParams,
    FlashInferLayeredDecode,
)
from sglang_ext.dataplane.pinned_upload_ring import GROW_TO, PinnedUploadRing
from sglang_ext.dataplane.results import LayerView
from sglang_ext.testing.flashinfer_stand_in import FlashInferStandIn

PAGE, KV_HEADS, DIM = 4, 2, 8


class LaggingStream:
    """A stream whose enqueued work runs only when :meth:`run` is called (a GPU behind the host)."""

    def __init__(self) -> None:
        self.ops: list[Callable[[], None]] = []
        self.done = 0

    def run(self, upto: int | None = None) -> None:
        upto = len(self.ops) if upto is None else upto
        while self.done < upto:
            self.ops[self.done]()
            self.done += 1


class LaggingEvent:
    """An event on a :class:`LaggingStream`: complete once the stream ran everything before it."""

    def __init__(self) -> None:
        self.stream: LaggingStream | None = None
        self.at = 0

    def record(self, stream: LaggingStream) -> None:
        self.stream, self.at = stream, len(stream.ops)

    def query(self) -> bool:
        return self.stream is not None and self.stream.done >= self.at

    def synchronize(self) -> None:
        assert self.stream is not None
        self.stream.run(self.at)


def _wrapper_class(stream: LaggingStream, delivered: list[tuple[int, list[int]]]) -> type:
    class ScheduleSpy(FlashInferStandIn):
        """The stand-in whose plan writes a schedule (the plan's number and the batch's last-page
        lengths) into the pinned buffer it finds and enqueues that buffer's copy, as FlashInfer's."""

        plans_made = 0

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._int_workspace_buffer = torch.zeros(64, dtype=torch.uint8)
            self._pin_memory_int_workspace_buffer = torch.zeros(64, dtype=torch.uint8)

        def plan(self, indptr: torch.Tensor, indices: torch.Tensor, last_page_len: torch.Tensor, *args: Any,
                 **kwargs: Any) -> None:
            super().plan(indptr, indices, last_page_len, *args, **kwargs)
            number = type(self).plans_made = type(self).plans_made + 1
            schedule = torch.tensor([number, *last_page_len.tolist()], dtype=torch.int32)
            pinned = self._pin_memory_int_workspace_buffer  # the pointer the plan's copy reads later
            pinned.view(torch.int32)[: schedule.numel()] = schedule
            n = schedule.numel()
            stream.ops.append(lambda: delivered.append((number, pinned.view(torch.int32)[:n].tolist())))

    return ScheduleSpy


def _decode(ring: bool) -> tuple[FlashInferLayeredDecode, LaggingStream, list[tuple[int, list[int]]]]:
    stream, delivered = LaggingStream(), []
    schedule_ring = PinnedUploadRing("cpu", slots=SCHEDULE_SLOTS, pin=False, new_event=LaggingEvent,
                                     current_stream=lambda: stream) if ring else None
    decode = FlashInferLayeredDecode("cpu", 16, wrapper_class=_wrapper_class(stream, delivered), workspace_bytes=64,
                                     schedule_ring=schedule_ring)
    return decode, stream, delivered


def _view(last: list[int]) -> LayerView:
    rows = len(last)
    cache = torch.zeros(16, PAGE, KV_HEADS, DIM)
    return LayerView(layer=0, k_cache=cache, v_cache=cache, kv_indptr=torch.arange(rows + 1, dtype=torch.int32),
                     kv_indices=torch.arange(rows, dtype=torch.int32), kv_lens=torch.tensor(last, dtype=torch.int32),
                     last_page_len=torch.tensor(last, dtype=torch.int32), rids=())


def _steps(decode: FlashInferLayeredDecode, lasts: list[list[int]]) -> None:
    """One graph plan a step, on the same graph wrapper (the same batch size): no copy runs between."""
    for last in lasts:
        decode.plan_graph(_view(last), (AttentionParams(num_qo_heads=4),))


def test_each_plans_copy_delivers_its_own_schedule_while_the_gpu_lags():
    decode, stream, delivered = _decode(ring=True)
    _steps(decode, [[1, 2], [3, 4]])
    stream.run()
    assert delivered == [(1, [1, 1, 2]), (2, [2, 3, 4])]
    assert decode.schedule_ring is not None and decode.schedule_ring.waits == 0


def test_control_one_pinned_buffer_a_wrapper_delivers_the_later_schedule():
    """FlashInfer's own pinned buffer (no ring): step 1's copy, still queued when step 2 plans,
    reads step 2's schedule -- step 1's replay would run with step 2's split schedule."""
    decode, stream, delivered = _decode(ring=False)
    _steps(decode, [[1, 2], [3, 4]])
    stream.run()
    assert delivered == [(1, [2, 3, 4]), (2, [2, 3, 4])]


def test_the_ring_grows_before_it_waits_and_a_wait_lets_the_gpu_catch_up():
    """Plans while nothing runs on the stream: the ring adds slots up to GROW_TO times its own, then
    waits (the wait runs the stream up to the event of the slot coming round); every copy still
    delivers its own plan's schedule."""
    decode, stream, delivered = _decode(ring=True)
    ring = decode.schedule_ring
    assert ring is not None
    steps = GROW_TO * SCHEDULE_SLOTS + 3
    _steps(decode, [[n % 4 + 1, n % 3 + 1] for n in range(steps)])
    assert ring.slots == GROW_TO * SCHEDULE_SLOTS and ring.waits >= 1 and 0 < stream.done < steps
    stream.run()
    assert delivered == [(n + 1, [n + 1, n % 4 + 1, n % 3 + 1]) for n in range(steps)]
    assert ring.grown == ring.slots  # one pinned buffer a slot, each the int workspace's size


def test_on_a_cpu_without_a_ring_given_none_is_made():
    decode, _, _ = _decode(ring=False)
    assert decode.schedule_ring is None
