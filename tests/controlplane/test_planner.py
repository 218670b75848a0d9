"""Planner (issue 2 §3) against exhaustive enumeration and on hand-built SLO/pause cases."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controlplane.model import Batch, RequestSpec, memory_blocks, step_time_ms
from controlplane.planner import Planner, candidate_set
from controlplane.planner.evaluator import Evaluator
from controlplane.planner.mip_search import MipStage
from controlplane.planner.slo_cap import late_fraction as _late
from controlplane.planner.slo_cap import max_step_ms as _max_step_ms

BLOCK_BYTES = 1_000_000  # 1 MB blocks: h2d_gbps = blocks per ms


def make_batch(
    contexts,
    *,
    layers=4,
    comp=1.0,
    budget=1000,
    gbps=1.0,
    slo=1e9,
    deposits=None,
    alpha=None,
    window=(1, 1),
    block_size=1,
) -> Batch:
    deposits = deposits or [0] * len(contexts)
    slos = slo if isinstance(slo, list) else [slo] * len(contexts)
    return Batch.from_dict(
        {
            "model": {"layers": layers, "block_size": block_size, "block_bytes": BLOCK_BYTES},
            "hardware": {"gpu_kv_budget_blocks": budget, "h2d_gbps": gbps},
            "profile": {"layer_compute_ms": comp},
            "requests": [
                {"id": f"r{i}", "context_tokens": c, "slo_tbt_ms": s, "deposit_tokens": d}
                for i, (c, s, d) in enumerate(zip(contexts, slos, deposits, strict=True))
            ],
            "policy": {
                "alpha": len(contexts) + 1.0 if alpha is None else alpha,
                "window_min": window[0],
                "window_max": window[1],
            },
        }
    )


def fetch_bound(contexts, *, slo, deposits=None, alpha=1.0, window=(1, 1)) -> Batch:
    """Requests of ``contexts`` tokens (KV growth 0, so every window has the same blocks) whose
    step is fetch-bound: 4 layers of 0.5 ms (the all-resident step is 2 ms), 5 blocks/ms, room
    for one layer of each request and 5 blocks more, so every layer is offloaded. One request of
    10 tokens: 40 blocks / 5 + 2 = 10 ms."""
    deposits = deposits or [0] * len(contexts)
    slos = slo if isinstance(slo, list) else [slo] * len(contexts)
    return Batch.from_dict({
        "model": {"layers": 4, "block_size": 1, "block_bytes": BLOCK_BYTES},
        "hardware": {"gpu_kv_budget_blocks": sum(contexts) + 5, "h2d_gbps": 5.0},
        "profile": {"layer_compute_ms": 0.5},
        "requests": [{"id": f"r{i}", "context_tokens": c, "slo_tbt_ms": s, "deposit_tokens": d,
                      "remaining_tokens": 0}
                     for i, (c, s, d) in enumerate(zip(contexts, slos, deposits, strict=True))],
        "policy": {"alpha": alpha, "window_min": window[0], "window_max": window[1]},
    })


def exhaustive(batch: Batch, window: int) -> tuple[float, float]:
    """(optimum, best uniform) step time over the full candidate space, via the model module."""
    rows = candidate_set(batch.model.layers).rows
    blocks = batch.blocks(window)
    comp, bw, budget = batch.profile.layer_compute_ms, batch.bw_blocks_per_ms, batch.hardware.gpu_kv_budget_blocks
    best = uniform = math.inf
    for choice in itertools.product(range(len(rows)), repeat=len(blocks)):
        placement = [rows[c] for c in choice]
        if sum(memory_blocks(placement, blocks)) > budget:
            continue
        t = step_time_ms(placement, blocks, comp, bw)
        best = min(best, t)
        if len(set(choice)) <= 1:
            uniform = min(uniform, t)
    return best, uniform


small_batches = st.builds(
    lambda contexts, layers, comp, gbps, frac: make_batch(
        contexts,
        layers=layers,
        comp=comp,
        gbps=gbps,
        budget=max(1, int(frac * sum(c + 1 for c in contexts) * layers)),
    ),
    contexts=st.lists(st.integers(1, 60), min_size=1, max_size=4),
    layers=st.integers(1, 9),
    comp=st.floats(0.05, 3.0),
    gbps=st.floats(0.5, 40.0),
    frac=st.floats(0.02, 1.1),
)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=small_batches)
def test_planner_matches_exhaustive_optimum(batch):
    """Plans fit memory, predict the exact step, are within 1% of the optimum and never worse than the best uniform distance."""
    plan = Planner().plan(batch, time_budget_ms=10_000)
    best, uniform = exhaustive(batch, plan.window_steps)
    if math.isinf(best):  # nothing fits even all-offloaded: someone must be paused
        assert plan.paused
        return
    assert plan.feasible and not plan.paused
    ids = [r.id for r in batch.requests]
    placement = [plan.placements[i] for i in ids]
    blocks = batch.blocks(plan.window_steps)
    resident, staging = memory_blocks(placement, blocks)
    assert (resident, staging) == (plan.resident_blocks, plan.staging_blocks)
    assert resident + staging <= batch.hardware.gpu_kv_budget_blocks
    exact = step_time_ms(placement, blocks, batch.profile.layer_compute_ms, batch.bw_blocks_per_ms)
    assert plan.predicted_step_ms == pytest.approx(exact, rel=1e-9)
    assert plan.predicted_step_ms <= best * 1.01 + 1e-9
    assert plan.predicted_step_ms <= uniform * (1 + 1e-9)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=small_batches)
def test_heuristic_path_is_feasible_and_beats_uniform(batch):
    """Without branch and bound (tiny budgets), plans still fit memory and are never worse than the best uniform."""
    plan = Planner(exact_search=False, use_mip=False).plan(batch, time_budget_ms=10_000)
    best, uniform = exhaustive(batch, plan.window_steps)
    if math.isinf(best):
        return
    placement = [plan.placements[r.id] for r in batch.requests]
    assert sum(memory_blocks(placement, batch.blocks(plan.window_steps))) <= batch.hardware.gpu_kv_budget_blocks
    assert plan.predicted_step_ms <= uniform * (1 + 1e-9)


@settings(max_examples=80, deadline=None)
@given(
    blocks=st.lists(st.integers(1, 50), min_size=1, max_size=5),
    layers=st.integers(1, 12),
    data=st.data(),
)
def test_evaluator_matches_model_and_bounds_hold(blocks, layers, data):
    """The planner's evaluator equals model.step_time_ms and its lower bounds never exceed it."""
    cs = candidate_set(layers)
    comp = data.draw(st.lists(st.floats(0.0, 3.0), min_size=layers, max_size=layers))
    bw = data.draw(st.floats(0.2, 50.0))
    assign = data.draw(st.lists(st.integers(0, cs.size - 1), min_size=len(blocks), max_size=len(blocks)))
    ev = Evaluator(cs, blocks, comp, bw)
    exact = step_time_ms([cs.rows[c] for c in assign], blocks, comp, bw)
    assert ev.exact_ms(assign) == pytest.approx(exact, rel=1e-9, abs=1e-12)
    assert ev.lower_bound_ms(assign) <= exact * (1 + 1e-9) + 1e-12
    assert ev.memory(assign) == sum(memory_blocks([cs.rows[c] for c in assign], blocks))


