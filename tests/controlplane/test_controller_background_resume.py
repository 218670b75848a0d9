"""A finish does not resume a paused request that the scheduler pauses again at the next plan.

Under LayerKV a running *background* request (longer than the GPU holds in every layer) that makes
the fitting requests' steps late is paused. The decision builder's resume on a finish asked only
the planner (the plan with it is feasible and pauses nobody) and resumed the longest-paused
request, a background one; the very next plan's scheduler paused it again: its KV moved in and
out for a step or two at every finish (control-plane fuzz, session 79). The resume now asks the
scheduler too, and skips such a request (later paused ones are still tried). Real
SessionController, LayerKV scheduler, Planner.
"""

from __future__ import annotations

from controlplane.api import QueuedRequest
from controlplane.controller import SessionController
from controlplane.planner import Planner
from controlplane.policy import Policy
from controlplane.policy_store import PolicyStore
from tests.controlplane.test_controller_harness import WorkerLoop, worker_info


def run(slo_tbt_ms: float) -> list[tuple[int, str]]:
    """60 reports; three fitting requests finish at reports 10, 30 and 50. Returns each decision's
    effect on 'bg': (step, 'P' paused / 'R' resumed / '-')."""
    store = PolicyStore(Policy.from_dict({"window_min": 8, "window_max": 16, "slo_tbt_ms": slo_tbt_ms,
                                          "max_paused_steps": 2000}))  # no starvation guard
    s = SessionController(worker_info(budget_blocks=742, h2d_gbps=5.66, scheduler="layerkv"),
                          policy_source=store.get, synchronous=True,
                          planner=Planner(use_mip=False, exact_search=False), time_budget_ms=60_000)
    w = WorkerLoop(s)
    for rid, ctx in (("f1", 300), ("f2", 680), ("f3", 800), ("f4", 1300), ("f5", 500), ("bg", 3000)):
        w.add(rid, ctx)
    finishers = ["f4", "f5", "f3"]
    log: list[tuple[int, str]] = []
    for k in range(60):
        if k in (10, 30, 50):
            w.finish(finishers.pop(0))
        for d in w.report():
            log.append((w.step, "P" if "bg" in d.pause else ("R" if "bg" in d.resume else "-")))
    s.close()
    return log


def undone(log: list[tuple[int, str]]) -> list[tuple[int, int]]:
    return [(a[0], b[0]) for a, b in zip(log, log[1:], strict=False) if a[1] == "R" and b[1] == "P"]


def test_a_finish_does_not_resume_a_background_request_the_scheduler_pauses_again() -> None:
    log = run(5.0)
    assert log[0][1] == "P"  # the first plan pauses 'bg': it makes the fitting requests late
    assert undone(log) == [], log  # the old builder: resumed at 11 and 31, paused at 28 and 48


def test_control_a_background_request_that_keeps_the_batch_on_time_resumes() -> None:
    """With a slightly looser SLO the first finish leaves room: 'bg' is resumed and runs on."""
    log = run(5.5)
    assert [e for e in log if e[1] != "-"] == [(1, "P"), (11, "R")], log


def _layerkv(h2d_gbps: float) -> tuple[SessionController, WorkerLoop]:
    store = PolicyStore(Policy.from_dict({"window_min": 4, "window_max": 8, "slo_tbt_ms": 5.0,
                                          "max_paused_steps": 2000}))
    s = SessionController(worker_info(budget_blocks=48, h2d_gbps=h2d_gbps, scheduler="layerkv"),
                          policy_source=store.get, synchronous=True,
                          planner=Planner(use_mip=False, exact_search=False), time_budget_ms=60_000)
    return s, WorkerLoop(s, step_ms=1.0)


def test_the_probe_sees_the_prompt_the_decision_admits() -> None:
    """'B' (background) is paused; 'X' finishes as prompt 'Q' queues. The probe ran the scheduler
    without this decision's admission: 'B' was resumed beside the admitted 'Q' and paused again
    at the next report (review of session 79). Control: without 'Q', 'B' resumes and runs on."""
    for with_q in (False, True):
        s, w = _layerkv(0.5)
        w.add("F", 60)
        w.add("X", 20)
        w.add("B", 200)
        w.paused.add("B")
        events: list[tuple[int, str]] = []
        for k in range(30):
            if k == 2:
                w.finish("X")
                if with_q:
                    w.queued.append(QueuedRequest("Q", 60, w.now_ms))
            for d in w.report():
                events += [(w.step, "R")] if "B" in d.resume else []
                events += [(w.step, "P")] if "B" in d.pause else []
        s.close()
        if with_q:
            assert "R" not in [e for _, e in events], events
        else:  # resumed, and runs on for 20 reports or more
            assert events[0][1] == "R" and all(k - events[0][0] >= 20 for k, _ in events[1:]), events


def test_a_resume_that_makes_the_scheduler_pause_another_is_not_made() -> None:
    """'F' and 'Bm' (background, 300 tokens) run on time, 'B' (background, 200) is paused; 'X'
    finishes. Resumed, 'B' made LayerKV pause 'Bm' at the next plan: a swap of KV for nothing
    (review of session 79). Control: without 'B', 'Bm' is never paused."""
    for with_b in (False, True):
        s, w = _layerkv(1.0)
        w.add("F", 60)
        w.add("Bm", 300)
        w.add("X", 20)
        if with_b:
            w.add("B", 200)
            w.paused.add("B")
        moved: list[tuple[int, tuple[str, ...], tuple[str, ...]]] = []
        for k in range(30):
            if k == 3:
                w.finish("X")
            moved += [(w.step, d.pause, d.resume) for d in w.report() if d.pause or d.resume]
        s.close()
        assert not any("Bm" in p for _, p, _ in moved), moved
        assert not any("B" in r for _, _, r in moved), moved
