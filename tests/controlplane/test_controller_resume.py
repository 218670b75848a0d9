"""The controller's resume rule and batch limits (OrbitFlow §3.4, §5.1) with the real planner."""

from __future__ import annotations

import dataclasses

from controlplane.api import QueuedRequest
from controlplane.controller import UNLIMITED, BatchLimits, SessionController
from controlplane.model import Batch, Plan
from controlplane.planner import Planner
from controlplane.policy import Policy
from controlplane.policy_store import PolicyStore
from tests.controlplane.test_controller import FIXED_WINDOW, TIGHT
from tests.controlplane.test_controller_harness import WorkerLoop, worker_info


class CountingPlanner:
    """The real planner; counts the plans whose batch includes a given request."""

    def __init__(self, watch: str) -> None:
        self.inner = Planner()
        self.watch = watch
        self.with_watch = 0

    def plan(self, batch: Batch, **kw: object) -> Plan:
        if any(r.id == self.watch for r in batch.requests):
            self.with_watch += 1
        return self.inner.plan(batch, **kw)  # type: ignore[arg-type]


def tight(planner: object = None, limits: BatchLimits = UNLIMITED, **policy: object
          ) -> tuple[SessionController, WorkerLoop]:
    # victim rule 'largest': the guard forces a starving request in by pausing another (under
    # lost-first, the default, only a lost one: tests/controlplane/test_lost_first.py)
    store = PolicyStore(Policy.from_dict({**FIXED_WINDOW, "victim_rule": "largest", **policy}))
    session = SessionController(
        worker_info(TIGHT), policy_source=store.get, planner=planner or Planner(),  # type: ignore[arg-type]
        synchronous=True, batch_limits=limits,
    )
    w = WorkerLoop(session)
    w.add("A", 320)
    w.add("B", 160)
    w.add("C", 96)
    return session, w


def test_expiry_does_not_retry_resuming_a_paused_request() -> None:
    """Scenario: A is paused as the infeasible batch's victim; window after window expires with
    nobody finishing. No plan may even try A (OrbitFlow §3.4: resume only after an in-flight
    request completed); C's finish then lets A back in."""
    planner = CountingPlanner("A")
    session, w = tight(planner)
    (d,) = w.report()
    assert d.pause == ("A",)
    tried = planner.with_watch
    expiries = 0
    for _ in range(3 * 4):
        for dec in w.report():
            expiries += "expiry" in dec.reason
            assert "A" not in dec.resume
    assert expiries >= 2  # the windows did expire (and re-planned)
    assert planner.with_watch == tried, "an expiry re-plan tried to resume A"
    w.finish("C")
    (d,) = w.report()
    assert planner.with_watch > tried  # negative control: a finish does try A
    assert d.resume == ("A",) and "A" in d.plan.placements


def test_resume_waits_for_a_free_batch_slot() -> None:
    """With one slot (max_requests=1), C's finish leaves B running alone: A stays paused even
    though A + B fit memory; without the limit (negative control) A resumes."""
    session, w = tight(limits=BatchLimits(max_requests=2))
    (d,) = w.report()
    assert d.pause == ("A",)
    w.finish("C")
    (d,) = w.report()
    assert d.resume == ("A",)  # B + A = 2 requests: within the limit
    session, w = tight(limits=BatchLimits(max_requests=1))
    w.report()
    w.finish("C")
    (d,) = w.report()
    assert d.resume == () and session.status().paused == ("A",)


def test_a_resumed_request_takes_the_slot_before_a_new_arrival() -> None:
    """On a finish the paused request resumes first; the queued one is admitted only if a slot
    is left (here none: limit 2 = B + A)."""
    session, w = tight(limits=BatchLimits(max_requests=2))
    w.report()
    w.queued.append(QueuedRequest("q", prompt_tokens=16, arrival_ms=1.0))
    w.finish("C")
    (d,) = w.report()
    assert d.resume == ("A",) and d.admit == ()
    session, w = tight(limits=BatchLimits(max_requests=3))
    w.report()
    w.queued.append(QueuedRequest("q", prompt_tokens=16, arrival_ms=1.0))
    w.finish("C")
    (d,) = w.report()
    assert d.resume == ("A",) and d.admit == ("q",)


