"""gpu-check's prefill phase times the kernel, the torch loop and SDPA in alternating rounds, so a
GPU clock that ramps or throttles during the phase moves all three alike (run 23 on an H200 timed
them one block after another). Timed on a simulated clock: no test here reads real time."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from sglang_ext.dataplane import bench_env
from sglang_ext.tools.gpu_check_config import SMALL
from sglang_ext.tools.gpu_check_extend import ROUNDS, WARMUP, ExtendCheck


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    """A simulated ``time.perf_counter`` for ``bench_env.time_ms``; functions advance it."""
    state = SimpleNamespace(now=0.0, calls=0, drift=0.0, log=[])
    monkeypatch.setattr(bench_env, "time", SimpleNamespace(perf_counter=lambda: state.now))
    return state


def _fn(clock: SimpleNamespace, name: str, ms: float):
    def fn() -> None:  # ``ms``, slowed by ``drift`` per call made so far by any function
        clock.calls += 1
        clock.log.append(name)
        clock.now += ms * 1e-3 * (1 + clock.drift * clock.calls)
    return fn


def test_the_three_are_timed_in_alternating_rounds_after_their_warm_ups(clock: SimpleNamespace) -> None:
    """Each is warmed, then the rounds alternate a, b, c, and each median is its own function's time."""
    got = ExtendCheck(SMALL, "cpu")._interleaved_ms([_fn(clock, "a", 1.0), _fn(clock, "b", 4.0), _fn(clock, "c", 2.0)])
    rounds = max(SMALL.repeat, ROUNDS)
    assert clock.log == ["a"] * (WARMUP + 1) + ["b"] * (WARMUP + 1) + ["c"] * (WARMUP + 1) + ["a", "b", "c"] * rounds
    assert got == pytest.approx([1.0, 4.0, 2.0])


def test_a_drifting_clock_moves_interleaved_figures_alike(clock: SimpleNamespace) -> None:
    """The same function timed twice under a clock slowing 5% a call reads within 5% of itself
    interleaved. Control: timed one block after the other (run 23's way), the second reads over
    20% slower."""
    clock.drift = 0.05
    first, second = ExtendCheck(SMALL, "cpu")._interleaved_ms([_fn(clock, "x", 2.0), _fn(clock, "x", 2.0)])
    assert second / first == pytest.approx(1.0, abs=0.05)
    clock.calls = 0
    rounds = max(SMALL.repeat, ROUNDS)
    block_a = bench_env.time_ms(_fn(clock, "x", 2.0), "cpu", rounds, warmup=WARMUP)
    block_b = bench_env.time_ms(_fn(clock, "x", 2.0), "cpu", rounds, warmup=WARMUP)
    assert block_b / block_a > 1.2
