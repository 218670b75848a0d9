"""An SLO below the all-resident step (``controlplane/planner/slo_cap.py``, "An SLO no placement
can meet"): the planner's SLO cap counts it from that step, so requests are paused for lateness a
placement causes, never for lateness no placement or pause can remove."""

from __future__ import annotations

import pytest

from controlplane.model import Batch
from controlplane.planner import Planner
from controlplane.planner.slo_cap import cap_view


def _batch(contexts, slos, *, comp, budget=100_000, alpha=1.0, deposits=None, credit=True) -> Batch:
    deposits = deposits or [0] * len(contexts)
    return Batch.from_dict({
        "model": {"layers": 8, "block_size": 16, "block_bytes": 65536},
        "hardware": {"gpu_kv_budget_blocks": budget, "h2d_gbps": 25.0},
        "profile": {"layer_compute_ms": comp},
        "requests": [{"id": rid, "context_tokens": c, "slo_tbt_ms": s, "deposit_tokens": d}
                     for (rid, c), s, d in zip(contexts, slos, deposits, strict=True)],
        "policy": {"alpha": alpha, "window_min": 1, "window_max": 64, "deposit_credit": credit},
    })


def test_a_step_slower_than_every_slo_with_all_kv_on_the_gpu_pauses_nobody():
    """8 layers of 30 ms (240 ms with every layer resident) against SLOs of 200 ms, memory for
    all: no plan is faster, so all three run (before: two paused, the third still at 240 ms)."""
    batch = _batch([("a", 1000), ("b", 3000), ("c", 6000)], [200.0] * 3, comp=30.0)
    plan = Planner().plan(batch)
    assert plan.feasible and plan.paused == () and set(plan.placements) == {"a", "b", "c"}
    assert plan.predicted_step_ms == pytest.approx(240.0)
    assert all(all(p) for p in plan.placements.values())  # every layer on the GPU


def test_placement_lateness_beyond_the_all_resident_step_still_pauses():
    """The control: the same requests where memory forces fetches that make the step slower than
    the all-resident 240 ms; at alpha 0 that lateness is the placement's, so requests are paused
    (largest first) until the rest fit without it."""
    blocks = [(c + 64 + 15) // 16 for c in (1000, 3000, 6000)]  # at the largest window
    batch = _batch([("a", 1000), ("b", 3000), ("c", 6000)], [200.0] * 3, comp=30.0,
                   budget=8 * (blocks[0] + blocks[1]) + blocks[2] // 2, alpha=0.0)
    plan = Planner().plan(batch)
    assert plan.paused and plan.paused[0] == "c"
    assert plan.predicted_step_ms == pytest.approx(240.0)


def test_clients_asking_for_less_than_the_model_can_do_pause_no_other_request():
    """Two requests asking 10 ms of a 32 ms model and one at 200 ms, memory for all: before, the
    cap (alpha 1) paused the 200 ms request (the largest) and one of the two, though it was on
    time and no pause made the step faster; now nobody is paused."""
    batch = _batch([("tight1", 1000), ("tight2", 1000), ("normal", 9000)], [10.0, 10.0, 200.0], comp=4.0)
    plan = Planner().plan(batch)
    assert plan.paused == () and plan.feasible
    # control: SLOs of 5 ms, below the 8 ms all-resident step of a faster model, are still late
    # once memory forces fetches past that step, and the cap pauses again
    tight = _batch([("tight1", 1000), ("tight2", 1000), ("normal", 9000)], [5.0, 5.0, 200.0], comp=1.0,
                   budget=600, alpha=0.0)
    plan = Planner().plan(tight)
    assert plan.paused and plan.paused[0] == "normal"


def test_cap_view_raises_only_slos_below_the_floor_and_maps_the_victims():
    """SLOs below the compute sum become the sum (with 1e-9 of room: a plan one rounding error
    above it is not late), others stay; a raised request's deposit is 0 (it drains at its raw
    SLO), others' only without credit; the victims are the view's requests in the same order;
    nothing to change returns the same objects."""
    batch = _batch([("a", 100), ("b", 100), ("c", 100)], [5.0, 50.0, 7.0], comp=1.0, deposits=[3, 2, 4])
    victims = [batch.requests[2], batch.requests[0]]
    view, mapped = cap_view(batch, victims)
    assert [r.slo_tbt_ms for r in view.requests] == pytest.approx([8.0, 50.0, 8.0], rel=1e-8)
    assert all(r.slo_tbt_ms > 8.0 for r in (view.requests[0], view.requests[2]))
    assert [r.deposit_tokens for r in view.requests] == [0, 2, 0]
    assert view.requests[1] is batch.requests[1]
    assert [v.id for v in mapped] == ["c", "a"] and all(v in view.requests for v in mapped)
    off, _ = cap_view(_batch([("a", 100), ("b", 100)], [5.0, 50.0], comp=1.0, deposits=[3, 2], credit=False), [])
    assert [r.deposit_tokens for r in off.requests] == [0, 0]
    assert off.requests[0].slo_tbt_ms == pytest.approx(8.0) and off.requests[1].slo_tbt_ms == 50.0
    fine = _batch([("a", 100)], [9.0], comp=1.0)
    assert cap_view(fine, victims[:0]) == (fine, [])
    assert cap_view(fine, [])[0] is fine


ROUNDING_CASE = {  # found by a review: a plan whose fetches all hide, one rounding error above
    "model": {"layers": 16, "block_size": 16, "block_bytes": 65536},  # the compute sum
    "hardware": {"gpu_kv_budget_blocks": 231, "h2d_gbps": 25.0},
    "profile": {"layer_compute_ms": [
        0.5541468118110615, 0.6714421483312618, 0.6319651944744602, 0.4814178766496414,
        0.3208835058624534, 1.9297916456285924, 1.9373326742376464, 0.36651519002607624,
        1.7164894474962205, 1.2842587485313535, 0.6528960710854587, 1.80034705892273,
        0.4975032367226413, 1.388309443221359, 1.4431460167730759, 1.487865009692158]},
    "requests": [{"id": "r0", "context_tokens": 115, "slo_tbt_ms": 0.001},
                 {"id": "r1", "context_tokens": 96, "slo_tbt_ms": 0.001}],
    "policy": {"alpha": 1.0, "window_min": 1, "window_max": 8},
}


def test_a_plan_one_rounding_error_above_the_all_resident_step_is_on_time():
    """Memory forces offloads whose fetches all hide: the step is the compute sum but for one
    rounding error (17.164310079466198 vs ...194). With the floor exactly at the sum, r0 was
    paused; the floor's 1e-9 of room keeps both running."""
    batch = Batch.from_dict(ROUNDING_CASE)
    plan = Planner().plan(batch)
    floor = sum(batch.profile.layer_compute_ms)
    assert plan.paused == () and plan.predicted_step_ms > floor
    assert plan.predicted_step_ms == pytest.approx(floor, rel=1e-12)
    assert not all(all(p) for p in plan.placements.values())  # offloaded: the fetches hid
