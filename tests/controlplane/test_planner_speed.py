"""The planner's fast paths (bound pausing, analytic windows, prefix-sum evaluator, satisficing
probes, CBC gating) against the slow, obviously-correct definitions."""

from __future__ import annotations

import itertools
import math
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controlplane.model import Batch, RequestSpec, memory_blocks, step_time_ms
from controlplane.planner import Planner, candidate_set
from controlplane.planner.evaluator import Evaluator
from controlplane.planner.mip_search import MipStage
from controlplane.planner.placement_search import PlacementSearch
from controlplane.planner.slo_cap import cap_view
from controlplane.planner.slo_cap import late_fraction as _late
from controlplane.planner.slo_cap import max_step_ms as _max_step_ms
from tests.controlplane.test_planner import make_batch


def optimum_at(batch: Batch, ids: list[str], window: int) -> float:
    """Exhaustive optimum step time of the requests ``ids`` at ``window`` (inf if none fits)."""
    rows = candidate_set(batch.model.layers).rows
    reqs = [r for r in batch.requests if r.id in set(ids)]
    blocks = [r.blocks(batch.model.block_size, window) for r in reqs]
    best = math.inf
    for choice in itertools.product(range(len(rows)), repeat=len(blocks)):
        placement = [rows[c] for c in choice]
        if sum(memory_blocks(placement, blocks)) <= batch.hardware.gpu_kv_budget_blocks:
            best = min(
                best,
                step_time_ms(
                    placement, blocks, batch.profile.layer_compute_ms, batch.bw_blocks_per_ms
                ),
            )
    return best


def slo_feasible(batch: Batch, ids: list[str], window: int) -> bool:
    """The survivors fit and meet the SLO cap as the planner applies it (:func:`cap_view`: an SLO
    below the all-resident step counts from that step)."""
    reqs = [r for r in cap_view(batch, [])[0].requests if r.id in set(ids)]
    t = optimum_at(batch, ids, window)
    return not reqs or (t < math.inf and _late(reqs, t, window) <= batch.policy.alpha + 1e-12)


pause_batches = st.builds(
    lambda contexts, factors, deposits, layers, comp, gbps, frac, alpha: make_batch(
        contexts,
        layers=layers,
        comp=comp,
        gbps=gbps,
        # SLOs around the all-on-GPU step, so that offloading decides who must pause
        slo=[comp * layers * factors[i % len(factors)] for i in range(len(contexts))],
        deposits=(deposits + [0] * len(contexts))[: len(contexts)],
        alpha=alpha,
        window=(1, 8),
        budget=max(1, int(frac * sum(c + 1 for c in contexts) * layers)),
    ),
    contexts=st.lists(st.integers(1, 40), min_size=1, max_size=3),
    factors=st.lists(st.floats(0.9, 3.0), min_size=1, max_size=3),
    deposits=st.lists(st.integers(0, 6), max_size=3),
    layers=st.integers(1, 5),
    comp=st.floats(0.1, 3.0),
    gbps=st.floats(0.5, 30.0),
    frac=st.floats(0.2, 1.1),
    alpha=st.sampled_from([0.0, 0.3, 1.0]),
)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=pause_batches)
def test_pauses_are_exactly_the_necessary_prefix_of_the_victim_order(batch):
    """Victims follow the rule's order; survivors are feasible at the chosen window; with the last victim back even window_min is infeasible (bound pauses never over-pause)."""
    plan = Planner().plan(batch, time_budget_ms=10_000)
    order = [r.id for r in Planner._victim_order(batch, "largest", None)]  # type: ignore[arg-type]
    assert list(plan.paused) == order[: len(plan.paused)]
    survivors = [r.id for r in batch.requests if r.id not in plan.paused]
    assert set(plan.placements) == set(survivors)
    if survivors:
        assert slo_feasible(batch, survivors, plan.window_steps)
    if plan.paused:
        restored = [*survivors, plan.paused[-1]]
        assert not slo_feasible(batch, restored, batch.policy.window_min)


@settings(max_examples=60, deadline=None)
@given(batch=pause_batches)
def test_step_lower_bound_is_below_every_feasible_assignment(batch):
    """Planner.step_lower_bound_ms never exceeds the exhaustive optimum (inf exactly when nothing fits)."""
    ids = [r.id for r in batch.requests]
    lb = Planner.step_lower_bound_ms(batch, batch.requests, 1)
    best = optimum_at(batch, ids, 1)
    if math.isinf(best):
        assert math.isinf(lb) or lb >= sum(batch.profile.layer_compute_ms)
    else:
        assert lb <= best * (1 + 1e-9)


