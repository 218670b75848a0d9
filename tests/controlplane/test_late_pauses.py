"""Pauses decided after the planner's budget ran out take O(log R) searches (late_pauses), not
one search per pause: a what-if plan of 16,384 requests x 16 layers took 32 s at the default
40 ms budget (1.6 s now), holding the control plane's what-if gate all the while."""

from __future__ import annotations

import math

import pytest

import controlplane.planner.planner as planner_module
from controlplane.model import Batch
from controlplane.planner import Planner
from controlplane.planner.late_pauses import late_pause_count


def _batch(n: int, layers: int = 16, share: float = 0.5) -> Batch:
    return Batch.from_dict({
        "model": {"layers": layers, "block_size": 16, "block_bytes": 65536},
        "hardware": {"gpu_kv_budget_blocks": int(n * layers * 63 * share), "h2d_gbps": 25.0},
        "profile": {"layer_compute_ms": 0.05},
        "requests": [{"id": f"r{i}", "context_tokens": 1000, "slo_tbt_ms": 100.0 + i} for i in range(n)],
        "policy": {"alpha": 1.0, "window_min": 1, "window_max": 1000000},
    })


def _one_at_a_time(reqs, rest, search):  # noqa: ANN001, ANN202 - the loop it replaces
    for m in range(1, len(rest) + 1):
        gone = {v.id for v in rest[:m]}
        left = tuple(r for r in reqs if r.id not in gone)
        got = search(left) if left else None
        if got is not None or not left:
            return m, got
    return len(rest), None


class _Req:
    def __init__(self, rid: str) -> None:
        self.id = rid


@pytest.mark.parametrize("n", [1, 2, 3, 7, 8, 9, 100])
@pytest.mark.parametrize("fits", [0, 1, 2, 5, 50, 99, 1000])
def test_the_count_is_the_loops_on_monotone_searches(n, fits):
    """A search that plans once at most ``fits`` requests are left: the same count and plan as
    pausing one at a time, in at most 2 log2(n) + 2 searches."""
    reqs = tuple(_Req(f"r{i}") for i in range(n))
    calls = []

    def search(left):  # noqa: ANN001, ANN202
        calls.append(len(left))
        return ("plan", len(left)) if len(left) <= fits else None

    got = late_pause_count(reqs, reqs, search)
    assert got == _one_at_a_time(reqs, reqs, search)
    calls.clear()
    late_pause_count(reqs, reqs, search)
    assert len(calls) <= 2 * math.log2(max(n, 2)) + 2, calls


def test_a_plan_past_its_budget_pauses_what_the_loop_would_in_few_searches(monkeypatch):
    """1,024 requests of which 374 must pause (344 by the bound), at a zero budget: the plan pauses
    the same requests as the one-at-a-time loop in a handful of window searches. Negative control:
    the loop takes one search per pause (31)."""
    searches = []
    real = Planner._best_window
    monkeypatch.setattr(Planner, "_best_window", lambda self, *a, **k: (searches.append(1), real(self, *a, **k))[1])
    fast = Planner().plan(_batch(1024), time_budget_ms=0)
    fast_searches = len(searches)
    searches.clear()
    monkeypatch.setattr(planner_module, "late_pause_count", _one_at_a_time)
    slow = Planner().plan(_batch(1024), time_budget_ms=0)
    assert fast.feasible and len(fast.paused) > 100
    assert fast.paused == slow.paused and slow.feasible  # the layouts may differ (the searches' warm starts)
    assert fast.predicted_step_ms == pytest.approx(slow.predicted_step_ms, rel=0.05)
    assert fast_searches <= 15 < 25 < len(searches), (fast_searches, len(searches))


def test_a_small_batch_out_of_time_keeps_the_loop(monkeypatch):
    """At most LATE_BISECT_MIN requests left: the loop, as before (bisection may pause more where
    the searches are not monotone). Control: the bisection is not called."""
    monkeypatch.setattr(planner_module, "late_pause_count", lambda *a: pytest.fail("bisected a small batch"))
    plan = Planner().plan(_batch(64), time_budget_ms=0)
    assert plan.feasible and plan.paused