def test_starvation_guard_makes_room_within_the_batch_limit() -> None:
    """A starving request is forced in even when the batch is full: the victim rule pauses
    another running request to free the slot."""
    session, w = tight(limits=BatchLimits(max_requests=2), max_paused_steps=3)
    (d,) = w.report()
    assert d.pause == ("A",)
    seen = []
    for _ in range(5):
        seen += w.report()
    forced = [d for d in seen if "A" in d.resume]
    assert forced and "starvation" in forced[0].reason
    assert len(forced[0].pause) >= 1
    assert len(forced[0].plan.placements) <= 2


def _never_runnable(*oversized: tuple[str, int], **policy: object) -> tuple[SessionController, WorkerLoop]:
    """A 40-block device budget; ``oversized`` requests hold more blocks per layer than it (they
    cannot run even alone, every layer offloaded), then B and C, small."""
    store = PolicyStore(Policy.from_dict({"window_min": 4, "window_max": 4, "slo_tbt_ms": 1000.0,
                                          "max_paused_steps": 3, **policy}))
    session = SessionController(worker_info(40), policy_source=store.get, planner=Planner(use_mip=False),
                                synchronous=True)
    w = WorkerLoop(session)
    for rid, tokens in oversized:
        w.add(rid, tokens)
    w.add("B", 32)
    w.add("C", 32)
    return session, w


def test_the_guard_pauses_nobody_for_a_request_that_cannot_run_even_alone() -> None:
    """Scenario (control-plane review, session 77): A (45 blocks a layer, a 40-block budget) starves.
    The guard forced it in and paused B and C for it, the plan still paused A, and nothing ran;
    a window later B and C resumed, then the guard struck again: the GPU idled every other
    window. Now a forced request the plan pauses anyway pauses nobody: B and C run every step.
    Control: the guard still fires (its decisions say ``starvation``) and A stays paused."""
    session, w = _never_runnable(("A", 16 * 45))
    idle, reasons = 0, []
    for _ in range(30):
        reasons += [d.reason for d in w.report()]
        idle += not session.status().running
    assert idle == 0 and any("starvation" in r for r in reasons), (idle, reasons)
    assert session.status().paused == ("A",) and set(session.status().running) == {"B", "C"}


def test_requests_that_cannot_run_do_not_hold_the_runnable_ones_paused() -> None:
    """Scenario (control-plane review, session 77): two requests that cannot run even alone head
    the paused queue. Once B and C were paused for one of them, every resume attempt tried the
    other first, stopped at its refusal, and B and C stayed paused for good with nothing
    running. Now B and C run at the end of 200 steps and nothing idles past a window."""
    session, w = _never_runnable(("A1", 16 * 45), ("A2", 16 * 44))
    idle_run = longest = 0
    for _ in range(200):
        w.report()
        idle_run = 0 if session.status().running else idle_run + 1
        longest = max(longest, idle_run)
    assert set(session.status().running) == {"B", "C"} and longest <= 4, (session.status(), longest)


def test_a_resume_refused_while_nothing_runs_does_not_stop_the_next() -> None:
    """The resume loop's rule, on the decision builder with the session's own snapshot: with
    nothing running, a candidate the planner refuses (A1, A2: they cannot run even alone) is
    skipped, not the end of the attempts, so B and C resume behind them. Control: with B
    running, A1's refusal still ends the attempts (longest-paused first): C stays paused."""
    from controlplane.controller.decision_builder import DecisionBuilder

    session, w = _never_runnable(("A1", 16 * 45), ("A2", 16 * 44))
    w.report()
    inp = session._snapshot(session._policy_source(), ("finish",), True)  # noqa: SLF001 - the real input
    views = {v.id: dataclasses.replace(v, paused=True, paused_steps=1) for v in (*inp.paused, *inp.running)}
    order = ("A1", "A2", "B", "C")  # the oldest first, as the tracker keeps them
    idle = dataclasses.replace(inp, running=(), paused=tuple(views[r] for r in order))
    d = DecisionBuilder(Planner(use_mip=False)).build(idle)
    assert set(d.resume) == {"B", "C"} and set(d.plan.placements) == {"B", "C"}, d
    busy = dataclasses.replace(inp, running=(dataclasses.replace(views["B"], paused=False, paused_steps=0),),
                               paused=tuple(views[r] for r in ("A1", "A2", "C")))
    d = DecisionBuilder(Planner(use_mip=False)).build(busy)
    assert d.resume == () and set(d.plan.placements) == {"B"}, d
