"""The planner with the recompute option (issue 16, docs/recompute.md) against exhaustive
enumeration over its own joint candidate space (layouts x the (u, k) grid), with negative
controls."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controlplane.model import Batch, gpu_blocks, memory_blocks, step_time_ms, transient_blocks
from controlplane.planner import Planner, candidate_set
from controlplane.planner.recompute_evaluator import RecomputeEvaluator
from controlplane.planner.recompute_grid import RecomputeGrid
from controlplane.planner.recompute_search import RecomputeSearch

BLOCK_BYTES = 1_000_000  # 1 MB blocks: h2d_gbps = blocks per ms


def make_batch(
    contexts, *, layers=4, comp=1.0, budget=1000, gbps=1.0, rms=0.05, ratio=0.9, block_size=1,
    window=(1, 1), slo=1e9, alpha=None, launch=0.0,
) -> Batch:
    return Batch.from_dict(
        {
            "model": {"layers": layers, "block_size": block_size, "block_bytes": BLOCK_BYTES},
            "hardware": {"gpu_kv_budget_blocks": budget, "h2d_gbps": gbps},
            "profile": {"layer_compute_ms": comp, "recompute_ms_per_token": rms, "fetch_launch_ms": launch},
            "requests": [
                {"id": f"r{i}", "context_tokens": c, "slo_tbt_ms": slo} for i, c in enumerate(contexts)
            ],
            "policy": {
                "alpha": len(contexts) + 1.0 if alpha is None else alpha,
                "window_min": window[0],
                "window_max": window[1],
                "max_recompute_ratio": ratio,
            },
        }
    )


def without_recompute(batch: Batch) -> Batch:
    d = batch.to_dict()
    d["policy"].pop("max_recompute_ratio", None)
    return Batch.from_dict(d)


def exhaustive(batch: Batch, window: int) -> tuple[float, list]:
    """(optimum, its joint choice) over layouts x grid options per request, by the model module."""
    rows = candidate_set(batch.model.layers).rows
    grid = RecomputeGrid.for_batch(batch)
    assert grid is not None
    blocks = batch.blocks(window)
    per_request = [[(row, uk) for row in rows for uk in grid.options(b)] for b in blocks]
    kw = {"recompute_ms_per_token": batch.profile.recompute_ms_per_token, "block_size": batch.model.block_size}
    best, arg = math.inf, []
    for choice in itertools.product(*per_request):
        placement = [row for row, _ in choice]
        rec = [(u, k if u else 0) for _, (u, k) in choice]
        if gpu_blocks(placement, blocks, rec) > batch.hardware.gpu_kv_budget_blocks:
            continue
        t = step_time_ms(placement, blocks, batch.profile.layer_compute_ms, batch.bw_blocks_per_ms, recompute=rec, **kw)
        if t < best:
            best, arg = t, list(choice)
    return best, arg


def plan_recompute(batch: Batch, plan) -> list[tuple[int, int]]:
    return [(plan.recompute_blocks.get(r.id, 0), plan.recompute_layers.get(r.id, 0)) for r in batch.requests]


def check_plan_consistent(batch: Batch, plan) -> None:
    """The plan's step, memory split and recompute agree with the model and the grid's limits
    (for the requests it runs)."""
    batch = batch.without(plan.paused)
    ids = [r.id for r in batch.requests]
    placement = [plan.placements[i] for i in ids]
    blocks = batch.blocks(plan.window_steps)
    rec = plan_recompute(batch, plan)
    assert set(plan.recompute_blocks) == set(plan.recompute_layers)
    assert all(u > 0 for u in plan.recompute_blocks.values())
    grid = RecomputeGrid.for_batch(batch)
    for (u, _), b in zip(rec, blocks, strict=True):
        assert u <= (grid.max_blocks(b) if grid else 0)
    assert memory_blocks(placement, blocks, rec) == (plan.resident_blocks, plan.staging_blocks)
    assert transient_blocks(rec) == plan.transient_blocks
    assert gpu_blocks(placement, blocks, rec) <= batch.hardware.gpu_kv_budget_blocks
    exact = step_time_ms(
        placement, blocks, batch.profile.layer_compute_ms, batch.bw_blocks_per_ms, recompute=rec,
        recompute_ms_per_token=batch.profile.recompute_ms_per_token, block_size=batch.model.block_size,
        launch_ms=batch.profile.fetch_launch_ms,
    )
    assert plan.predicted_step_ms == pytest.approx(exact, rel=1e-9)


tiny_batches = st.builds(
    lambda contexts, layers, comp, gbps, frac, rms, ratio, bs, wmax: make_batch(
        contexts, layers=layers, comp=comp, gbps=gbps, rms=rms, ratio=ratio, block_size=bs,
        window=(1, wmax),
        budget=max(1, int(sum(-(-(c + wmax) // bs) for c in contexts) * (1 + frac * (layers - 1)))),
    ),
    contexts=st.lists(st.integers(1, 12), min_size=2, max_size=2),
    layers=st.integers(2, 4),
    comp=st.floats(0.05, 2.0),
    gbps=st.floats(0.3, 20.0),
    frac=st.floats(-0.1, 1.05),  # budget: all offloaded (0) .. everything resident (1)
    rms=st.lists(st.floats(0.0, 0.6), min_size=1, max_size=1).map(lambda v: v[0]),
    ratio=st.sampled_from([0.25, 0.5, 0.9]),
    bs=st.sampled_from([1, 2]),
    wmax=st.integers(1, 3),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=tiny_batches)
def test_planner_matches_exhaustive_joint_optimum(batch):
    """Plans with recompute fit memory, predict the exact step, are within 1% of the exhaustive
    joint optimum at their window, keep the pause bound valid, and are never worse than the plan
    without recompute (no smaller window; at the same window no slower step)."""
    plan = Planner().plan(batch, time_budget_ms=10_000)
    best, _ = exhaustive(batch, plan.window_steps)
    if math.isinf(best):  # nothing fits even all-offloaded: someone must be paused
        assert plan.paused
        return
    assert plan.feasible and not plan.paused
    check_plan_consistent(batch, plan)
    assert plan.predicted_step_ms <= best * 1.01 + 1e-9
    assert Planner.step_lower_bound_ms(batch, batch.requests, plan.window_steps) <= best * (1 + 1e-9)
    old = Planner().plan(without_recompute(batch), time_budget_ms=10_000)
    assert plan.window_steps >= old.window_steps
    if plan.window_steps == old.window_steps:
        assert plan.predicted_step_ms <= old.predicted_step_ms * (1 + 1e-9)


SMOKE = dict(contexts=[8, 6], budget=30, rms=0.05, ratio=0.9)
"""By hand: a (b=9, U=8) and b (b=7, U=6) at 1 block/ms, 1 ms layers; without recompute the best
plan fetches 54 ms; recomputing 8 and 3 blocks through all 4 layers costs 4 x 1.55 = 6.2 ms."""


def test_exhaustive_check_fails_for_a_wrong_placement():
    """Negative control: the 1% check rejects the no-recompute optimum and a deliberately bad
    joint choice on a batch where recompute wins by hand."""
    batch = make_batch(**SMOKE)
    best, arg = exhaustive(batch, 1)
    assert best == pytest.approx(6.2)
    assert [uk for _, uk in arg] == [(8, 4), (3, 4)]
    old = Planner().plan(without_recompute(batch), time_budget_ms=5_000)
    assert old.predicted_step_ms == pytest.approx(54.0)
    assert not old.predicted_step_ms <= best * 1.01
    # the optimum's layouts with b's prefix fetched instead (k = 0): memory fits, step is worse
    placement, blocks = [row for row, _ in arg], batch.blocks(1)
    wrong = [(8, 4), (3, 0)]
    assert gpu_blocks(placement, blocks, wrong) <= 30
    t = step_time_ms(placement, blocks, [1.0] * 4, 1.0, recompute=wrong, recompute_ms_per_token=[0.05] * 4)
    assert not t <= best * 1.01


def test_recompute_avoids_a_pause_the_old_plan_needs():
    """A tight SLO: without recompute the planner must pause a request (54 ms > SLO); with it
    both run at 6.2 ms. The old pause bound (no recompute) would exceed the recompute optimum,
    so the bound is relaxed when recompute is offered."""
    batch = make_batch(**SMOKE, slo=10.0, alpha=0.0)
    old = Planner().plan(without_recompute(batch), time_budget_ms=5_000)
    assert old.paused
    plan = Planner().plan(batch, time_budget_ms=5_000)
    assert plan.feasible and not plan.paused
    assert plan.predicted_step_ms == pytest.approx(6.2)
    assert Planner.step_lower_bound_ms(without_recompute(batch), batch.requests, 1) > 6.2
    assert Planner.step_lower_bound_ms(batch, batch.requests, 1) <= 6.2


@settings(max_examples=60, deadline=None)
@given(data=st.data(), n=st.integers(1, 3), layers=st.integers(1, 6))
def test_joint_evaluator_matches_model_and_bounds_hold(data, n, layers):
    """RecomputeEvaluator's exact step equals model.step_time_ms with recompute, its memory
    equals gpu_blocks, and its lower bounds never exceed the exact step."""
    blocks = data.draw(st.lists(st.integers(1, 20), min_size=n, max_size=n))
    comp = data.draw(st.lists(st.floats(0.0, 3.0), min_size=layers, max_size=layers))
    rms = tuple(data.draw(st.lists(st.floats(0.0, 0.5), min_size=layers, max_size=layers)))
    bw = data.draw(st.floats(0.2, 30.0))
    bs = data.draw(st.sampled_from([1, 4]))
    grid = RecomputeGrid(layers, bs, data.draw(st.sampled_from([0.3, 0.8])), rms, bw)
    cands = candidate_set(layers)
    ev = RecomputeEvaluator(cands, blocks, comp, bw, grid)
    assign = [data.draw(st.integers(0, ev.n_options(r) - 1)) for r in range(n)]
    opts = ev.chosen(assign)
    # the closed forms used to order moves agree with the per-layer option
    for r, o in enumerate(opts):
        j = assign[r]
        assert (ev.mem[r][j], ev.volume[r][j]) == (o.mem, o.volume)
        assert ev.recompute_ms[r][j] == pytest.approx(o.recompute_ms, rel=1e-12, abs=1e-15)
    placement = [cands.rows[o.layout] for o in opts]
    rec = [(o.u, o.k) for o in opts]
    exact = step_time_ms(placement, blocks, comp, bw, recompute=rec, recompute_ms_per_token=rms, block_size=bs)
    assert ev.exact_ms(assign) == pytest.approx(exact, rel=1e-12, abs=1e-12)
    assert ev.memory(assign) == gpu_blocks(placement, blocks, rec)
    assert ev.lower_bound_ms(assign) <= exact * (1 + 1e-9) + 1e-12
    assert ev.volume_bound_ms(sum(o.recompute_ms for o in opts), sum(o.volume for o in opts)) <= exact * (1 + 1e-9) + 1e-12
    # a cutoff below the step may stop early (inf); one above it never changes the answer
    assert ev.exact_ms(assign, cutoff=exact * 0.999) in (math.inf, pytest.approx(exact))
    assert ev.exact_ms(assign, cutoff=exact * 1.001 + 1e-9) == pytest.approx(exact, rel=1e-12, abs=1e-12)


def _path_bounds(search: RecomputeSearch, assign: list[int]) -> list[float]:
    """The best-first node bounds along ``assign``'s path (requests largest first)."""
    ev = search.ev
    order = sorted(range(search.n_req), key=lambda r: -ev.blocks[r])
    node = (ev.compute_ms, 0, 0, (), 0, list(ev.comp), [0.0] * ev.n_layers, 0.0)
    out = []
    for r in order:
        kids = {k[3][-1]: k for k in search._expand(node, r, 0)}
        node = kids[assign[r]]
        out.append(node[0])
    return out


