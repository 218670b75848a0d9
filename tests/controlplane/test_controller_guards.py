"""The controller's guards against what a worker reports (control-plane review, session 54): a
profile of absurd layer times cannot buy a minutes-long plan, and one outlier step does not move
the profile."""

from __future__ import annotations

import dataclasses

import pytest

from controlplane.controller import SessionController
from controlplane.model import Profile
from controlplane.planner import Planner
from controlplane.policy import Policy
from controlplane.policy_store import PolicyStore
from tests.controlplane.test_controller import FIXED_WINDOW, TIGHT_SLO, make
from tests.controlplane.test_controller_harness import MODEL, PROFILE, WorkerLoop, worker_info


def test_the_plan_budget_is_capped_whatever_the_profile_claims() -> None:
    """A profile of 5-second layers makes the predicted step minutes long; a quarter of it was
    the plan's search budget (100 s: control-plane review, session 54). It is capped at
    MAX_PLAN_BUDGET_MS; control: an ordinary profile keeps its fraction of the step."""
    from controlplane.controller.decision_builder import MAX_PLAN_BUDGET_MS

    budgets: list[float | None] = []

    class Recording(Planner):
        def plan(self, batch, *, time_budget_ms=None, **kwargs):  # type: ignore[no-untyped-def,override]
            budgets.append(time_budget_ms)
            return super().plan(batch, time_budget_ms=0.0, **kwargs)

    for layer_ms in (5000.0, 0.5):
        info = dataclasses.replace(worker_info(), profile=Profile(layer_compute_ms=(layer_ms,) * MODEL.layers))
        session = SessionController(info, policy_source=PolicyStore(Policy.from_dict(FIXED_WINDOW)).get,
                                    planner=Recording(), synchronous=True)
        w = WorkerLoop(session)
        w.add("a", 100)
        assert w.report()
    assert budgets[0] == MAX_PLAN_BUDGET_MS
    assert budgets[1] is not None and 0 < budgets[1] < MAX_PLAN_BUDGET_MS


def test_one_outlier_step_does_not_move_the_profile_but_two_do() -> None:
    """A step observed 6x slower than predicted (a GC pause, a preemption) is held: the profile
    and the placements stay. A second such report in a row is a real change and moves it; an
    ordinary report between two outliers clears the first (control-plane review, session 54)."""
    session, w, store = make(PolicyStore(Policy.from_dict(TIGHT_SLO)))
    a = store.get().ewma_factor
    w.add("a", 100)
    w.report()
    assert w.report(observed_step_ms=24.0) == []  # predicted 4.0: 6x, held
    assert session.status().layer_compute_ms == PROFILE.layer_compute_ms
    w.report(observed_step_ms=4.0)  # an ordinary step clears it
    assert w.report(observed_step_ms=24.0) == []
    assert session.status().layer_compute_ms == PROFILE.layer_compute_ms
    w.report(observed_step_ms=24.0)  # slower again: the profile follows (all on the GPU: no
    # re-plan could change the plan, as the cap counts the SLO from the all-GPU step)
    assert session.status().layer_compute_ms == pytest.approx(((1 - a) + a * 6.0,) * 4)
