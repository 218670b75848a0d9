"""Planner quality (issue 15): plans against an exhaustive enumerator over the candidate space.

The enumerator here is independent of the planner's evaluator: memory in closed form
(``b_r * (L - m + [m > 0])``) and the step time from ``controlplane.model.step_time_ms``.
Batches follow the issue's description: 2-4 requests, 8-16 layers, GPU KV budgets of 35-95% of
the all-resident size, Llama-like per-layer compute (weights 0.15 ms + KV read), PCIe 10-55 GB/s,
SLOs of 1.5-4x the all-on-GPU step, deposits 0-20 tokens, windows 1..64.
"""

from __future__ import annotations

import gc
import itertools
import math
import time

import pytest
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from controlplane.model import Batch, step_time_ms
from controlplane.planner import Planner, candidate_set
from controlplane.planner.evaluator import Evaluator
from controlplane.planner.placement_search import PlacementSearch

BLOCK_SIZE = 16
BLOCK_BYTES = 65536
HBM_BYTES_PER_MS = 3.35e9


def random_batch(contexts, layers, gbps, frac, slo_factors, deposits) -> Batch:
    blocks = [-(-c // BLOCK_SIZE) for c in contexts]
    comp = 0.15 + sum(contexts) * 4096 / HBM_BYTES_PER_MS
    return Batch.from_dict(
        {
            "model": {"layers": layers, "block_size": BLOCK_SIZE, "block_bytes": BLOCK_BYTES},
            "hardware": {"gpu_kv_budget_blocks": int(frac * sum(blocks) * layers), "h2d_gbps": gbps},
            "profile": {"layer_compute_ms": comp},
            "requests": [
                {"id": f"r{i}", "context_tokens": c, "slo_tbt_ms": comp * layers * f, "deposit_tokens": d}
                for i, (c, f, d) in enumerate(zip(contexts, slo_factors, deposits, strict=False))
            ],
            "policy": {"alpha": 1.0, "window_min": 1, "window_max": 64},
        }
    )


issue_batches = st.integers(2, 4).flatmap(
    lambda n: st.builds(
        random_batch,
        contexts=st.lists(
            st.floats(math.log(256), math.log(131072)).map(lambda x: int(math.exp(x))), min_size=n, max_size=n
        ),
        layers=st.integers(8, 16),
        gbps=st.floats(10.0, 55.0),
        frac=st.floats(0.35, 0.95),
        slo_factors=st.lists(st.floats(1.5, 4.0), min_size=n, max_size=n),
        deposits=st.lists(st.integers(0, 20), min_size=n, max_size=n),
    )
)


def exhaustive_optimum(batch: Batch, ids: set[str], window: int) -> float:
    """Least step time over every memory-feasible assignment of candidates to ``ids`` at ``window``."""
    cands = candidate_set(batch.model.layers)
    reqs = [r for r in batch.requests if r.id in ids]
    blocks = [r.blocks(batch.model.block_size, window) for r in reqs]
    layers = batch.model.layers
    per_block = [layers - len(off) + (1 if off else 0) for off in cands.offloaded]
    comp, bw = batch.profile.layer_compute_ms, batch.bw_blocks_per_ms
    best = math.inf
    for choice in itertools.product(range(cands.size), repeat=len(reqs)):
        if sum(b * per_block[c] for b, c in zip(blocks, choice, strict=True)) > batch.hardware.gpu_kv_budget_blocks:
            continue
        best = min(best, step_time_ms([cands.rows[c] for c in choice], blocks, comp, bw))
    return best


def plan_step(batch: Batch, plan) -> float:
    """The model's step time of the plan's placements (independent of the planner's evaluator)."""
    reqs = [r for r in batch.requests if r.id in plan.placements]
    blocks = [r.blocks(batch.model.block_size, plan.window_steps) for r in reqs]
    rows = [plan.placements[r.id] for r in reqs]
    return step_time_ms(rows, blocks, batch.profile.layer_compute_ms, batch.bw_blocks_per_ms)


# 4 requests with equal blocks (a stored example database's failure): before best first broke
# the symmetry of interchangeable requests, each window's search evaluated every distinct
# assignment ~12 times (135 exact evaluations for 11 multisets at window 32), proving the optimum
# took ~7.5 ms CPU (> the 4 ms default budget), and the plan was 3.4178 ms against 3.1769 (+7.6%)
# whenever the probes left the polish too little time. Now: 11 evaluations, proved in ~2 ms.
TIED = dict(contexts=[403] * 4, layers=8, gbps=10.0, frac=0.75, slo_factors=[2.0, 2.0, 2.0, 3.0], deposits=[0] * 4)


# No explain phase: after a failure Hypothesis would run every shrink step under sys.settrace
# (for the explanation), several times slower, so this time-budgeted property would shrink
# towards examples that fail only when traced (reported as a FlakyFailure on the wrong example).
@settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    phases=(Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink),
)
@given(batch=issue_batches)
@example(batch=random_batch(**TIED))
def test_default_budget_plans_are_within_one_percent_and_exact_labels_are_optimal(batch):
    """Within the default budget (this thread's CPU clock: a shared machine's waits not counted) every plan is within 1% of the exhaustive optimum at its window; a plan labelled "exact" (or extras["optimal"]) is the optimum.

    The clock is ``time.thread_time``, not ``time.process_time``: the suite's early starts
    (``tests/conftest.py``) build the tiny model on a worker thread of this process while the first
    tests run, and the process clock charged that thread's CPU to the planner's 4 ms budget (CI,
    session 48: a plan 5.3% above the optimum that did not reproduce, a ``FlakyFailure``). The
    planner and its CBC stage (``threads = 1``) run on the calling thread.

    The cyclic GC is held off during ``plan()``: a full collection of the test process's heap
    (Hypothesis, pytest) inside it is charged to the CPU clock (29 ms measured, seven times the
    4 ms budget). ``kvplane bench planner`` and the README's measurement collect first instead;
    here a collection per example cost ~0.7 s late in the suite (85 s over the examples), as the
    heap then holds every module the suite imported.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        plan = Planner(clock=time.thread_time).plan(batch)
    finally:
        if enabled:
            gc.enable()
    if not plan.placements:
        return
    opt = exhaustive_optimum(batch, set(plan.placements), plan.window_steps)
    assert plan.predicted_step_ms == pytest.approx(plan_step(batch, plan), rel=1e-9)
    assert plan.predicted_step_ms <= opt * 1.01 + 1e-9
    if plan.solver == "exact" or plan.extras["optimal"]:
        assert plan.solver in ("exact", "trivial") and plan.extras["optimal"]
        assert plan.predicted_step_ms == pytest.approx(opt, rel=1e-9)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=issue_batches)
def test_generous_budget_proves_the_optimum(batch):
    """With a generous budget the best-first search completes on these spaces: the plan is labelled exact (or trivial) and equals the exhaustive optimum."""
    plan = Planner().plan(batch, time_budget_ms=10_000)
    if not plan.placements:
        return
    opt = exhaustive_optimum(batch, set(plan.placements), plan.window_steps)
    assert plan.solver in ("exact", "trivial") and plan.extras["optimal"]
    assert plan.predicted_step_ms == pytest.approx(opt, rel=1e-9)


# 4 requests x 9 layers (found by a random search over the issue's batches) where the first
# complete assignment of a zero-budget search (its dive) is 17% above the optimum.
HARD = dict(contexts=[1650, 2436, 720, 635], layers=9, gbps=25.0, frac=0.84, slo_factors=[4.0] * 4, deposits=[0] * 4)


def test_interrupted_search_is_not_labelled_exact():
    """Negative control for the label check: with no time the plan is a fallback, not labelled exact and not optimal, and strictly above the optimum; with time it is proved."""
    batch = random_batch(**HARD)
    quick = Planner().plan(batch, time_budget_ms=0)
    opt = exhaustive_optimum(batch, set(quick.placements), quick.window_steps)
    assert quick.solver != "exact" and not quick.extras["optimal"]
    assert quick.predicted_step_ms > opt * 1.1
    full = Planner().plan(batch, time_budget_ms=10_000)
    assert full.window_steps == quick.window_steps
    assert full.solver == "exact" and full.predicted_step_ms == pytest.approx(opt, rel=1e-9)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    blocks=st.lists(st.integers(1, 60), min_size=1, max_size=4),
    layers=st.integers(1, 12),
    frac=st.floats(0.02, 1.1),
    data=st.data(),
)
def test_best_first_search_proves_the_optimum_on_arbitrary_small_problems(blocks, layers, frac, data):
    """Best-first branch and bound with time to finish returns the exhaustive optimum and says so (its bounds never prune the optimum), on arbitrary compute profiles including zero-compute layers."""
    cands = candidate_set(layers)
    comp = data.draw(st.lists(st.sampled_from([0.0, 0.05, 0.3, 1.0, 2.5]), min_size=layers, max_size=layers))
    bw = data.draw(st.floats(0.2, 50.0))
    budget = max(1, int(frac * sum(b + 1 for b in blocks) * layers))
    ev = Evaluator(cands, blocks, comp, bw)
    search = PlacementSearch(ev, budget, time.perf_counter() + 60)
    assert search.small
    res = search.run(mip=None)
    best = brute_force_step(cands, blocks, comp, bw, budget, layers)
    if math.isinf(best):
        assert res is None
        return
    assert res is not None and res.optimal and res.solver in ("exact", "trivial")
    assert res.step_ms == pytest.approx(best, rel=1e-9, abs=1e-12)


def brute_force_step(cands, blocks, comp, bw, budget, layers) -> float:  # noqa: ANN001
    """The least step time over every assignment that fits ``budget`` (inf when none does)."""
    per_block = [layers - len(off) + (1 if off else 0) for off in cands.offloaded]
    best = math.inf
    for choice in itertools.product(range(cands.size), repeat=len(blocks)):
        if sum(b * per_block[c] for b, c in zip(blocks, choice, strict=True)) <= budget:
            best = min(best, step_time_ms([cands.rows[c] for c in choice], blocks, comp, bw))
    return best


def evaluated_assignments(ev: Evaluator) -> list[tuple[int, ...]]:
    """Record every assignment ``ev`` evaluates exactly (from now on)."""
    seen: list[tuple[int, ...]] = []
    exact = ev.exact_ms

    def recording(assign, cutoff=math.inf):
        seen.append(tuple(assign))
        return exact(assign, cutoff)

    ev.exact_ms = recording
    return seen


@pytest.mark.parametrize("window", [1, 32, 64])
def test_best_first_search_evaluates_interchangeable_requests_once(window):
    """Regression (``TIED``): requests with equal blocks are interchangeable, so best first evaluates one permutation of each multiset of candidates and still proves the exhaustive optimum (before: 166 / 135 / 85 exact evaluations for 14 / 11 / 9 multisets)."""
    batch = random_batch(**TIED)
    blocks = [r.blocks(BLOCK_SIZE, window) for r in batch.requests]
    ev = Evaluator(candidate_set(batch.model.layers), blocks, batch.profile.layer_compute_ms, batch.bw_blocks_per_ms)
    seen = evaluated_assignments(ev)
    search = PlacementSearch(ev, batch.hardware.gpu_kv_budget_blocks, time.perf_counter() + 60)
    res = search.run()
    assert res is not None and res.optimal and res.solver == "exact"
    assert res.step_ms == pytest.approx(exhaustive_optimum(batch, {r.id for r in batch.requests}, window), rel=1e-9)
    assert len(seen) == len({tuple(sorted(a)) for a in seen}) <= 15


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    blocks=st.lists(st.sampled_from([3, 8, 21]), min_size=2, max_size=4),
    layers=st.integers(1, 12),
    frac=st.floats(0.02, 1.1),
    bw=st.floats(0.2, 50.0),
)
def test_best_first_symmetry_breaking_keeps_the_optimum(blocks, layers, frac, bw):
    """With many equal-block (interchangeable) requests, best first still proves the exhaustive optimum, and never evaluates two assignments that differ only by swapping candidates between requests of equal blocks."""
    cands = candidate_set(layers)
    comp = [0.3 if i % 3 else 0.05 for i in range(layers)]
    budget = max(1, int(frac * sum(b + 1 for b in blocks) * layers))
    ev = Evaluator(cands, blocks, comp, bw)
    seen = evaluated_assignments(ev)
    res = PlacementSearch(ev, budget, time.perf_counter() + 60).run(mip=None)
    best = brute_force_step(cands, blocks, comp, bw, budget, layers)
    if math.isinf(best):
        assert res is None
        return
    assert res is not None and res.optimal
    assert res.step_ms == pytest.approx(best, rel=1e-9, abs=1e-12)
    canon = [tuple(sorted(zip(blocks, a, strict=True))) for a in seen]
    assert len(canon) == len(set(canon))


def test_removing_a_request_can_slow_the_step():
    """Scenario: processor sharing is not monotone in the requests, so the exact step of a partial assignment is no lower bound (the best-first search prunes with the chain and aggregate bounds only).

    Found by a hill-climb over random placements: without request 1's fetches the layers run
    earlier, so the other requests' fetches are released at other times and overlap
    differently on the shared link, and the step ends 0.23 ms later.
    """
    blocks = [15, 4, 9, 41]
    comp = [1.5254754854838983, 0.0, 2.576848768554361, 1.9891612372784357, 2.8560193869249915, 1.2747499572877397, 0.7092798435121639, 0.8590471618142284]
    bw = 34.71364485356436
    rows = [
        [1, 0, 1, 0, 0, 0, 1, 1],
        [0, 1, 1, 1, 0, 1, 1, 1],
        [1, 1, 0, 0, 1, 1, 1, 1],
        [1, 1, 0, 0, 1, 1, 0, 1],
    ]
    full = step_time_ms(rows, blocks, comp, bw)
    without = step_time_ms([rows[0], [1] * 8, rows[2], rows[3]], blocks, comp, bw)
    assert without > full + 0.2
    # control: removing request 3 (the large one) does speed the step up
    assert step_time_ms([rows[0], rows[1], rows[2], [1] * 8], blocks, comp, bw) < full
