"""A pause or resume the worker does not apply lapses: its own flag stands.

The data plane drops some pauses for good (``sglang_ext/pause.py``: ``would_idle``, penalties
under the overlap loop; custom logit processors and speculative decoding are never paused). The
controller awaited the worker's flag forever: it counted the request paused while it decoded,
planned the others without its KV, and the starvation guard 'resumed' a running request
(control-plane review, session 78). A decision is now outstanding until the worker shows it or
until ``APPLY_SLACK_STEPS`` after its due step. Real SessionController, FCFS, Planner and CBC.
"""

from __future__ import annotations

import threading

import pytest

from controlplane.api import Decision
from controlplane.controller import SessionController
from controlplane.controller.request_tracker import APPLY_SLACK_STEPS, HOLD_STEPS
from controlplane.planner import Planner
from controlplane.policy import Policy
from controlplane.policy_store import PolicyStore
from tests.controlplane.test_controller_harness import WorkerLoop, worker_info


class Worker(WorkerLoop):
    """Drops the pauses of ``unpausable`` (it keeps decoding) and applies the rest ``late`` reports
    after it receives them (SGLang's overlap loop: a batch ahead)."""

    unpausable: frozenset[str] = frozenset()
    late: int = 0
    reports_drops: bool = False
    """Names the dropped pauses in its next report (the plugin's ``StepReporter`` does)."""
    _held: list[tuple[int, Decision]]

    def apply(self, decisions: list[Decision]) -> None:
        held = self.__dict__.setdefault("_held", [])
        held += [(self.step + self.late, d) for d in decisions]
        due = [d for at, d in held if at <= self.step]
        self._held = [(at, d) for at, d in held if at > self.step]
        super().apply(due)
        if self.reports_drops:
            self.dropped += sorted(self.paused & self.unpausable)
        self.paused -= self.unpausable


def make(sync: bool = True) -> tuple[SessionController, Worker]:
    # victim rule 'largest' (the default before session 89): 'a' is the plan's victim; under
    # lost-first (the default) no request here is lost, and the guard would not force one in
    store = PolicyStore(Policy.from_dict({"window_min": 4, "window_max": 8, "slo_tbt_ms": 8.0,
                                          "max_paused_steps": 30, "victim_rule": "largest"}))
    s = SessionController(worker_info(budget_blocks=48, h2d_gbps=1.0, scheduler="fcfs"),
                          policy_source=store.get, synchronous=sync,
                          planner=Planner(use_mip=False, exact_search=False), time_budget_ms=60_000)
    w = Worker(s)
    w.add("a", 700)  # runs alone, not beside 'b': the plan pauses it (victim rule 'largest')
    w.add("b", 300)
    return s, w


def report(s: SessionController, w: Worker, sync: bool) -> list[Decision]:
    if not sync:
        assert s.flush()
    return w.report()


@pytest.mark.parametrize("sync", [True, False])
def test_a_dropped_pause_lapses_and_the_request_is_held_running(sync: bool) -> None:
    """The worker keeps 'a' decoding; within the slack after the pause was due the controller
    counts it running again (a batch change) and holds it running: the plan pauses 'b' in its
    place. Planned again as the victim at once, 'a' was paused (and its pause dropped) every third
    step for as long as it decoded (session 79). The hold doubles with each lapse."""
    s, w = make(sync)
    w.unpausable = frozenset({"a"})
    pauses: list[int] = []  # due steps of the decisions pausing 'a'
    lapse_triggers: tuple[str, ...] = ()
    agree = 0
    for _ in range(30 + 2 * HOLD_STEPS):
        out = report(s, w, sync)
        if pauses and w.step == pauses[0] + APPLY_SLACK_STEPS + 1:
            lapse_triggers = s.status().last_triggers
        pauses += [d.apply_at_step for d in out if "a" in d.pause]
        agree += w.paused == {"b"} and s.status().paused == ("b",)
    assert "batch-change" in lapse_triggers or not sync
    # paused once, held HOLD_STEPS, paused again (dropped again), held 2 * HOLD_STEPS
    assert len(pauses) == 2, pauses  # the old tracker: 'a' paused every third step
    assert pauses[1] - pauses[0] >= HOLD_STEPS, pauses
    assert agree >= 2 * HOLD_STEPS  # 'b' paused in its place, and the controller knows it
    s.close()


@pytest.mark.parametrize("sync", [True, False])
def test_a_pause_reported_dropped_counts_as_running_at_once(sync: bool) -> None:
    """A worker that names its dropped pauses (the plugin does, ``StepReport.pauses_dropped``):
    the report of the step the pause was due for makes 'a' running and held, and 'b' is paused in
    its place by that report's plan, without waiting out the slack. Control: unnamed, the
    controller still counts 'a' paused at that report."""
    for named in (True, False):
        s, w = make(sync)
        w.unpausable, w.reports_drops = frozenset({"a"}), named
        due = None
        for _ in range(8):
            out = report(s, w, sync)
            if due is None and any("a" in d.pause for d in out):
                due = w.step + 1
            if due is not None and w.step == due:
                break
        assert due is not None and w.step == due
        assert ("a" in s.status().paused) is not named
        if named:
            assert s._tracker.held(w.step + 1) == {"a"}
            if not sync:
                assert s.flush()
                w.report()
            assert w.paused == {"b"} and s.status().paused == ("b",)
        s.close()