@settings(max_examples=200, deadline=None)
@given(
    slos=st.lists(st.floats(0.1, 200.0), min_size=1, max_size=8),
    deposits=st.lists(st.integers(0, 30), min_size=8, max_size=8),
    window=st.integers(1, 40),
    alpha=st.sampled_from([0.0, 0.25, 1.0, 2.5]),
    floor=st.floats(0.05, 50.0),
)
def test_max_step_is_the_late_fraction_threshold(slos, deposits, window, alpha, floor):
    """_max_step_ms is the largest step time whose late fraction is within alpha (-1 below the floor, inf if none is late)."""
    reqs = [
        RequestSpec(f"r{i}", 10, s, d) for i, (s, d) in enumerate(zip(slos, deposits, strict=False))
    ]
    t = _max_step_ms(reqs, window, alpha, floor)
    if t < 0:
        assert _late(reqs, floor, window) > alpha
    elif math.isinf(t):
        assert _late(reqs, 1e15, window) <= alpha + 1e-9
    else:
        assert t >= floor
        assert _late(reqs, t, window) <= alpha + 1e-9
        assert _late(reqs, t * (1 + 1e-6) + 1e-9, window) > alpha


@settings(max_examples=150, deadline=None)
@given(
    blocks=st.lists(st.sampled_from([1, 3, 7, 7, 20, 45]), min_size=1, max_size=7),
    layers=st.integers(1, 20),
    data=st.data(),
)
def test_prefix_sum_evaluator_matches_heap_and_model_with_cutoffs(blocks, layers, data):
    """exact_ms equals the event-heap version and model.step_time_ms (with and without a fetch
    launch cost); with a cutoff it is exact below it and inf at or above it; the lower bound stays
    below it."""
    cs = candidate_set(layers)
    comp = data.draw(
        st.lists(st.sampled_from([0.0, 0.3, 1.0, 2.5]), min_size=layers, max_size=layers)
    )
    bw = data.draw(st.floats(0.2, 50.0))
    assign = data.draw(
        st.lists(st.integers(0, cs.size - 1), min_size=len(blocks), max_size=len(blocks))
    )
    launch = data.draw(st.sampled_from([0.0, 0.0, 0.05, 0.4, 1.5]))
    ev = Evaluator(cs, blocks, comp, bw, launch_ms=launch)
    exact = step_time_ms([cs.rows[c] for c in assign], blocks, comp, bw, launch_ms=launch)
    got = ev.exact_ms(assign)
    assert got == pytest.approx(exact, rel=1e-9, abs=1e-12)
    assert ev.exact_heap_ms(assign) == pytest.approx(exact, rel=1e-9, abs=1e-12)
    assert ev.lower_bound_ms(assign) <= got * (1 + 1e-9) + 1e-12
    cutoff = exact * data.draw(st.floats(0.3, 1.7))
    cut = ev.exact_ms(assign, cutoff)
    assert cut == got or (math.isinf(cut) and got >= cutoff * (1 - 1e-9))


