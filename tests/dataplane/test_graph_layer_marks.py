"""Per-layer timing of replayed decode graphs (``GraphLayerMarks`` + ``LayerTimer.replayed``), on
the CPU with stand-in events: a graph's capture records one entry and one ready event per layer
(in ``GraphStepBuffers.enter``, around the layer's wait on its fetches), every replay records the
same events again on the device, and a sampled replayed step's per-layer times come from them as
an eager step's come from its own. The device half -- that a real capture turns the records into
graph nodes a replay re-records -- is ``test_graph_layer_marks_gpu.py``."""

from __future__ import annotations

import pytest
import torch

from sglang_ext.dataplane.graph_layer_marks import GraphLayerMarks
from sglang_ext.dataplane.graph_step_buffers import GraphStepBuffers
from sglang_ext.layer_timing import LayerTimer
from sglang_ext.testing.stamp_clock import StampClock

LAYERS = 3


def _buffers(clock: StampClock) -> GraphStepBuffers:
    buffers = GraphStepBuffers(LAYERS, 4, 8, "cpu")
    assert buffers.marks is None  # the CPU: no graph timing unless given (module docstring)
    buffers.marks = GraphLayerMarks(LAYERS, clock.event, clock)
    return buffers


def _capture(buffers: GraphStepBuffers, clock: StampClock, size: int) -> None:
    """What a capture's layers call: each layer's ``enter`` (the marks around its wait)."""
    buffers.batch = size
    clock.capturing = True
    for layer in range(LAYERS):
        buffers.enter(layer)
    clock.capturing = False


def _replay(marks: tuple[dict, dict], clock: StampClock, stalls: list[float], layer_ms: list[float]) -> None:
    """The device replays the graph: layer l waits ``stalls[l]`` ms, then computes ``layer_ms[l]``;
    the graph's own event nodes stamp the entry and ready events as it goes."""
    entry, ready = marks
    for layer in range(LAYERS):
        entry[layer].record()
        clock.ms += stalls[layer]
        ready[layer].record()
        clock.ms += layer_ms[layer]


def _timer(clock: StampClock) -> LayerTimer:
    return LayerTimer(LAYERS, every=1, event=clock.event)


def test_a_sampled_replay_is_timed_by_the_events_its_graph_records():
    clock = StampClock()
    buffers = _buffers(clock)
    _capture(buffers, clock, 4)
    marks = buffers.marks.of(4)
    assert marks is not None and buffers.marks.of(2) is None  # only the captured size records
    timer = _timer(clock)
    clock.ms = 100.0
    timer.begin(True)
    timer.replayed(marks)
    _replay(marks, clock, stalls=[0.5, 0.0, 0.25], layer_ms=[1.0, 2.0, 3.0])
    clock.ms += 0.75  # LM head and sampling: the last layer's share, as an eager step's
    timer.end()
    assert timer.take() == (1.0, 2.0, 3.75)
    assert timer.last_stall_ms == (0.5, 0.0, 0.25)


def test_a_replay_of_the_same_graph_before_the_sample_is_read_drops_it():
    """SGLang's overlap loop launches step k+1 before it processes step k: when k+1 replays the
    same graph its nodes stamp the same events, so step k's sample is dropped; control: read first."""
    clock = StampClock()
    buffers = _buffers(clock)
    _capture(buffers, clock, 4)
    marks = buffers.marks.of(4)
    timer = _timer(clock)

    def step(sampled: bool) -> None:
        timer.begin(True)
        if not sampled:
            timer._armed = False  # noqa: SLF001 - an unsampled step replays all the same
        timer.replayed(marks)
        _replay(marks, clock, [0.0] * LAYERS, [1.0, 1.0, 1.0])
        timer.end()

    step(True)
    step(False)  # the next step replays before the first one is processed
    assert timer.take() is None and clock.reads == 0  # dropped unread
    assert timer.take() is None  # (the unsampled one)
    step(True)
    assert timer.take() == (1.0, 1.0, 1.0) and clock.reads > 0  # control: read before another replay


def test_only_the_capture_records_so_eager_runs_over_the_buffers_keep_the_captured_events():
    """The capture's warm-ups and an eager run over the same buffers call ``enter`` too: they must
    not replace the events the graph records (a timer would read events no replay stamps)."""
    clock = StampClock()
    buffers = _buffers(clock)
    buffers.batch = 4
    for layer in range(LAYERS):  # a warm-up, before the capture
        buffers.enter(layer)
    assert buffers.marks.of(4) is None
    _capture(buffers, clock, 4)
    captured = buffers.marks.of(4)
    for layer in range(LAYERS):  # an eager run after it
        buffers.enter(layer)
    assert buffers.marks.of(4) is captured
    assert all(captured[0][layer] is not captured[1][layer] for layer in range(LAYERS))