@settings(max_examples=80, deadline=None)
@given(data=st.data(), n=st.integers(1, 3), layers=st.integers(1, 5))
def test_best_first_node_bounds_never_exceed_a_completion(data, n, layers):
    """Every best-first node on the path to an assignment is bounded by that assignment's exact
    step (the pruning is valid: adding compute or fetches later can only raise the step)."""
    blocks = data.draw(st.lists(st.integers(1, 12), min_size=n, max_size=n))
    comp = data.draw(st.lists(st.floats(0.01, 2.0), min_size=layers, max_size=layers))
    rms = tuple(data.draw(st.lists(st.floats(0.0, 0.6), min_size=layers, max_size=layers)))
    bw = data.draw(st.floats(0.2, 20.0))
    grid = RecomputeGrid(layers, 1, 0.9, rms, bw)
    ev = RecomputeEvaluator(candidate_set(layers), blocks, comp, bw, grid)
    assign = [data.draw(st.integers(0, ev.n_options(r) - 1)) for r in range(n)]
    search = RecomputeSearch(ev, 10**9, math.inf)  # no incumbent: nothing is cut
    exact = ev.exact_ms(assign)
    assert all(lb <= exact * (1 + 1e-9) + 1e-12 for lb in _path_bounds(search, assign))


@settings(max_examples=60, deadline=None)
@given(data=st.data(), layers=st.integers(2, 5))
def test_node_bounds_when_recompute_hides_an_earlier_stall(data, layers):
    """The case that breaks a stall-only chain bound: the larger request (assigned first)
    fetches, the smaller recomputes through every layer, adding compute inside the larger one's
    fetch windows; every node bound on the path stays below the exact step. (A stall-only chain
    bound fails ~1 draw in 5 here.)"""
    blocks = sorted(data.draw(st.lists(st.integers(2, 12), min_size=2, max_size=2)), reverse=True)
    comp = data.draw(st.lists(st.floats(0.01, 2.0), min_size=layers, max_size=layers))
    rms = tuple(data.draw(st.lists(st.floats(0.0, 0.6), min_size=layers, max_size=layers)))
    bw = data.draw(st.floats(0.2, 5.0))
    ev = RecomputeEvaluator(candidate_set(layers), blocks, comp, bw, RecomputeGrid(layers, 1, 0.9, rms, bw))
    fetching = data.draw(st.integers(len(ev.grid_options[0]), ev.n_options(0) - 1))
    u = data.draw(st.sampled_from([u for u, _ in ev.grid_options[1] if u]))
    assign = [fetching, ev.index_of(1, 0, u, layers)]
    exact = ev.exact_ms(assign)
    assert all(
        lb <= exact * (1 + 1e-9) + 1e-12
        for lb in _path_bounds(RecomputeSearch(ev, 10**9, math.inf), assign)
    )