def test_a_held_request_that_cannot_run_even_alone_pauses_nobody_for_it() -> None:
    """Held, but too large to run even alone: keeping it would pause every other request for
    nothing; it is planned as the planner decides (the others keep running)."""
    s, w = make()
    w.unpausable = frozenset({"a"})
    for _ in range(4):
        w.report()
    assert s._tracker.held(w.step + 1) == {"a"}
    w.ctx["a"] = 48 * 16 * 8  # grows far past what its SLO lets it fetch
    w.finish("b")
    w.add("c", 300)
    for _ in range(3):
        w.report()
    assert "c" not in w.paused and "c" not in s.status().paused
    s.close()


@pytest.mark.parametrize("sync", [True, False])
def test_control_a_pause_applied_late_by_the_overlap_loop_does_not_lapse(sync: bool) -> None:
    """Shown within the slack after the step the decision reached the worker for (async: a
    report after it was planned): once paused, 'a' stays paused in the controller's state (it
    never flips back to running and is paused again)."""
    s, w = make(sync)
    w.late = APPLY_SLACK_STEPS + 1  # shown at the report of due + late: the last report the slack waits for
    seen: list[bool] = []
    for _ in range(16):
        report(s, w, sync)
        if not sync:
            assert s.flush()  # the plan in flight is applied before the state is read
        seen.append("a" in s.status().paused)
    assert "a" in w.paused and seen[-1]
    assert seen == sorted(seen), seen  # False ... False, True ... True
    s.close()


def test_a_resume_the_worker_does_not_apply_lapses_to_paused() -> None:
    """The other way: a resumed request the worker keeps parked counts as paused again (here
    nothing else runs, so the next plan resumes it again; the old tracker counted it running)."""
    s, w = make()
    w.report()  # the plan pauses 'a' (it does not fit beside 'b')
    assert "a" in w.paused
    w.finish("b")  # room: the next plan resumes 'a'
    out = w.report()
    assert [d.resume for d in out] == [("a",)]
    w.paused.add("a")  # ... which the worker does not apply
    for _ in range(APPLY_SLACK_STEPS + 1):  # up to the due step + the slack: still awaited
        w.report()
        assert s.status().paused == ()
    out = w.report()  # it counts as paused again: a batch change, whose plan resumes it again
    assert "batch-change" in s.status().last_triggers
    assert [d.resume for d in out] == [("a",)]  # only a paused request can be resumed
    s.close()


def test_control_a_plan_delivered_reports_after_it_was_made_is_due_from_its_delivery() -> None:
    """Async: the plan pausing 'a' is made while the worker goes on for three reports (the planner
    held), and reaches it with the fourth; the worker shows it a report after the step it was
    told (the overlap loop). Due from the decision's making, it lapsed on delivery."""
    release = threading.Event()

    class Held(Planner):
        def plan(self, batch, **kwargs):  # type: ignore[no-untyped-def,override]
            release.wait(30)
            return super().plan(batch, **kwargs)

    store = PolicyStore(Policy.from_dict({"window_min": 4, "window_max": 8, "slo_tbt_ms": 8.0}))
    s = SessionController(worker_info(budget_blocks=48, h2d_gbps=1.0, scheduler="fcfs"),
                          policy_source=store.get, synchronous=False,
                          planner=Held(use_mip=False, exact_search=False), time_budget_ms=60_000)
    w = Worker(s)
    w.late = APPLY_SLACK_STEPS
    w.add("a", 700)
    w.add("b", 300)
    for _ in range(3):
        assert w.report() == []  # planning (held)
    release.set()
    assert s.flush()
    assert s.status().paused == ("a",)
    out = w.report()
    assert [d.pause for d in out] == [("a",)]
    for _ in range(2 * APPLY_SLACK_STEPS + 2):
        w.report()
        assert s.status().paused == ("a",), w.step  # never counted running in between
    assert "a" in w.paused
    s.close()


def test_a_pause_applied_again_restarts_the_hold_from_its_first_length() -> None:
    """One dropped pause holds 'a' for HOLD_STEPS; once the worker applies a pause of 'a' again,
    its next drop (a passing reason, such as would_idle) holds it HOLD_STEPS again, not twice as
    long (the first version doubled it up to HOLD_MAX_STEPS, review of session 79)."""
    s, w = make(True)
    w.reports_drops, w.unpausable = True, frozenset({"a"})
    while not s._tracker._holds:
        w.report()
    assert s._tracker._holds["a"][0] == 1
    w.unpausable = frozenset()  # its pauses apply again
    while "a" not in w.paused:
        w.report()
    w.report()
    assert "a" not in s._tracker._holds
    w.finish("b")
    while "a" in w.paused:
        w.report()  # resumed on the finish
    w.add("c", 300)
    w.unpausable = frozenset({"a"})
    while "a" not in s._tracker._holds:
        w.report()
    lapses, until = s._tracker._holds["a"]
    assert lapses == 1 and until - w.step == HOLD_STEPS
    s.close()
