"""LayerTimer on CPU: which steps are sampled and how marks become per-layer times."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")  # sglang_ext.layer_timing times with torch (CUDA events)
from sglang_ext import layer_timing  # noqa: E402
from sglang_ext.layer_timing import LayerTimer  # noqa: E402


class FakeClock:
    """perf_counter stand-in: each layer takes exactly (layer + 1) * 2 ms (no sleeping, so a
    loaded host cannot reorder the times)."""

    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _step(timer: LayerTimer, clock: FakeClock, *, decode: bool = True, layers: int = 3):
    timer.begin(decode)
    for layer in range(layers):
        timer.mark(layer)
        clock.t += 0.002 * (layer + 1)
    timer.end()
    return timer.take()


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(layer_timing.time, "perf_counter", fake)
    return fake


def test_every_nth_decode_step_is_sampled_and_times_follow_the_marks(clock: FakeClock):
    timer = LayerTimer(3, every=2)
    first = _step(timer, clock)
    assert first == pytest.approx((2.0, 4.0, 6.0))
    assert _step(timer, clock) is None  # second decode step: not sampled
    assert _step(timer, clock) is not None
    assert timer.samples == 2


def test_extend_steps_and_incomplete_steps_report_nothing(clock: FakeClock):
    timer = LayerTimer(3, every=1)
    assert _step(timer, clock, decode=False) is None
    assert _step(timer, clock, layers=2) is None  # a layer never marked
    timer.begin(True)
    timer.mark(0)
    assert timer.take() is None  # forward never ended


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="layers >= 1"):
        LayerTimer(0)


def test_under_the_overlap_loop_take_returns_the_processed_steps_marks_not_the_launched_ones(clock: FakeClock):
    """SGLang's overlap loop launches step k+1 before it processes step k: ``take`` after the
    second ``end`` returns step k's times (2/4/6 ms), then step k+1's (its layers take 3x longer
    here). Taking the newest instead -- what a single-slot timer does -- would swap them."""
    timer = LayerTimer(3, every=1)
    timer.begin(True)
    for layer in range(3):
        timer.mark(layer)
        clock.t += 0.002 * (layer + 1)
    timer.end()  # step k launched and ended on the host
    timer.begin(True)  # step k+1 launched before step k's results are processed
    for layer in range(3):
        timer.mark(layer)
        clock.t += 0.006 * (layer + 1)
    timer.end()
    assert timer.take() == pytest.approx((2.0, 4.0, 6.0))  # processing step k
    assert timer.take() == pytest.approx((6.0, 12.0, 18.0))  # processing step k+1
    assert timer.take() is None and timer.samples == 2


def test_the_wait_on_a_layers_fetches_is_not_its_compute(clock: FakeClock):
    """A layer that waits on its fetches (ready marked after the wait) reports its compute from
    the ready mark: the wait is kept apart (last_stall_ms); layers without a ready mark are timed
    from their entry. Negative control: the same marks without ``ready`` put the wait in the
    layer's time, as before."""
    timer = LayerTimer(3, every=1)
    for with_ready in (True, False):
        timer.begin(True)
        for layer in range(3):
            timer.mark(layer)
            if layer == 1:
                clock.t += 0.010  # a 10 ms stall on layer 1's fetches
                if with_ready:
                    timer.ready(layer)
            clock.t += 0.002 * (layer + 1)
        timer.end()
        got = timer.take()
        if with_ready:
            assert got == pytest.approx((2.0, 4.0, 6.0))
            assert timer.last_stall_ms == pytest.approx((0.0, 10.0, 0.0))
        else:
            assert got == pytest.approx((2.0, 14.0, 6.0))
    timer.begin(True)
    timer.ready(0)  # a ready mark without an entry mark is ignored
    assert timer._ready == {}


def test_the_served_backend_marks_ready_after_the_pools_wait(clock: FakeClock):
    """The layered attention backend's per-layer entry (``_begin_layer``, what SGLang's forward
    calls) marks the entry, lets the pool wait on the layer's fetches, then marks ready: the wait
    (here the pool's enter_layer advancing the clock by 10 ms) is not the layer's compute. A
    steady or idle step (nothing staged) waits on nothing and marks no ready."""
    from types import SimpleNamespace

    from sglang_ext.layered_attention import LayeredTorchNativeAttnBackend

    def enter_layer(layer: int) -> None:
        clock.t += 0.010

    backend = SimpleNamespace(overhead_meter=None, layer_timer=LayerTimer(2, every=1), steady=False, idle=False,
                              pool=SimpleNamespace(start_layer=0, enter_layer=enter_layer))
    for steady, idle, stall in ((False, False, 10.0), (True, False, 0.0), (False, True, 0.0)):
        backend.steady, backend.idle = steady, idle
        backend.layer_timer.begin(True)
        for layer in range(2):
            LayeredTorchNativeAttnBackend._begin_layer(backend, layer)
            clock.t += 0.003
        backend.layer_timer.end()
        assert backend.layer_timer.take() == pytest.approx((3.0, 3.0))
        assert backend.layer_timer.last_stall_ms == pytest.approx((stall, stall))
