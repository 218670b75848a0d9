"""The per-report scheduler probe does not re-plan an answer the planner keeps refusing.

LayerKV's refill proposes a paused request whenever its step predictor says the batch with it is
on time; the plan then refuses the resume (the planner's exact timeline pauses someone). The
probe saw the same proposal on every report and fired ``schedule`` each time: a full plan per
step, each carrying out nothing (control-plane review, session 77; found by a random search over
small worker states). An answer a plan already served fires again only ``window_min`` steps later.
Real SessionController, LayerKV scheduler, Planner.
"""

from __future__ import annotations

from controlplane.api import QueuedRequest
from controlplane.controller import SessionController
from controlplane.controller.batch_limits import BatchLimits
from controlplane.planner import Planner
from controlplane.policy import Policy
from controlplane.policy_store import PolicyStore
from tests.controlplane.test_controller_harness import WorkerLoop, worker_info

WINDOW = 8


def refused_refill() -> tuple[SessionController, WorkerLoop]:
    """r0 runs alone (batch limit 2); paused r1 is the refill's proposal, refused by each plan;
    q1 waits, so the scheduler is probed on every report."""
    store = PolicyStore(Policy.from_dict({"window_min": WINDOW, "window_max": WINDOW, "slo_tbt_ms": 11.6}))
    session = SessionController(
        worker_info(budget_blocks=50, h2d_gbps=2.3, scheduler="layerkv"), policy_source=store.get,
        synchronous=True, planner=Planner(use_mip=False, exact_search=False), time_budget_ms=60_000,
        batch_limits=BatchLimits(2, 100_000))
    w = WorkerLoop(session)
    w.add("r0", 674)
    w.add("r1", 133)
    w.report()
    w.paused.update(("r0", "r1"))  # the worker paused both on its own
    w.queued += [QueuedRequest(id=q, prompt_tokens=800, arrival_ms=w.now_ms) for q in ("q0", "q1")]
    w.report()
    w.report()
    st = session.status()
    assert st.running == ("r0",) and set(st.paused) == {"r1", "q0"}, st
    probe = session._builder.schedule_only(session._snapshot(store.get(), (), False))
    assert probe.resume == ("r1",)  # the proposal the plans refuse
    return session, w


def test_a_refused_rotation_in_is_planned_once_per_window_not_every_report() -> None:
    session, w = refused_refill()
    fired = []
    for _ in range(3 * WINDOW):
        out = w.report()
        if "schedule" in session.status().last_triggers:
            fired.append(w.step)
            assert [(d.pause, d.resume, d.admit) for d in out] == [((), (), ())]
    assert 1 <= len(fired) <= 4, fired  # every report without the bound: 24
    assert all(b - a >= WINDOW for a, b in zip(fired, fired[1:], strict=False)), fired


def test_control_a_changed_batch_still_resumes_at_once() -> None:
    """The bound holds back only the same answer: r0 finishing resumes the paused at once."""
    session, w = refused_refill()
    for _ in range(2):
        w.report()
    w.finish("r0")
    out = w.report()
    assert any(d.resume for d in out)
    assert "r0" not in session.status().running
