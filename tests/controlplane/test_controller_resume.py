"""The controller's resume rule and batch limits (OrbitFlow §3.4, §5.1) with the real planner."""

from __future__ import annotations

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
    store = PolicyStore(Policy.from_dict({**FIXED_WINDOW, **policy}))
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