def test_satisfied_probe_stops_early_and_resume_continues():
    """A search with a reachable target stops at the first plan meeting it; resume() improves it to the full search's answer."""
    contexts = [3000, 9000, 17000, 30000, 52000, 2000, 12000]
    blocks = [-(-c // 16) for c in contexts]
    ev = Evaluator(candidate_set(32), blocks, [0.4] * 32, 25e9 / 1e3 / 65536)
    budget = int(0.5 * sum(blocks) * 32)
    full = PlacementSearch(ev, budget, time.perf_counter() + 60).run(exact=False)
    assert full is not None
    probe = PlacementSearch(ev, budget, time.perf_counter() + 60, target_ms=full.step_ms * 1.5)
    first = probe.run(exact=False)
    assert first is not None and full.step_ms <= first.step_ms <= full.step_ms * 1.5
    assert "local" not in probe.done
    resumed = probe.resume(time.perf_counter() + 60)
    assert resumed is not None and resumed.step_ms <= first.step_ms
    assert resumed.step_ms <= full.step_ms * 1.01


def test_cbc_stage_runs_when_affordable_and_never_on_a_short_budget():
    """CBC (python-mip) is part of the search with a generous budget and is skipped under a few ms."""
    contexts = [3000, 9000, 17000, 30000, 52000, 2000, 12000, 7000, 800]
    blocks = [-(-c // 16) for c in contexts]
    ev = Evaluator(candidate_set(32), blocks, [0.4] * 32, 25e9 / 1e3 / 65536)
    budget = int(0.5 * sum(blocks) * 32)
    mip = MipStage()
    long = PlacementSearch(ev, budget, time.perf_counter() + 30, bnb_max_requests=0)
    res = long.run(mip=mip)
    assert res is not None and "mip" in long.done and MipStage._loaded
    assert ev.memory(res.assign) <= budget
    assert not mip.affordable(5.0, len(blocks), candidate_set(32).size)
    assert not mip.affordable(mip.overhead_ms(64, 17) * 1.5, 64, 17)


def test_bound_pauses_skip_searches_on_hopeless_batches():
    """When even all-offloaded does not fit, victims are paused on the memory bound alone (no search)."""
    batch = make_batch([100, 60, 20, 90, 70], layers=4, budget=120, window=(1, 1))
    plan = Planner().plan(batch)
    assert plan.extras["paused_by_bound"] == len(plan.paused) >= 3
    survivors = [r for r in batch.requests if r.id not in plan.paused]
    assert sum(r.blocks(1, 1) for r in survivors) <= 120


def test_windows_cost_few_searches():
    """Choosing the largest feasible window takes at most four searches (plus none per bound pause)."""
    batch = make_batch(
        [40, 55, 30],
        layers=6,
        comp=1.0,
        gbps=2.0,
        slo=[9.0, 12.0, 30.0],
        deposits=[5, 0, 9],
        alpha=0.5,
        window=(1, 64),
        budget=int(0.5 * 130 * 6),
    )
    plan = Planner().plan(batch, time_budget_ms=10_000)
    assert plan.extras["searches"] <= 4
    assert plan.feasible or plan.paused


class TickClock:
    """A fake clock that advances 1 ms every time it is read (deterministic 'time')."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1e-3
        return self.now


def test_default_budget_is_capped_and_the_deadline_is_kept_in_clock_ticks():
    """A 2 s default budget (25% of an 8 s step) is capped at max_default_budget_ms; the search stops within a few clock reads of it."""
    contexts = [3000 + 1700 * i for i in range(12)]
    batch = make_batch(
        contexts,
        layers=8,
        comp=1000.0,
        gbps=0.05,
        block_size=16,
        budget=int(0.4 * sum(-(-c // 16) for c in contexts) * 8),
        slo=1e9,
    )
    clock = TickClock()
    plan = Planner(clock=clock, max_default_budget_ms=30.0).plan(batch)
    assert plan.feasible and plan.placements
    assert 30.0 <= plan.solve_ms <= 30.0 + 5.0
    explicit = Planner(clock=TickClock(), max_default_budget_ms=30.0).plan(
        batch, time_budget_ms=80.0
    )
    assert 80.0 <= explicit.solve_ms <= 85.0


def test_max_default_budget_is_validated():
    """A non-positive default-budget ceiling is rejected with the allowed range."""
    with pytest.raises(ValueError, match="max_default_budget_ms"):
        Planner(max_default_budget_ms=0.0)


def _launch_batch(launch_ms: float) -> Batch:
    """Eight requests of 20 blocks, 8 layers, half the KV beyond the budget: offloading needed."""
    d = {
        "model": {"layers": 8, "block_size": 1, "block_bytes": 1000},
        "hardware": {"gpu_kv_budget_blocks": 8 * 20 * 5 + 8 * 20, "h2d_gbps": 0.5},
        "profile": {"layer_compute_ms": 1.0, "fetch_launch_ms": launch_ms},
        "requests": [{"id": f"r{i}", "context_tokens": 20, "slo_tbt_ms": 1e9} for i in range(8)],
        "policy": {"alpha": 9.0, "window_min": 1, "window_max": 1},
    }
    return Batch.from_dict(d)


def test_planner_predicts_and_weighs_the_fetch_launch_cost():
    """The plan's predicted step is the model's with the profile's launch cost (one launch per
    target layer and trigger, as the data plane issues them), and the plan made for that cost is
    no worse under it than the plan made without it."""
    plans = {}
    for launch in (0.0, 2.0):
        batch = _launch_batch(launch)
        plan = Planner(use_mip=False).plan(batch, time_budget_ms=2000.0)
        rows = [plan.placements[r.id] for r in batch.requests]
        blocks = [r.blocks(1, plan.window_steps) for r in batch.requests]
        model = step_time_ms(rows, blocks, [1.0] * 8, batch.bw_blocks_per_ms, launch_ms=launch)
        assert plan.feasible and plan.predicted_step_ms == pytest.approx(model, rel=1e-9)
        plans[launch] = (plan, rows, blocks, batch.bw_blocks_per_ms)
    plan, rows, blocks, bw = plans[2.0]
    # 8 ms of compute, the transfers hidden: what is left is the launches (4 offloaded layers)
    assert plan.predicted_step_ms == pytest.approx(8.0 + 4 * 2.0)
    # negative control: the same plan priced without its launches
    assert step_time_ms(rows, blocks, [1.0] * 8, bw) == pytest.approx(8.0)
    _, cheap_rows, cheap_blocks, _ = plans[0.0]
    assert step_time_ms(cheap_rows, cheap_blocks, [1.0] * 8, bw, launch_ms=2.0) >= plan.predicted_step_ms - 1e-9
