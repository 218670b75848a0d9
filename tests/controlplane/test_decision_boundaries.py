"""Exact boundaries of the controller's decisions: where a rule's ``<`` against ``<=``, a step's
off-by-one or a forgotten term changes what is admitted, paused or resumed, and by when.

A mutation audit of the control plane (session 87: 45 one-line mutations of the decision logic)
found these changed decisions that the suite let through -- the tests before checked "at least"
bounds or drew the boundary case only at random. Each test here is a small real scenario on the
real schedulers, decision builder and session controller; each fails with its mutation applied
(named in the docstring).
"""

from __future__ import annotations

import dataclasses
from dataclasses import replace

import pytest

from controlplane.controller.decision_builder import MAX_RESUME_TRIALS
from controlplane.controller.schedulers import make_scheduler
from controlplane.controller.schedulers.fcfs import FcfsScheduler
from controlplane.controller.schedulers.layerkv import (
    LayerKVScheduler,
    allow_prefill_ms,
    prefill_ms,
)
from controlplane.model import Hardware
from controlplane.policy import Policy
from tests.controlplane.test_schedulers import q, req, view


@pytest.mark.parametrize("scheduler", [FcfsScheduler, LayerKVScheduler], ids=["fcfs", "layerkv"])
def test_a_partly_offloaded_admission_leaves_room_net_of_its_staging_layer(scheduler) -> None:  # noqa: ANN001
    """Two prompts, 35 free blocks: ``q1`` (160 tokens) keeps 2 layers on the GPU plus one staging
    layer, so the next prompt gets what is left after both, and ``q2`` keeps none (its 2 layers
    would need 8 blocks of the 5 left). Mutation: the remaining budget without the staging layer
    (``(0 if keep == layers else 1)`` -> ``0``) gives ``q2`` 2 layers: over-admitted memory."""
    d = scheduler().schedule(view(queued=(q("q1", 160, arrival=0.0), q("q2", 64, arrival=1.0)), free=35))
    assert d.admit == ("q1", "q2") and d.min_gpu_layers == {"q1": 2, "q2": 0}


def test_lvf_prioritises_a_waiting_prompt_at_vlt_zero() -> None:
    """SuperInfer's VLT is ReLU(...): a fresh prompt under contention, not yet past beta_f x its
    TTFT SLO, has VLT exactly 0 and still ranks among the waiting requests (Algorithm 1): admitted.
    Mutation: ``vlt_ms >= 0`` -> ``> 0`` admits nothing."""
    pol = Policy.from_dict({"slo_ttft_ms": 400.0, "lvf": {"alpha": 1.0, "beta_b": 0.0, "beta_f": 0.5,
                                                          "transfer_budget_blocks": 60}})
    v = view(now=1000.0, running=(req("r_old", run_since=0.0),), paused=(req("p", last_token=100.0, paused=True),),
             queued=(q("new", 160, arrival=950.0),), free=20, policy=pol)
    assert make_scheduler("lvf").schedule(v).admit == ("new",)


def test_lvf_does_not_rotate_out_a_request_that_started_this_instant() -> None:
    """A running request whose run started at ``now`` has VLT -0.0: it is not behind, and LVF
    rotates out only requests with negative VLT. Mutation: ``vlt_ms < 0`` -> ``<= 0`` pauses it
    (before, only a random property test drew this case, 2 runs in 6)."""
    pol = Policy.from_dict({"lvf": {"alpha": 1.0, "beta_b": 0.0, "beta_f": 0.0, "transfer_budget_blocks": 60}})
    v = view(now=1000.0, running=(req("r_just", run_since=1000.0),),
             paused=(req("p", last_token=100.0, paused=True),), free=0, policy=pol)
    assert make_scheduler("lvf").schedule(v).pause == ()


def test_layerkv_eq2_refuses_a_prefill_exactly_at_its_bound() -> None:
    """LayerKV Eq. 2 admits a prefill only when it is strictly shorter than what the running
    requests' TPOT slack allows: at an exact tie (5.0 ms both) the paper variant refuses.
    Mutation: ``<`` -> ``<=`` admits ``w``."""
    pol = Policy.from_dict({"layerkv": {"tpot_margin": 1.0, "model_params": 2_500_000_000 - 1, "hidden_size": 1,
                                        "device_tflops": 1.0}})
    r = req("r", gen=10, slo=100.0, first_seen=955.0)
    v = view(now=2000.0, running=(r,), queued=(q("w", 1),), tpot=50.0, policy=pol)
    assert prefill_ms(1, pol.layerkv) == allow_prefill_ms(r, v, pol.layerkv) == 5.0
    assert LayerKVScheduler("paper").schedule(v).admit == ()