def test_candidate_set_is_paper_d_of_l():
    """Candidates are none, all, and one widest distance per distinct floor(L/k) (|D(32)| = 9)."""
    cs = candidate_set(32)
    assert cs.labels[0] == "none" and cs.labels[-1] == "all"
    assert cs.size - 2 == len({32 // k for k in range(2, 33)}) == 9
    assert "k=8" in cs.labels and "k=7" not in cs.labels  # floor(32/7) = floor(32/8) = 4: widest kept
    assert cs.offloaded[cs.labels.index("k=8")] == (7, 15, 23, 31)
    assert cs.mem_units[-1] == 1 and cs.mem_units[0] == 32


def test_mip_minimises_the_surrogate():
    """CBC's answer fits memory and its linear stall bound is no worse than any feasible uniform's."""
    cs = candidate_set(16)
    blocks = [40, 90, 150, 220, 300, 30]
    ev = Evaluator(cs, blocks, [0.5] * 16, 60.0)
    budget = int(0.45 * sum(blocks) * 16)
    proposals = MipStage().solve(ev, budget, 5_000)
    assert proposals
    best = proposals[0]
    assert ev.memory(best) <= budget

    def surrogate(a):
        work = ev.work(a)
        chain = max(ev.chain[r][c] for r, c in enumerate(a))
        return max(chain, ev.compute_ms, *(w + s for w, s in zip(work, ev.bound_suffix, strict=True)))

    uniforms = [(c,) * len(blocks) for c in range(cs.size) if ev.memory((c,) * len(blocks)) <= budget]
    assert surrogate(best) <= min(surrogate(u) for u in uniforms) * (1 + 1e-6)


def test_planner_with_mip_stage_on_a_large_space():
    """With room in the budget the CBC stage runs and the plan is never worse than the best uniform."""
    contexts = [3000, 9000, 17000, 30000, 52000, 2000, 12000]
    batch = make_batch(contexts, layers=32, comp=0.4, gbps=25.0, budget=int(0.5 * sum(c // 16 for c in contexts) * 32), block_size=16)
    batch = Batch(batch.model.__class__(32, 16, 65536), batch.hardware, batch.profile, batch.requests, batch.policy)
    plan = Planner().plan(batch, time_budget_ms=2_000)
    ev = Evaluator(candidate_set(32), batch.blocks(1), batch.profile.layer_compute_ms, batch.bw_blocks_per_ms)
    budget = batch.hardware.gpu_kv_budget_blocks
    uniform = min(ev.exact_ms((c,) * 7) for c in range(ev.cands.size) if ev.memory((c,) * 7) <= budget)
    assert plan.feasible and plan.resident_blocks + plan.staging_blocks <= budget
    assert plan.predicted_step_ms <= uniform * (1 + 1e-9)


def test_empty_batch_gives_feasible_empty_plan():
    """An empty batch plans to nothing and is feasible."""
    plan = Planner().plan(make_batch([]), current_step=5)
    assert plan.feasible and plan.placements == {} and plan.paused == ()
    assert plan.expiry_step == 5 + plan.window_steps


def test_zero_budget_still_returns_a_plan():
    """A zero time budget still yields a memory-feasible plan (never nothing)."""
    batch = make_batch([30, 50, 70], layers=8, budget=400)
    plan = Planner().plan(batch, time_budget_ms=0)
    assert plan.feasible and not plan.paused
    assert plan.resident_blocks + plan.staging_blocks <= 400


def test_loose_slo_takes_window_max():
    """With SLO slack everywhere the planner picks the largest window and sets the expiry."""
    batch = make_batch([10, 20], layers=4, comp=2.5, slo=100.0, alpha=0.0, window=(2, 48))
    plan = Planner().plan(batch, current_step=100)
    assert plan.window_steps == 48 and plan.expiry_step == 148 and plan.feasible


def test_tight_slo_with_deposit_gives_small_window():
    """Step 10 ms vs SLO 4 ms: each step drains 10/4 = 2.5 tokens, so a deposit of 12 covers
    Δ(10/4 - 1) = 1.5Δ late tokens up to Δ = 8 (the one-token-per-step credit,
    1 - 4/10 - 12/Δ <= 0, would have allowed Δ = 20)."""
    batch = fetch_bound([10], slo=4.0, deposits=[12], alpha=0.0, window=(1, 64))
    plan = Planner().plan(batch)
    assert plan.predicted_step_ms == pytest.approx(10.0)
    assert plan.window_steps == 8 and not plan.paused
    assert plan.extras["late_fraction"] == pytest.approx(0.0, abs=1e-12)


def test_deposit_credit_is_scaled_by_the_drain_rate():
    """Late fraction by hand (OrbitFlow §3.3.1: the share of the window's steps that fail):
    slo 5, T 10 drains T/slo - 1 = 1 deposited token a step, so D = 8 keeps 8 steps on time:
    at Δ = 16 half of them fail (the unscaled 1 - 5/10 - 8/16 = 0 counted the deposit as
    covering every late step)."""
    req = RequestSpec("r0", 10, 5.0, 8)
    assert _late([req], 10.0, 16) == pytest.approx(0.5)
    assert _late([req], 10.0, 8) == pytest.approx(0.0)  # D = 8 >= Δ (T/slo - 1) = 8: covered
    assert _late([req], 10.0, 9) == pytest.approx(1 - 8 / 9)
    assert _late([req], 15.0, 16) == pytest.approx(1 - 8 / (16 * 2))  # drains 2 a step
    assert _late([req], 4.0, 64) == 0.0  # within the SLO: never late
    unscaled = max(0.0, 1 - 5.0 / 10.0 - 8 / 16)
    assert _late([req], 10.0, 16) != pytest.approx(unscaled)  # negative control: the old formula


def test_a_request_over_its_slo_without_deposit_fails_every_step():
    """sloFail is binary (§3.3.1): with no deposit, a step even 1% over the SLO fails the
    request's every step (late fraction 1), not the 1 - slo/T share of tokens owed (the cap up
    to session 42: 0.01 here, 1/3 at 1.5x the SLO)."""
    req = RequestSpec("r0", 10, 5.0, 0)
    assert _late([req], 5.05, 8) == 1.0
    assert _late([req], 7.5, 8) == 1.0
    assert _late([req], 5.0, 8) == 0.0  # at the SLO: on time
    # alpha 1 tolerates one such request, not three at 1.5x (the old cap summed them to 1.0)
    three = [RequestSpec(f"r{i}", 10, 5.0, 0) for i in range(3)]
    assert _late(three, 7.5, 8) == pytest.approx(3.0)
    assert _max_step_ms(three, 8, 1.0, 1.0) == pytest.approx(5.0)
    assert _max_step_ms(three, 8, 1.0, 1.0) != pytest.approx(7.5)  # control: the old crossing
    assert _max_step_ms(three, 8, 3.0, 1.0) == math.inf


def test_alpha_trades_late_fraction_for_a_longer_window():
    """alpha 0.25 at slo 5, T 10, D 8: 1 - 8/Δ <= 0.25 up to Δ = 10 (Δ = 8 with alpha 0).
    The threshold step time is the crossing 1 - c / (T/slo - 1) = alpha, c = D/Δ:
    T = slo (1 + c / (1 - alpha))."""
    for alpha, window in ((0.25, 10), (0.0, 8)):
        batch = fetch_bound([10], slo=5.0, deposits=[8], alpha=alpha, window=(1, 64))
        plan = Planner().plan(batch)
        assert plan.window_steps == window and not plan.paused
    req = RequestSpec("r0", 10, 5.0, 8)
    assert _max_step_ms([req], 16, 0.25, 1.0) == pytest.approx(5.0 * (1 + 0.5 / 0.75))
    assert _max_step_ms([req], 8, 0.0, 1.0) == pytest.approx(10.0)
    # two requests, alpha 1: r1 (no deposit) is late at every step past 6 ms, so r0 must stay
    # covered: T <= theta_0 = 5 (1 + 8/8) = 10 ms
    reqs = [req, RequestSpec("r1", 10, 6.0, 0)]
    assert _max_step_ms(reqs, 8, 1.0, 1.0) == pytest.approx(10.0)
    assert _late(reqs, 10.0, 8) == pytest.approx(1.0)
    assert _late(reqs, 10.01, 8) > 1.0


def test_deposit_lets_a_tight_request_stay():
    """A request over its SLO stays when its token deposit covers the window; without it, it is paused."""
    with_deposit = fetch_bound([10, 12], slo=[5.0, 100.0], deposits=[30, 0], alpha=0.0, window=(1, 8))
    plan = Planner().plan(with_deposit)
    assert plan.paused == () and set(plan.placements) == {"r0", "r1"}
    without = fetch_bound([10, 12], slo=[5.0, 100.0], deposits=[0, 0], alpha=0.0, window=(1, 8))
    plan = Planner().plan(without)
    # r1 (larger) goes first by the "largest" rule; the cap still fails for r0, then r0 goes.
    assert plan.paused == ("r1", "r0") and not plan.feasible


def test_alpha_tolerates_late_fraction():
    """A request with no deposit at twice its SLO fails every step: late fraction 1, within
    alpha 1; alpha 0.5 pauses it (the cap up to session 42 counted it as 1 - 5/10 = 0.5 late and
    kept it)."""
    batch = fetch_bound([10], slo=5.0, alpha=1.0, window=(4, 4))
    plan = Planner().plan(batch)
    assert plan.feasible and plan.paused == () and plan.extras["late_fraction"] == pytest.approx(1.0)
    half = fetch_bound([10], slo=5.0, alpha=0.5, window=(4, 4))
    plan = Planner().plan(half)
    assert plan.paused == ("r0",) and not plan.feasible


# Memory (b = context + 1): all-offloaded needs 101 + 61 + 21 = 183 > 165; any single pause fits.
# largest blocks+deposit: r1 (61 + 50 = 111 > 101); longest: r0; shortest: r2.
VICTIM_CASE = dict(contexts=[100, 60, 20], deposits=[0, 50, 0], layers=4, budget=165)


@pytest.mark.parametrize(("rule", "victim"), [("largest", "r1"), ("longest", "r0"), ("shortest", "r2")])
def test_pause_picks_the_victim_of_each_rule(rule, victim):
    """When even all-offloaded does not fit, exactly the rule's victim is paused and the rest fit."""
    batch = make_batch(VICTIM_CASE["contexts"], deposits=VICTIM_CASE["deposits"], layers=4, budget=165, window=(1, 1), block_size=1)
    # block_size 1, window 1: b = context + 1
    plan = Planner().plan(batch, victim_rule=rule)
    assert plan.paused == (victim,)
    assert plan.feasible and victim not in plan.placements and len(plan.placements) == 2
    assert plan.resident_blocks + plan.staging_blocks <= 165


@pytest.mark.parametrize(("rule", "finishing", "victim"), [
    ("largest", "r1", "r0"), ("longest", "r0", "r1"), ("shortest", "r2", "r1"),
])
@pytest.mark.parametrize("left", [0, 1])
def test_a_request_about_to_finish_is_paused_last(rule, finishing, victim, left):
    """The rule's own victim, one or no token from its end, is passed over for the next one in
    the rule's order: it frees its KV on finishing anyway (and the data plane would not pause
    it). Negative control: two tokens left, it is the victim again."""
    import dataclasses

    batch = make_batch(VICTIM_CASE["contexts"], deposits=VICTIM_CASE["deposits"], layers=4, budget=165, window=(1, 1),
                       block_size=1)

    def with_left(n):  # noqa: ANN001, ANN202
        reqs = tuple(dataclasses.replace(r, remaining_tokens=n) if r.id == finishing else r for r in batch.requests)
        return dataclasses.replace(batch, requests=reqs)

    plan = Planner().plan(with_left(left), victim_rule=rule)
    assert plan.paused == (victim,) and plan.feasible and finishing in plan.placements
    assert Planner().plan(with_left(2), victim_rule=rule).paused == (finishing,)


@pytest.mark.parametrize("rule", ["largest", "longest", "shortest", "random"])
def test_kept_requests_are_paused_after_every_other_one(rule):
    """``keep`` (the controller's held and forced requests) puts them last in the victim order:
    the rule's victim kept, the next one in its order is paused. Control: without keep, the
    rule's victim. Keeping all three, one is still paused (a kept one goes when it must)."""
    batch = make_batch(VICTIM_CASE["contexts"], deposits=VICTIM_CASE["deposits"], layers=4, budget=165, window=(1, 1),
                       block_size=1)
    victim = Planner().plan(batch, victim_rule=rule, seed=1).paused
    assert len(victim) == 1
    plan = Planner().plan(batch, victim_rule=rule, seed=1, keep=frozenset(victim))
    assert len(plan.paused) == 1 and plan.paused != victim and victim[0] in plan.placements and plan.feasible
    assert len(Planner().plan(batch, victim_rule=rule, keep=frozenset({"r0", "r1", "r2"})).paused) == 1


def test_random_victim_is_seeded():
    """The random rule is reproducible for a seed and pauses one of the requests."""
    batch = make_batch(VICTIM_CASE["contexts"], deposits=VICTIM_CASE["deposits"], layers=4, budget=165)
    picks = {Planner().plan(batch, victim_rule="random", seed=s).paused for s in range(12)}
    assert all(len(p) == 1 and p[0] in {"r0", "r1", "r2"} for p in picks)
    assert len(picks) > 1
    assert Planner().plan(batch, victim_rule="random", seed=3).paused == Planner().plan(batch, victim_rule="random", seed=3).paused


def test_kv_growth_over_the_window_is_budgeted():
    """Blocks are sized at context + Δ: a budget that fits now but not after Δ steps forces offload."""
    batch = make_batch([8], layers=2, comp=1.0, budget=2 * 9, window=(4, 4))
    plan = Planner().plan(batch)
    assert plan.placements["r0"] != (1, 1)  # (8 + 4) * 2 = 24 > 18 resident blocks
    assert plan.resident_blocks + plan.staging_blocks <= 18


def test_unknown_victim_rule_is_rejected():
    """A bad victim rule names the allowed values."""
    with pytest.raises(ValueError, match="largest"):
        Planner().plan(make_batch([1]), victim_rule="oldest")
