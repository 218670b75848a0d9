"""The profile-mismatch check judges the batch the worker ran, not the controller's pause state.

In asynchronous mode a decision's pauses and resumes take effect in the controller's tracker when
the plan is made, while the worker still runs the old batch until the decision reaches it. The
check predicted the step from the tracker's batch: a step observed exactly as the model predicts
the batch that ran looked 27% slow, moved the profile and re-planned (control-plane review,
session 77). Real SessionController, real Planner and CBC, on the planning thread.
"""

from __future__ import annotations

import pytest

from controlplane.controller import SessionController
from controlplane.model import step_time_ms
from controlplane.policy import Policy
from controlplane.policy_store import PolicyStore
from tests.controlplane.test_controller_harness import MODEL, PROFILE, WorkerLoop, worker_info

POLICY = {"window_min": 50, "window_max": 50, "slo_tbt_ms": 5.3}
"""One 200-token request fits the SLO offloaded at 0.2 GB/s (5.06 ms); two do not."""


def ran_step_ms(session: SessionController, w: WorkerLoop) -> float:
    """The model's time of the step the worker runs next: its unpaused requests, one token longer,
    under the last decision it received (a request it does not place runs all-GPU)."""
    st = session.status()
    placements = w.decisions[-1].plan.placements
    run = [r for r in w.ctx if r not in w.paused]
    rows = [tuple(placements.get(r, (1,) * MODEL.layers)) for r in run]
    blocks = [-(-(w.ctx[r] + 1) // MODEL.block_size) for r in run]
    blocks_per_ms = st.h2d_gbps * 1e9 / MODEL.block_bytes / 1e3
    return step_time_ms(rows, blocks, list(st.layer_compute_ms), blocks_per_ms)


def paused_but_not_delivered(slow: float) -> tuple[SessionController, WorkerLoop, list]:
    """'a' runs offloaded; 'b' arrives; the plan pauses 'a' (tracker) and is delivered with the
    next report, whose step still ran both: observed ``slow`` x the model's time of that step."""
    store = PolicyStore(Policy.from_dict(POLICY))
    session = SessionController(worker_info(budget_blocks=40, h2d_gbps=0.2),
                                policy_source=store.get, synchronous=False)
    w = WorkerLoop(session)
    w.add("a", 200)
    w.report()
    assert session.flush()
    assert [d.plan.placements for d in w.report()] == [{"a": (0, 0, 0, 0)}]
    w.report(observed_step_ms=ran_step_ms(session, w))
    w.add("b", 200)
    w.report(observed_step_ms=ran_step_ms(session, w))
    assert session.flush()
    assert session.status().paused == ("a",) and not w.paused  # decided, not yet delivered
    out = w.report(observed_step_ms=slow * ran_step_ms(session, w))
    session.close()
    return session, w, out


def test_an_exact_step_of_the_batch_that_ran_moves_nothing() -> None:
    session, w, out = paused_but_not_delivered(1.0)
    assert [d.pause for d in out] == [("a",)]  # the pause reached the worker with this report
    st = session.status()
    assert st.layer_compute_ms == PROFILE.layer_compute_ms
    assert st.h2d_gbps == pytest.approx(0.2)
    assert "profile-mismatch" not in st.last_triggers


def test_control_a_slow_step_of_that_batch_moves_the_profile() -> None:
    """The check is live in that state: 1.5x the model's time is a mismatch."""
    session, w, out = paused_but_not_delivered(1.5)
    st = session.status()
    assert "profile-mismatch" in st.last_triggers
    assert st.layer_compute_ms != PROFILE.layer_compute_ms or st.h2d_gbps != pytest.approx(0.2)