def test_node_bound_negative_control():
    """Scenario: a chain bound kept as a bare stall and re-added to a larger compute sum is not
    valid. r0 (13 blocks, layers 1 and 3 offloaded, u=3 recomputed in all 4 layers) stalls at
    layer 1; r1 then adds 2 recomputed tokens to layer 0, inside r0's window, which hides part of
    that stall. The valid node bound equals the exact step; the stall-only form exceeds it."""
    ev = RecomputeEvaluator(
        candidate_set(4), [13, 5], [0.7475481625675695] * 4, 3.425586205669814,
        RecomputeGrid(4, 1, 0.9, (0.4661126600529783,) * 4, 3.425586205669814),
    )
    assign = [ev.index_of(0, 2, 3, 4), ev.index_of(1, 0, 2, 4)]
    exact = ev.exact_ms(assign)
    bounds = _path_bounds(RecomputeSearch(ev, 10**9, math.inf), assign)
    assert bounds[-1] == pytest.approx(exact)  # tight here
    o0, o1 = ev.chosen(assign)
    prefix0 = [0.0, *itertools.accumulate(ev.compute([o0]))]
    stall_only = sum(ev.compute([o0, o1])) + ev.chain_ms(o0, prefix0)
    assert stall_only > exact * 1.01


def test_evaluator_equality_negative_control():
    """Negative control: another k for the same u gives another exact step (the equality above
    is not vacuous)."""
    grid = RecomputeGrid(4, 1, 0.9, (0.5,) * 4, 1.0)
    ev = RecomputeEvaluator(candidate_set(4), [3], [1.0] * 4, 1.0, grid)
    a = ev.index_of(0, 0, 2, 2)
    assert ev.exact_ms([a]) == pytest.approx(8.0)  # test_recompute_timeline's mixed case
    c = ev.index_of(0, 0, 2, 0)  # the prefix fetched for all 4 layers: 4 x (2 + 1) ms
    assert ev.exact_ms([c]) == pytest.approx(12.0)
    assert ev.exact_ms([c]) != pytest.approx(ev.exact_ms([a]))


