"""The decision never idles the GPU, nor holds a request paused for good, because of a request that
cannot run even alone (control-plane review, session 78: found by a random property search over
small worker states; each case reproduced on the old DecisionBuilder).

- LVF's rotation-out is carried out only when a rotation-in or an admission uses the room: it
  paused the only runnable request for one the planner cannot run, every other step.
- A plan that pauses everyone (the victim rule pauses the short request before the long one that
  cannot run alone) and admits nothing runs its victims alone in the same decision: the GPU idled
  until it expired.
- The starvation guard forces the next starving request when the longest-paused one cannot run:
  that one held every later starving request paused for good.

Real SessionController, schedulers, Planner and CBC, driven by the worker loop of the harness.
"""

from __future__ import annotations

import pytest

from controlplane.api import QueuedRequest
from controlplane.controller import SessionController
from controlplane.planner import Planner
from controlplane.policy import Policy
from controlplane.policy_store import PolicyStore
from tests.controlplane.test_controller_harness import WorkerLoop, worker_info

LONG = 1500
"""94 blocks per layer: on a GPU of 48 or 64 blocks the planner cannot run it even alone."""


def session(scheduler: str, budget: int, sync: bool = True, **policy: object) -> SessionController:
    # the guard's forcing under victim rule 'largest' (lost-first, the default, forces a starving
    # request in only by pausing lost ones: tests/controlplane/test_lost_first.py)
    store = PolicyStore(Policy.from_dict({"window_min": 4, "window_max": 8, "slo_tbt_ms": 6.0,
                                          "victim_rule": "largest", **policy}))
    return SessionController(worker_info(budget_blocks=budget, h2d_gbps=1.0, scheduler=scheduler),
                             policy_source=store.get, synchronous=sync,
                             planner=Planner(use_mip=False, exact_search=False), time_budget_ms=60_000)


def idle_reports(w: WorkerLoop, n: int, sync: bool) -> int:
    """Reports after which the worker runs nothing although requests are in flight."""
    idle = 0
    for _ in range(n):
        if not sync:
            assert w.session.flush()
        w.report()
        idle += not (set(w.ctx) - w.paused)
    return idle


@pytest.mark.parametrize("sync", [True, False])
def test_lvf_does_not_rotate_out_for_a_request_that_cannot_run(sync: bool) -> None:
    s = session("lvf", 64, sync)
    w = WorkerLoop(s)
    w.add("long", LONG)
    w.add("short", 100)
    assert idle_reports(w, 24, sync) == 0  # the old builder: 12 of 24
    assert not any("short" in d.pause for d in w.decisions)
    s.close()


def test_control_lvf_still_rotates_a_request_in() -> None:
    """The room a rotation-out makes is used: a paused request that runs (but not beside the
    running one, at this SLO) rotates in, the running one out (SuperInfer's time slicing)."""
    s = session("lvf", 64, slo_tbt_ms=4.6)
    w = WorkerLoop(s)
    w.add("a", 400)
    w.add("b", 400)
    w.paused.add("b")  # the worker paused it on its own
    rotated = False
    for _ in range(24):
        out = w.report()
        rotated |= any(d.pause and d.resume for d in out)
    assert rotated
    s.close()


@pytest.mark.parametrize("sync", [True, False])
def test_a_plan_that_pauses_everyone_runs_its_victims_alone(sync: bool) -> None:
    s = session("fcfs", 48, sync, victim_rule="shortest", window_min=16, window_max=64)
    w = WorkerLoop(s)
    w.add("long", LONG)
    w.add("short", 100)
    if not sync:
        w.report()
        assert s.flush()
    out = w.report()
    assert [d.pause for d in out] == [("long",)]  # 'short' keeps running (was paused with 'long')
    assert idle_reports(w, 16, sync) == 0  # the old builder: 16, until the plan expired
    s.close()


def test_control_a_plan_nobody_can_run_in_stays_empty() -> None:
    """Victims that cannot run alone either are not forced in: the decision pauses them all."""
    s = session("fcfs", 48, victim_rule="shortest")
    w = WorkerLoop(s)
    w.add("long", LONG)
    w.add("long2", LONG + 100)
    out = w.report()
    assert [set(d.pause) for d in out] == [{"long", "long2"}] and not out[0].plan.placements
    s.close()


def test_control_an_admission_takes_the_emptied_batch() -> None:
    """With a prompt admitted, the emptied batch is its prefill's, as before: running a victim
    in its place raised kvplane-combined's P99 TTFT from 28 s to 451 s (session 78)."""
    s = session("fcfs", 48, victim_rule="shortest", window_min=16, window_max=64)
    w = WorkerLoop(s)
    w.add("long", LONG)
    w.add("short", 100)
    w.queued.append(QueuedRequest(id="q", prompt_tokens=200, arrival_ms=0.0))
    out = w.report()
    assert [(set(d.pause), d.resume, d.admit) for d in out] == [({"short", "long"}, (), ("q",))]
    s.close()


@pytest.mark.parametrize("sync", [True, False])
def test_the_guard_forces_the_next_starving_request_past_one_that_cannot_run(sync: bool) -> None:
    """a_huge cannot run even alone; b_mid runs alone but not beside c_run. The guard forces
    b_mid in (pausing c_run) once a_huge's turn is found blocked; then they take turns."""
    s = session("fcfs", 48, sync, max_paused_steps=6)
    w = WorkerLoop(s)
    w.add("a_huge", LONG)
    w.add("b_mid", 450)
    w.add("c_run", 450)
    w.paused |= {"a_huge", "b_mid"}  # paused by the worker before the first report
    longest = {"b_mid": 0, "c_run": 0}
    since = {"b_mid": 0, "c_run": 0}
    for _ in range(80):
        if not sync:
            assert s.flush()
        w.report()
        for rid in longest:
            since[rid] = since[rid] + 1 if rid in w.paused else 0
            longest[rid] = max(longest[rid], since[rid])
    assert "a_huge" in w.paused
    assert max(longest.values()) <= 6 + 4 + 2, longest  # max_paused_steps + window_min (+ async)
    s.close()  # the old builder: b_mid paused all 80 steps


def test_control_without_the_blocked_request_the_guard_is_unchanged() -> None:
    s = session("fcfs", 48, max_paused_steps=6)
    w = WorkerLoop(s)
    w.add("b_mid", 450)
    w.add("c_run", 450)
    w.paused.add("b_mid")
    w.report()
    guard = [(w.step, d.pause, d.resume) for _ in range(10) for d in w.report() if "starvation" in d.reason]
    assert guard[0] == (7, ("c_run",), ("b_mid",))  # paused at step 1, forced in at 1 + 6
    s.close()


@pytest.mark.parametrize("sync", [True, False])
def test_an_empty_batch_resumes_one_that_runs_alone_past_four_that_cannot(sync: bool) -> None:
    """Four requests that cannot run even alone were paused longer than 'short', which the worker
    paused on its own: each refusal on the empty batch used up one of the four resume trials, so
    'short' was never tried and the GPU idled at every re-plan (session 79, fuzz seed 166)."""
    s = session("fcfs", 64, sync, max_paused_steps=2000)
    w = WorkerLoop(s)
    for i in range(4):
        w.add(f"long{i}", LONG + 50 * i)
    w.add("short", 300)
    for _ in range(2):
        if not sync:
            assert s.flush()
        w.report()
    assert set(w.paused) == {f"long{i}" for i in range(4)}
    w.paused.add("short")  # e.g. SGLang retracted it
    assert idle_reports(w, 12, sync) <= 2
    assert "short" not in w.paused
    s.close()
