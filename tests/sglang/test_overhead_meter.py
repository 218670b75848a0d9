"""sglang_ext.overhead: kvplane's own time against the scheduler step."""

from __future__ import annotations

import json
import time

import pytest

from sglang_ext.overhead import WRITE_EVERY, OverheadMeter, share_of
from sglang_ext.tools.sglang_bench import OVERHEAD_FILE_ENV, _bench_env


def _count_writes(meter: OverheadMeter) -> list[int]:
    """The step counts at which ``meter`` writes its file from now on (it still writes)."""
    writes: list[int] = []
    real_write = meter.write
    meter.write = lambda: (writes.append(meter.steps), real_write())[1]  # type: ignore[method-assign]
    return writes


def test_share_is_kvplane_time_over_the_rest_of_the_step(tmp_path):
    meter = OverheadMeter(tmp_path / "m.json")
    meter.step_done()  # the first end only starts the clock
    time.sleep(0.02)
    meter.add("end_step", 0.003)
    meter.add("end_step", 0.001)
    meter.add("boundary", 0.001)
    meter.step_done()
    out = meter.summary()
    assert out["steps"] == 1
    assert out["kvplane_s"] == pytest.approx(0.005)
    assert out["parts_s"] == {"boundary": 0.001, "end_step": 0.004}
    assert out["calls"] == {"boundary": 1, "end_step": 2}  # measurements per part
    step = out["step_s"]
    assert step >= 0.02
    assert share_of(out) == pytest.approx(100 * 0.005 / (step - 0.005), rel=1e-3)
    assert out["kvplane_ms_per_step"] == pytest.approx(5.0)


def test_idle_gap_is_not_step_time(tmp_path):
    meter = OverheadMeter(tmp_path / "m.json")
    meter.step_done()
    meter.idle()
    time.sleep(0.05)
    meter.step_done()  # after an idle gap: restarts the clock, counts nothing
    assert meter.summary()["steps"] == 0 and meter.step_s == 0.0
    assert share_of(meter.summary()) is None


def test_kvplane_time_of_an_idle_iteration_is_kept_apart(tmp_path):
    meter = OverheadMeter(tmp_path / "m.json")
    meter.step_done()
    meter.add("boundary", 0.001)
    time.sleep(0.01)
    meter.step_done()
    meter.idle(0.003)  # an iteration that ran nothing: its boundary delayed no step
    out = meter.summary()
    assert out["kvplane_s"] == pytest.approx(0.001) and out["idle_kvplane_s"] == pytest.approx(0.003)
    assert share_of(out) == pytest.approx(100 * 0.001 / (out["step_s"] - 0.001), rel=1e-3)
    meter.add("boundary", 0.003)  # negative control: the same time inside a step counts
    assert meter.summary()["kvplane_s"] == pytest.approx(0.004)


def test_file_is_rewritten_every_write_every_steps(tmp_path):
    path = tmp_path / "m.json"
    meter = OverheadMeter(path)
    for _ in range(WRITE_EVERY):
        meter.add("end_step", 1e-6)
        meter.step_done()
    assert not path.exists()  # WRITE_EVERY - 1 steps counted so far
    meter.step_done()
    assert json.loads(path.read_text())["steps"] == WRITE_EVERY


def test_file_holds_every_step_once_the_scheduler_idles(tmp_path):
    """A workload that ends a few steps short of a multiple of ``WRITE_EVERY`` (the bench reads
    the file once the server finished its runs): the first idle iteration after steps writes
    them all, once (later idle iterations do not rewrite). Negative control: before the idle,
    the file lacks the last steps -- what a bench read while the scheduler was killed, not idle,
    would see."""
    path = tmp_path / "m.json"
    meter = OverheadMeter(path)
    meter.step_done()
    for _ in range(WRITE_EVERY + 5):
        meter.add("end_step", 1e-6)
        meter.step_done()
    assert json.loads(path.read_text())["steps"] == WRITE_EVERY  # the last 5 steps missing
    writes = _count_writes(meter)
    meter.idle()
    assert json.loads(path.read_text())["steps"] == WRITE_EVERY + 5
    meter.idle()
    meter.step_done()  # after an idle gap: restarts the clock, no step counted
    meter.idle()
    assert writes == [WRITE_EVERY + 5]  # written once: nothing new after it


def test_file_is_not_rewritten_when_idle_and_steps_alternate_at_a_multiple(tmp_path):
    """Steps alternating with idle iterations while the count sits at a multiple of
    ``WRITE_EVERY`` (each step after an idle gap counts nothing) write the file once, not at
    every step (negative control: the count reached it once, so one write happened)."""
    meter = OverheadMeter(tmp_path / "m.json")
    writes = _count_writes(meter)
    meter.step_done()
    for _ in range(WRITE_EVERY):
        meter.step_done()
    for _ in range(20):
        meter.idle()
        meter.step_done()
    assert writes == [WRITE_EVERY]


def test_bench_meters_layered_servers_only(tmp_path):
    assert OVERHEAD_FILE_ENV not in _bench_env("vanilla", tmp_path, 0)
    assert OVERHEAD_FILE_ENV not in _bench_env("vanilla-b", tmp_path, 0)
    assert _bench_env("layered", tmp_path, 2)[OVERHEAD_FILE_ENV].endswith("layered-overhead-2.json")
