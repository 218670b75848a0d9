"""Inputs that used to hang or crash the planner and the profile it plans with (a review of the
control plane, session 41): a large batch whose pauses are decided by the bound, a compute
profile of zeros, a report of a step that took no time."""

from __future__ import annotations

import random

import pytest

from controlplane.controller.profile_tracker import ProfileTracker
from controlplane.model import Batch, Profile
from controlplane.planner import Planner
from controlplane.planner.slo_cap import late_fraction


def _batch(n: int, layers: int, share: float, seed: int = 0, comp: float = 0.01) -> Batch:
    rng = random.Random(seed)
    ctx = [rng.randint(200, 8000) for _ in range(n)]
    blocks = sum(-(-c // 16) for c in ctx)
    return Batch.from_dict({
        "model": {"layers": layers, "block_size": 16, "block_bytes": 65536},
        "hardware": {"gpu_kv_budget_blocks": max(1, int(blocks * layers * share)), "h2d_gbps": 25.0},
        "profile": {"layer_compute_ms": comp},
        "requests": [{"id": f"r{i}", "context_tokens": c, "slo_tbt_ms": rng.choice([50.0, 200.0, 1000.0])}
                     for i, c in enumerate(ctx)],
    })


def _one_at_a_time(planner: Planner, batch: Batch) -> int:
    """The reference: pause victims in order while the bound refuses what is left."""
    victims = planner._victim_order(batch, "largest", None)
    reqs = list(batch.requests)
    k = 0
    while reqs and not planner._bound_allows(batch, tuple(reqs), layouts_only=True):
        reqs.remove(victims[k])
        k += 1
    return k


@pytest.mark.parametrize("seed", range(12))
def test_the_bound_prefix_pauses_what_pausing_one_at_a_time_would(seed):
    """Bisection over the victims finds the same number of bound-decided pauses as the loop it
    replaced, on batches from comfortable to hopeless; control: the batches do need pauses."""
    rng = random.Random(100 + seed)
    batch = _batch(rng.randint(2, 60), rng.choice([1, 2, 8, 32]), rng.choice([0.02, 0.1, 0.3, 0.6, 1.2]), seed)
    planner = Planner()
    victims = planner._victim_order(batch, "largest", None)
    assert planner._bound_prefix(batch, victims) == _one_at_a_time(planner, batch)


def test_the_reference_cases_include_bound_pauses():
    """Control for the comparison above: some of its batches pause by the bound, some do not."""
    planner = Planner()
    ks = []
    for seed in range(12):
        rng = random.Random(100 + seed)
        batch = _batch(rng.randint(2, 60), rng.choice([1, 2, 8, 32]), rng.choice([0.02, 0.1, 0.3, 0.6, 1.2]), seed)
        ks.append(_one_at_a_time(planner, batch))
    assert min(ks) == 0 and max(ks) > 5, ks


def test_a_large_hopeless_batch_costs_logarithmically_many_bound_evaluations(monkeypatch):
    """2,048 requests of which most must pause: the plan evaluates the bound O(log R) times, not
    once per pause (before: 1,131 evaluations of O(R) each, 0.6 s; 16,384 x 4,096 took 47 s)."""
    batch = _batch(2048, 64, 0.05)
    calls = []
    real = Planner._bound_allows
    monkeypatch.setattr(Planner, "_bound_allows", lambda self, *a, **k: (calls.append(1), real(self, *a, **k))[1])
    plan = Planner().plan(batch)
    assert plan.feasible and len(plan.paused) > 1000
    assert plan.extras["paused_by_bound"] > 1000 and len(calls) <= 40, len(calls)


def test_a_profile_of_zeros_plans_instead_of_dividing_by_zero():
    """layer_compute_ms 0 (the schema allows >= 0): a step of no time is late for nobody, and the
    planner answers whether the batch fits or must offload."""
    assert late_fraction(_batch(3, 4, 1.0).requests, 0.0, 8) == 0.0
    for share in (2.0, 0.3):
        plan = Planner().plan(_batch(6, 4, share, comp=0.0))
        assert plan.feasible


def test_a_step_of_no_time_leaves_the_learnt_profile_alone():
    """observed_step_ms 0 is broken telemetry: the EWMA keeps the profile (scaling by 0 would zero
    it for good: a zero profile predicts 0 ms, and no later scale moves it). Control: a step twice
    the prediction moves it."""
    tracker = ProfileTracker(Profile((0.5,) * 4), 25.0, 65536)
    placement = [(1, 1, 1, 1)]
    tracker.update(ewma_factor=1.0, observed_step_ms=0.0, predicted_step_ms=2.0, placement=placement, blocks=[10])
    assert tracker.layer_compute_ms == (0.5,) * 4
    tracker.update(ewma_factor=1.0, observed_step_ms=4.0, predicted_step_ms=2.0, placement=placement, blocks=[10])
    assert tracker.layer_compute_ms == (1.0,) * 4
