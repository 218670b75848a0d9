"""Controller properties over random arrivals/finishes (hypothesis, real planner), and LVF rotation."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controlplane.controller import SessionController
from controlplane.planner import Planner
from controlplane.policy import Policy
from tests.controlplane.test_controller_harness import WorkerLoop, worker_info

MAX_PAUSED = 4
BUDGET = 24
"""Blocks per layer-slot budget: any single request fits alone (<= 280 + 60 tokens -> 22 blocks)."""

ops = st.lists(
    st.one_of(
        st.tuples(st.just("arrive"), st.integers(16, 280)),
        st.tuples(st.just("arrive"), st.integers(120, 280)),
        st.tuples(st.just("finish"), st.integers(0, 7)),
        st.tuples(st.just("step"), st.integers(1, 3)),
    ),
    min_size=1,
    max_size=16,
)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seq=ops, rule=st.sampled_from(["largest", "longest", "shortest", "random"]))
def test_pause_resume_invariants(seq: list[tuple[str, int]], rule: str) -> None:
    """Decisions never place a paused request, resume only into feasible plans that include it,
    keep controller and worker pause state equal, place every running request on a batch change;
    the starvation guard resumes the longest-waiting starving request and bounds every pause
    (every request fits alone in this budget)."""
    policy = Policy.from_dict(
        {"window_min": 2, "window_max": 2, "victim_rule": rule, "max_paused_steps": MAX_PAUSED}
    )
    session = SessionController(
        worker_info(budget_blocks=30),
        policy_source=lambda: policy,
        planner=Planner(),
        synchronous=True,
    )
    w = WorkerLoop(session)
    n = 0
    for op, arg in seq:
        if op == "arrive":
            w.add(f"r{n}", arg)
            n += 1
            reports = 1
        elif op == "finish":
            live = sorted(w.ctx)
            if live:
                w.finish(live[arg % len(live)])
            reports = 1
        else:
            reports = arg
        for _ in range(reports):
            before = len(w.decisions)
            waiting = {  # paused requests still alive (a paused request may just have finished)
                rid: w.step + 1 - session._tracker.get(rid).paused_since_step  # type: ignore[union-attr]  # noqa: SLF001
                for rid in session.status().paused
                if rid in w.ctx
            }
            starving = sorted((-k, rid) for rid, k in waiting.items() if k >= MAX_PAUSED)
            w.report()
            for d in w.decisions[before:]:
                if "starvation" in d.reason:
                    assert starving[0][1] in d.resume  # the longest-waiting one runs (FIFO)
                placed = set(d.plan.placements)
                assert not placed & set(d.pause)
                assert set(d.resume) <= placed
                if d.resume:
                    assert d.plan.feasible
                if "batch-change" in d.reason or d.reason == "initial":
                    assert placed == set(w.ctx) - w.paused
            st_ = session.status()
            assert set(st_.paused) == w.paused
            assert set(st_.running) == set(w.ctx) - w.paused
            for rid in st_.paused:
                tracked = session._tracker.get(rid)  # noqa: SLF001 - white-box bound check
                assert tracked is not None and tracked.paused_since_step is not None
                # Starving requests are served one per firing (every window_min = 2 steps).
                assert w.step - tracked.paused_since_step <= MAX_PAUSED + 2 * n + 2
            for rid in w.ctx:
                dep = session.deposit(rid)
                assert dep is not None and dep.balance == dep.generated - dep.delivered >= 0


def _lvf_session(budget_blocks: int) -> tuple[SessionController, WorkerLoop]:
    policy = Policy.from_dict(
        {
            "window_min": 4,
            "window_max": 4,
            "slo_tbt_ms": 1000.0,
            "scheduler": "lvf",
            "lvf": {
                "alpha": 1.0,
                "beta_b": 0.0,
                "beta_f": 0.0,
                "transfer_budget_blocks": budget_blocks,
            },
        }
    )
    session = SessionController(
        worker_info(budget_blocks=36),
        policy_source=lambda: policy,
        planner=Planner(),
        synchronous=True,
    )
    w = WorkerLoop(session)
    w.add("A", 320)
    w.add("B", 160)
    w.add("C", 96)
    w.free_gpu_blocks = 0
    return session, w


def test_lvf_rotates_lagging_paused_request_in() -> None:
    """Under LVF a paused request whose lag grows is rotated in; running ones are rotated out."""
    session, w = _lvf_session(budget_blocks=1000)
    (d,) = w.report()
    assert d.pause == ("A",)  # the planner's victim: does not fit with B and C
    (d,) = w.report()  # A now lags: VLT = now - t_last > 0 -> prioritized, B_swap = blk(A)
    assert d.reason == "schedule"
    assert d.resume == ("A",) and "A" in d.plan.placements
    assert set(d.pause) and set(d.pause) <= {"B", "C"}
    assert set(session.status().paused) == set(d.pause)


def test_lvf_transfer_budget_blocks_rotation() -> None:
    """A rotation that needs more blocks than B_HBM + B_xfer does not happen."""
    session, w = _lvf_session(budget_blocks=50)  # blk(A) = 21 blocks x 4 layers = 84 > 0 + 50
    w.report()
    for _ in range(3):
        assert w.report() == []
    assert session.status().paused == ("A",)