def test_a_graph_that_records_some_layers_only_gives_no_marks_and_a_step_without_marks_is_unreported():
    clock = StampClock()
    marks = GraphLayerMarks(LAYERS, clock.event, clock)
    clock.capturing = True
    marks.mark(0, 2)
    marks.ready(0, 2)
    assert marks.of(2) is None
    timer = _timer(clock)
    timer.begin(True)
    timer.replayed(None)  # a graph recording no marks: the sampled step has none
    timer.end()
    assert timer.take() is None


def test_a_graph_replayed_before_its_events_were_ever_recorded_is_unreported():
    """Events never stamped (read as CUDA reads them: an error) give no sample, not a crash."""
    clock = StampClock()
    entry = {layer: clock.event() for layer in range(LAYERS)}
    ready = {layer: clock.event() for layer in range(LAYERS)}
    timer = _timer(clock)
    timer.begin(True)
    timer.replayed((entry, ready))
    timer.end()
    assert timer.take() is None


def test_the_cpu_timer_ignores_graph_marks_and_the_cpu_has_none():
    """On the CPU the timer's marks are clock readings and the emulated graphs replay no events."""
    assert GraphLayerMarks.for_device(LAYERS, "cpu") is None
    clock = StampClock()
    timer = LayerTimer(LAYERS, every=1)
    timer.begin(True)
    timer.replayed(({0: clock.event()}, {}))
    timer.end()
    assert timer.take() is None


def test_marks_need_a_layer():
    with pytest.raises(ValueError, match="layers >= 1"):
        GraphLayerMarks(0, lambda: None, lambda: False)


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_no_marks_off_cuda(device: str):
    assert GraphLayerMarks.for_device(2, torch.device(device)) is None


def test_a_size_captured_twice_gives_no_marks():
    """SGLang 0.5.23 may capture two graphs of one size (LoRA and no-LoRA): which one replays is
    not known here, so the size gives no events rather than the other graph's stale ones.
    Control: captured once, it gives them."""
    clock = StampClock()
    buffers = _buffers(clock)
    _capture(buffers, clock, 4)
    _capture(buffers, clock, 2)
    assert buffers.marks.of(4) is not None and buffers.marks.of(2) is not None
    _capture(buffers, clock, 4)
    assert buffers.marks.of(4) is None and buffers.marks.of(2) is not None


def test_a_recapture_gives_each_size_its_new_graphs_marks():
    """SGLang's recapture (a weight update) captures every size again; the older graphs never
    replay, so each size gives its new capture's events, not none (the control: the same second
    capture without ``recapture`` is read as a second graph of the size and gives none)."""
    clock = StampClock()
    buffers = _buffers(clock)
    _capture(buffers, clock, 4)
    old = buffers.marks.of(4)
    buffers.marks.recapture()
    assert buffers.marks.of(4) is None  # until the size is captured again
    _capture(buffers, clock, 4)
    new = buffers.marks.of(4)
    assert new is not None and all(new[0][layer] is not old[0][layer] for layer in range(LAYERS))
    _capture(buffers, clock, 4)  # control: captured again without a recapture
    assert buffers.marks.of(4) is None


@pytest.mark.parametrize("recaptured", [True, False], ids=["recapture", "control-none"])
def test_a_recapture_of_the_buffers_renews_the_staged_copies_marks_too(recaptured):
    """``GraphStepBuffers.recapture`` forgets the staging's copy marks as well as the layers' (a
    replayed staged step books its copies' times from them: without this every size gave none after
    SGLang's recapture -- review, session 92); the older events are dropped. Control: captured
    again without the recapture, both give none."""
    from types import SimpleNamespace

    clock = StampClock()
    buffers = _buffers(clock)
    copies = GraphLayerMarks(2, clock.event, clock)
    staging = SimpleNamespace(copy_marks=copies)  # the staging's marks only (its launches: not here)

    def capture() -> None:
        buffers.staging = None
        _capture(buffers, clock, 4)
        buffers.staging = staging
        clock.capturing = True
        for slot in range(2):
            copies.mark(slot, 4)
            copies.ready(slot, 4)
        clock.capturing = False

    capture()
    assert buffers.marks.of(4) is not None and copies.of(4) is not None
    if recaptured:
        buffers.recapture()
        assert not copies._kept and not buffers.marks._kept
    capture()
    got = (buffers.marks.of(4) is not None, copies.of(4) is not None)
    assert got == ((True, True) if recaptured else (False, False)), got


def test_no_marks_on_rocm(monkeypatch: pytest.MonkeyPatch):
    """HIP does not time events recorded inside graphs (ROCm/rocm-systems#2380). Control: a CUDA
    build gets marks (made without touching a device)."""
    monkeypatch.setattr(torch.version, "hip", None)
    assert GraphLayerMarks.for_device(2, "cuda") is not None
    monkeypatch.setattr(torch.version, "hip", "6.4.0")
    assert GraphLayerMarks.for_device(2, "cuda") is None