def test_grid_by_hand():
    """U = min(floor(ratio b), b - 1); u in {U, ceil(U/2), ceil(U/4)}; k in {0, L/4, L/2,
    3L/4, L} plus the balanced k* = argmin |bs sum_{l<k} rms - (L - k)/bw| (eLLM §4.3.1)."""
    g = RecomputeGrid(layers=4, block_size=1, max_ratio=0.5, recompute_ms_per_token=(1.0,) * 4, bw_blocks_per_ms=1.0)
    assert g.max_blocks(10) == 5 and g.max_blocks(1) == 0 and g.max_blocks(2) == 1
    assert g.block_choices(10) == (5, 3, 2)
    assert g.balanced_layers == 2  # |k - (4 - k)| = 0 at k = 2
    assert g.layer_choices == (0, 1, 2, 3, 4)
    assert len(g.options(10)) == 1 + 3 * 5 and g.options(10)[0] == (0, 0)
    assert g.options(1) == ((0, 0),)
    # a slower link moves k* up: |k - 2 (4 - k)| = |3k - 8| is least at k = 3
    slow = RecomputeGrid(4, 1, 0.5, (1.0,) * 4, 0.5)
    assert slow.balanced_layers == 3
    # 8 layers, 0.25 ms/token: |0.25 k - (8 - k)| = |1.25 k - 8| is least at k = 6 (0.5)
    deep = RecomputeGrid(8, 1, 0.5, (0.25,) * 8, 1.0)
    assert deep.balanced_layers == 6 and deep.layer_choices == (0, 2, 4, 6, 8)
    with pytest.raises(ValueError, match="max_ratio"):
        RecomputeGrid(4, 1, 0.0, (1.0,) * 4, 1.0)