def test_layerkv_refill_rotates_a_background_request_out_for_a_paused_fitting_one() -> None:
    """A paused fitting request comes back when the batch limits have room on time: a running
    background request that makes the step with it late is paused to make room (the loop asks
    whether the batch *with the candidate* is on time). Mutation: the loop tests the batch without
    the candidate, stops at once, and neither pause nor resume is made."""
    pol = Policy.from_dict({"slo_tbt_ms": 6.0})
    v = view(running=(req("fit", ctx=160, slo=6.0), req("bg", ctx=1700, slo=6.0)),
             paused=(req("p", ctx=800, slo=6.0, paused=True),), free=0, policy=pol)
    v = dataclasses.replace(v, hardware=Hardware(gpu_kv_budget_blocks=400, h2d_gbps=2.0), h2d_gbps=2.0)
    d = LayerKVScheduler().schedule(v)
    assert d.pause == ("bg",) and d.resume == ("p",)


def test_a_finish_tries_max_resume_trials_paused_requests() -> None:
    """With a request running and six small paused ones, a finish resumes up to
    ``MAX_RESUME_TRIALS`` (4) of them, longest paused first. Mutation: ``trials > MAX`` ->
    ``>=`` resumes 3."""
    from tests.controlplane.test_decision_builder_guard import build
    from tests.controlplane.test_decision_builder_guard import view as rview

    running = (rview("r", 100),)
    paused = tuple(rview(f"p{i}", 100, 2) for i in range(6))
    b, _, inp = build(running, paused, 100_000, max_paused_steps=1000)
    d = b.build(replace(inp, try_resume=True, reasons=("batch-change",)))
    assert d.resume == tuple(f"p{i}" for i in range(MAX_RESUME_TRIALS)) and MAX_RESUME_TRIALS == 4


def test_a_starving_request_the_scheduler_would_pause_is_still_forced_in() -> None:
    """Four huge starving requests that cannot run and a starving background one the LayerKV
    scheduler would pause: the guard forces the background one in (a starving request is exempt
    from the scheduler-pause skip). Mutation: dropping ``and rid not in starving_ids`` resumes
    nobody."""
    from tests.controlplane.test_decision_builder_guard import build
    from tests.controlplane.test_decision_builder_guard import view as rview

    running = (rview("fit", 100, slo=5.0),)
    paused = tuple(rview(f"huge{i}", 6000, 40 - i, slo=5.0) for i in range(4)) + (rview("bg", 600, 10, slo=5.0),)
    b, _, inp = build(running, paused, 64, "layerkv", slo_tbt_ms=5.0, max_paused_steps=4)
    assert b.build(inp).resume == ("bg",)


def test_a_dropped_pause_is_held_through_its_last_step_and_not_after() -> None:
    """The hold of a request whose pause the worker dropped lasts through step ``until`` (16
    plans from step 2: steps 2..18) and ends after it. Mutation: ``until >= step`` -> ``>``
    ends it a step early."""
    from tests.controlplane.test_controller_dropped_pause import make

    s, w = make(True)
    try:
        w.reports_drops, w.unpausable = True, frozenset({"a"})
        while not s._tracker._holds:
            w.report()
        _, until = s._tracker._holds["a"]
        assert "a" in s._tracker.held(until) and "a" not in s._tracker.held(until + 1)
        assert [st for st in range(w.step, until + 3) if "a" in s._tracker.held(st)] == list(range(w.step, until + 1))
    finally:
        s.close()


def test_the_starvation_guard_refires_every_window_min_steps() -> None:
    """A starving request that can never run: the guard fires at step 7 and then every
    ``window_min`` (4) steps. Mutation: the re-fire test ``>= window_min`` -> ``>`` fires every 5."""
    from tests.controlplane.test_controller_harness import WorkerLoop
    from tests.controlplane.test_controller_idle_gpu import LONG, session

    s = session("fcfs", 48, max_paused_steps=6)
    try:
        w = WorkerLoop(s)
        w.add("a_huge", LONG)
        w.add("c_run", 450)
        w.paused.add("a_huge")
        fired = []
        for _ in range(30):
            w.report()
            if "starvation" in s._last_triggers:
                fired.append(w.step)
        assert fired == [7, 11, 15, 19, 23, 27]
    finally:
        s.close()


def test_the_scheduler_probe_refires_every_window_min_steps() -> None:
    """The schedule probe of a refill the planner keeps refusing fires at step 4, then every
    ``window_min`` (8) steps. Mutation: ``< window_min`` -> ``<=`` fires at 4, 14, 24."""
    from tests.controlplane.test_controller_schedule_probe import WINDOW, refused_refill

    session, w = refused_refill()
    fired = []
    for _ in range(3 * WINDOW):
        w.report()
        if "schedule" in session.status().last_triggers:
            fired.append(w.step)
    assert WINDOW == 8 and fired == [4, 12, 20]


def test_a_pause_counts_from_the_step_it_applies_at() -> None:
    """A decision made at report step 1 applies at step 2: its pause of ``A`` counts from step 2,
    and the starvation guard (3 paused steps) resumes ``A`` at step 5. Mutation:
    ``apply_at_step = step + 1`` -> ``step`` counts from step 1 and resumes at step 4."""
    from tests.controlplane.test_controller import _tight

    session, w, _ = _tight("largest", max_paused_steps=3)
    (d,) = w.report()
    assert d.apply_at_step == 2 and session._tracker._requests["A"].paused_since_step == 2
    resumed = []
    for _ in range(6):
        resumed += [w.step for d in w.report() if "A" in d.resume]
    assert resumed[:1] == [5]
