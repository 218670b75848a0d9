"""LayerTimer on CPU: which steps are sampled and how marks become per-layer times."""

from __future__ import annotations

import time

import pytest

from sglang_ext.layer_timing import LayerTimer


def _step(timer: LayerTimer, *, decode: bool = True, layers: int = 3, sleep_s: float = 0.002):
    timer.begin(decode)
    for layer in range(layers):
        timer.mark(layer)
        time.sleep(sleep_s * (layer + 1))
    timer.end()
    return timer.take()


def test_every_nth_decode_step_is_sampled_and_times_follow_the_marks():
    timer = LayerTimer(3, every=2)
    first = _step(timer)
    assert first is not None and len(first) == 3
    assert first[0] >= 2.0 and first[2] >= 6.0 and first[2] > first[0]
    assert _step(timer) is None  # second decode step: not sampled
    assert _step(timer) is not None
    assert timer.samples == 2


def test_extend_steps_and_incomplete_steps_report_nothing():
    timer = LayerTimer(3, every=1)
    assert _step(timer, decode=False) is None
    assert _step(timer, layers=2) is None  # a layer never marked
    timer.begin(True)
    timer.mark(0)
    assert timer.take() is None  # forward never ended


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="layers >= 1"):
        LayerTimer(0)