def test_large_space_uses_local_search_and_is_never_worse():
    """6 requests x 16 layers (a joint space far above the best-first limit): starts and local
    search from the layout-only answer; the plan is consistent with the model, fits memory and is
    no slower than the plan without recompute at the same window."""
    contexts = [40, 64, 25, 90, 55, 33]
    batch = make_batch(contexts, layers=16, comp=0.2, gbps=4.0, rms=0.004, ratio=0.5,
                       budget=int(0.45 * sum(c + 1 for c in contexts) * 16))
    ev = RecomputeEvaluator(candidate_set(16), batch.blocks(1), batch.profile.layer_compute_ms,
                            batch.bw_blocks_per_ms, RecomputeGrid.for_batch(batch))
    assert not RecomputeSearch(ev, 10**9, math.inf).small
    plan = Planner(use_mip=False).plan(batch, time_budget_ms=300)
    old = Planner(use_mip=False).plan(without_recompute(batch), time_budget_ms=300)
    check_plan_consistent(batch, plan)
    assert plan.window_steps == old.window_steps == 1
    assert plan.predicted_step_ms <= old.predicted_step_ms * (1 + 1e-9)
    assert plan.recompute_blocks, "recompute should pay off on this link-bound batch"
    assert plan.predicted_step_ms < old.predicted_step_ms * 0.99


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=tiny_batches)
def test_heuristic_path_is_consistent_and_never_worse(batch):
    """Without branch and bound (starts and local search only) plans still fit memory, match the
    model and are never worse than the heuristic plan without recompute at the same window."""
    planner = Planner(exact_search=False, use_mip=False)
    plan = planner.plan(batch, time_budget_ms=10_000)
    if not plan.feasible:
        return
    check_plan_consistent(batch, plan)
    old = planner.plan(without_recompute(batch), time_budget_ms=10_000)
    if plan.window_steps == old.window_steps:
        assert plan.predicted_step_ms <= old.predicted_step_ms * (1 + 1e-9)


def test_recompute_plans_price_the_fetch_launches():
    """With a launch cost the joint (layouts x recompute) plan's step is the model's with it: the
    recompute search's evaluator carries the profile's launch cost; negative control: the same
    plan priced without it is cheaper."""
    contexts = [40, 64, 25, 90, 55, 33]
    batch = make_batch(contexts, layers=16, comp=0.2, gbps=60.0, rms=0.004, ratio=0.5, launch=3.0,
                       budget=int(0.45 * sum(c + 1 for c in contexts) * 16))
    plan = Planner(use_mip=False).plan(batch, time_budget_ms=300)
    assert plan.recompute_blocks
    check_plan_consistent(batch, plan)
    free = batch.without(plan.paused)
    rows = [plan.placements[r.id] for r in free.requests]
    blocks = free.blocks(plan.window_steps)
    rec = plan_recompute(free, plan)
    unpriced = step_time_ms(rows, blocks, free.profile.layer_compute_ms, free.bw_blocks_per_ms, recompute=rec,
                            recompute_ms_per_token=free.profile.recompute_ms_per_token,
                            block_size=free.model.block_size)
    assert unpriced < plan.predicted_step_ms - 1.0
    assert Batch.from_dict(batch.to_dict()) == batch  # the launch cost survives the JSON form
