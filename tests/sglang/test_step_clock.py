"""StepClock: a step's time without and with SGLang's overlap loop (launch k+1, then process k)."""

from __future__ import annotations

import pytest

from sglang_ext.step_clock import StepClock


def test_without_overlap_a_step_is_its_launch_to_its_processing():
    clock = StepClock()
    clock.launched(10.000)
    assert clock.processed(10.004) == pytest.approx(4.0)
    clock.launched(10.010)  # an idle gap of 6 ms before the next launch is not the step's
    assert clock.processed(10.015) == pytest.approx(5.0)


def test_under_the_overlap_loop_a_busy_step_is_the_gap_between_consecutive_results():
    """Step 2 is launched at 1 ms, before step 1 is processed at 5 ms; step 2 is processed at 9 ms:
    its time is 4 ms (5 -> 9), not 8 ms from its launch -- the figure a request sees between two
    tokens (the plain launch-to-processing span reads 8 ms, and pairing step 1's result with the
    newest launch, step 2's, 4 ms: both fail the first two checks)."""
    clock = StepClock()
    clock.launched(0.000)  # step 1
    clock.launched(0.001)  # step 2, launched before step 1 is processed
    assert clock.processed(0.005) == pytest.approx(5.0)  # step 1: 0 -> 5
    clock.launched(0.006)  # step 3
    assert clock.processed(0.009) == pytest.approx(4.0)  # step 2: 5 -> 9
    assert clock.processed(0.013) == pytest.approx(4.0)  # step 3: 9 -> 13 (launched at 6)
    assert clock.processed(0.020) is None  # nothing launched: no time
