"""`kvplane gpu-check`'s hidden placement is planned at the speed the GPU runs when it is measured:
the layers' compute scaled to the all-resident step timed right before it, not to the first one
(an eager step's time moves with the host: 18.3 ms first and 12.5 ms there on an H200, gpu-check
run 18, and a plan made for the slower step was not hidden once the copies left the SMs)."""

from __future__ import annotations

import pytest

from kvplane.cli import main
from tests.dataplane.test_gpu_check import _result


def test_the_hidden_placement_is_planned_with_the_compute_timed_beside_it(tmp_path, monkeypatch):
    """The compute ``OverlapCheck._choose`` plans with sums to the all-resident step the figure
    compares with, and that step is also the share's bound. Negative control: the first phase's
    all-resident step (what the plan used before) is another figure, so the check can tell."""
    from sglang_ext.tools import gpu_check_overlap

    seen: list[tuple[float, float]] = []
    choose = gpu_check_overlap.OverlapCheck._choose

    def recorded(self, comp_ms, bw, resident_ms):  # noqa: ANN001, ANN202
        seen.append((sum(comp_ms), resident_ms))
        return choose(self, comp_ms, bw, resident_ms)

    monkeypatch.setattr(gpu_check_overlap.OverlapCheck, "_choose", recorded)
    main(["gpu-check", "--device", "cpu", "--skip-tests", "--repeat", "1", "--out-dir", str(tmp_path)])
    _, body = _result(tmp_path)
    overlap, first = body["details"]["overlap"]["resident_step_ms"], body["details"]["resident_step_ms"]
    assert len(seen) == 1
    assert seen[0][0] == pytest.approx(overlap, rel=1e-9) and seen[0][1] == overlap, (seen, overlap)
    assert first != pytest.approx(overlap, rel=1e-9), (first, overlap)  # the control: they differ


def test_the_placed_phase_counts_the_copy_engines_driver_time_once():
    """The placed phase reports the host time inside the copy engines' driver calls (a full copy
    queue blocks them): the batched and the 2-D calls' seconds, one object serving both counted
    once, none on the kernels."""
    from types import SimpleNamespace

    from sglang_ext.tools.gpu_check_placed import driver_seconds, drivers_of

    batched, pitched = SimpleNamespace(call_seconds=0.25), SimpleNamespace(call_seconds=0.5)
    engine = SimpleNamespace(_dma=batched, _pitched=pitched)
    drivers = drivers_of(engine)
    assert driver_seconds(drivers) == 0.75
    engine._pitched = None  # a refusal midway drops the 2-D copies: the held list still counts them
    pitched.call_seconds += 0.5
    assert driver_seconds(drivers) == 1.25 and driver_seconds(drivers_of(engine)) == 0.25
    assert driver_seconds(drivers_of(SimpleNamespace(_dma=batched, _pitched=batched))) == 0.25  # control: once
    assert driver_seconds(drivers_of(SimpleNamespace(_dma=None, _pitched=None))) == 0.0
    assert driver_seconds(drivers_of(SimpleNamespace())) == 0.0  # the CPU engine has neither
