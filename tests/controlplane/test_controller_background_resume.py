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
