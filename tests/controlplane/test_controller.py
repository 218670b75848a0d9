"""SessionController with the real planner (CBC): triggers, EWMA, pause/resume, starvation, async."""

from __future__ import annotations

import threading

import pytest
from prometheus_client import CollectorRegistry

from controlplane.api import InvalidArgument, QueuedRequest, RequestState, StepReport, Unavailable
from controlplane.controller import (
    ControllerCounters,
    FanOutObserver,
    PrometheusObserver,
    SessionController,
)
from controlplane.model import Batch, Plan
from controlplane.planner import Planner
from controlplane.policy import Policy
from controlplane.policy_store import PolicyStore
from tests.controlplane.test_controller_harness import PROFILE, WorkerLoop, worker_info

# Fixed window so expiry and KV growth are predictable: Δ = 4 steps.
FIXED_WINDOW = {"window_min": 4, "window_max": 4, "slo_tbt_ms": 1000.0}


def make(
    store: PolicyStore | None = None,
    *,
    budget: int = 10_000,
    planner: object | None = None,
    synchronous: bool = True,
    observer: object | None = None,
    scheduler: str | None = None,
) -> tuple[SessionController, WorkerLoop, PolicyStore]:
    store = store or PolicyStore(Policy.from_dict(FIXED_WINDOW))
    session = SessionController(
        worker_info(budget, scheduler=scheduler),
        policy_source=store.get,
        planner=planner or Planner(),  # type: ignore[arg-type]
        synchronous=synchronous,
        observer=observer,  # type: ignore[arg-type]
    )
    return session, WorkerLoop(session), store


def test_first_report_plans_and_steady_steps_do_not() -> None:
    """The first report plans (initial); unchanged batches before expiry trigger nothing."""
    session, w, _ = make()
    w.add("a", 100)
    (d,) = w.report()
    assert d.reason == "initial" and d.apply_at_step == 2 and d.plan.feasible
    assert set(d.plan.placements) == {"a"}
    assert d.expiry_step == d.plan.expiry_step
    for _ in range(d.expiry_step - w.step - 1):
        assert w.report() == []
        assert session.status().last_triggers == ()


def test_expiry_fires_exactly_at_expiry_step() -> None:
    """A re-plan fires at the first report whose step reaches the plan's expiry step, not before."""
    _, w, _ = make()
    w.add("a", 100)
    (d,) = w.report()
    while w.step + 1 < d.expiry_step:
        assert w.report() == []
    (d2,) = w.report()
    assert w.step == d.expiry_step and d2.reason == "expiry"
    assert d2.expiry_step > d.expiry_step


def test_arrival_and_finish_are_batch_changes() -> None:
    """An arrival or a finish triggers a batch-change re-plan at that very report."""
    _, w, _ = make()
    w.add("a", 100)
    w.report()
    w.add("b", 50)
    (d,) = w.report()
    assert d.reason == "batch-change" and set(d.plan.placements) == {"a", "b"}
    w.finish("a")
    (d,) = w.report()
    assert d.reason == "batch-change" and set(d.plan.placements) == {"b"}


def test_worker_made_pause_is_a_batch_change() -> None:
    """A pause the worker made on its own (flag flips without a decision) triggers a re-plan."""
    session, w, _ = make()
    w.add("a", 100)
    w.add("b", 100)
    w.report()
    w.paused.add("b")
    (d,) = w.report()
    assert d.reason == "batch-change" and set(d.plan.placements) == {"a"}
    assert session.status().paused == ("b",)


TIGHT_SLO = {**FIXED_WINDOW, "slo_tbt_ms": 4.2}
"""All-GPU step 4.0 ms under PROFILE: a profile update that slows it misses this SLO."""


def test_mismatch_above_threshold_updates_profile_by_ewma() -> None:
    """|obs - pred| / pred > threshold re-plans and moves each layer by comp = (1-a)*comp + a*sample."""
    session, w, store = make(PolicyStore(Policy.from_dict(TIGHT_SLO)))
    policy = store.get()
    w.add("a", 100)
    w.report()
    predicted = sum(PROFILE.layer_compute_ms)  # everything fits on the GPU: no transfers
    sample = (2.0, 1.0, 1.5, 1.0)
    observed = predicted * (1 + policy.mismatch_threshold + 0.05)
    w.queued.append(QueuedRequest(id="q", prompt_tokens=50, arrival_ms=0.0))  # so that it re-plans
    (d,) = w.report(observed_step_ms=observed, layer_compute_ms=sample)
    assert "profile-mismatch" in d.reason
    a = policy.ewma_factor
    expect = tuple(
        (1 - a) * c + a * s for c, s in zip(PROFILE.layer_compute_ms, sample, strict=True)
    )
    assert session.status().layer_compute_ms == pytest.approx(expect)
    assert session.status().h2d_gbps == 100.0  # nothing crossed the link: no bandwidth evidence


def test_mismatch_below_threshold_changes_nothing() -> None:
    """An observation within the threshold neither re-plans nor touches the profile."""
    session, w, store = make()
    w.add("a", 100)
    w.report()
    observed = sum(PROFILE.layer_compute_ms) * (1 + store.get().mismatch_threshold - 0.05)
    assert w.report(observed_step_ms=observed, layer_compute_ms=(9.0, 9.0, 9.0, 9.0)) == []
    assert session.status().layer_compute_ms == PROFILE.layer_compute_ms


def test_mismatch_without_samples_scales_the_profile() -> None:
    """Without samples the EWMA target is the profile scaled by observed / predicted."""
    session, w, store = make(PolicyStore(Policy.from_dict(TIGHT_SLO)))
    a = store.get().ewma_factor
    w.add("a", 100)
    w.report()
    w.queued.append(QueuedRequest(id="q", prompt_tokens=50, arrival_ms=0.0))  # so that it re-plans
    (d,) = w.report(observed_step_ms=8.0)  # predicted 4.0 -> scale 2
    assert "profile-mismatch" in d.reason
    assert session.status().layer_compute_ms == pytest.approx(((1 - a) + a * 2.0,) * 4)


def test_mismatch_in_an_all_gpu_steady_state_updates_the_profile_without_a_replan() -> None:
    """Everything on the GPU, nobody paused or queued, the refreshed all-GPU step within the SLO:
    the solver could only return the installed plan, so the profile moves but nothing re-plans."""
    session, w, store = make()  # SLO 1000 ms
    a = store.get().ewma_factor
    w.add("a", 100)
    (d,) = w.report()
    assert all(all(row) for row in d.plan.placements.values())
    w.report()  # the plan is installed
    assert w.report(observed_step_ms=8.0) == []
    assert session.status().layer_compute_ms == pytest.approx(((1 - a) + a * 2.0,) * 4)
    assert "profile-mismatch" not in session.status().last_triggers


def test_mismatch_past_the_slo_with_everything_on_the_gpu_does_not_replan() -> None:
    """SLO 5 ms, 4 layers of 1 ms: the refreshed all-GPU step (about 5.2 ms after an 8 ms
    observation) is past the SLO, but no plan is faster and the planner's cap counts the SLO from
    that step (slo_cap.cap_view): the solve would return the installed plan, so none runs (before
    the floor it re-planned at every such mismatch). Control: the same mismatch with a request
    queued re-plans."""
    store = PolicyStore(Policy.from_dict({**FIXED_WINDOW, "slo_tbt_ms": 5.0}))
    session, w, _ = make(store)
    w.add("a", 100)
    (d,) = w.report()
    assert all(all(row) for row in d.plan.placements.values()) and not d.plan.paused
    w.report()
    assert w.report(observed_step_ms=8.0) == []
    assert sum(session.status().layer_compute_ms) > 5.0
    assert "profile-mismatch" not in session.status().last_triggers
    w.queued.append(QueuedRequest(id="q", prompt_tokens=50, arrival_ms=0.0))
    (d,) = w.report(observed_step_ms=12.0)
    assert "profile-mismatch" in d.reason and not d.plan.paused


def test_mismatch_with_a_request_queued_still_replans() -> None:
    """A queued request (admission may depend on the step time) keeps the re-plan."""
    session, w, _ = make()
    w.add("a", 100)
    w.report()
    w.report()
    w.queued.append(QueuedRequest(id="q", prompt_tokens=50, arrival_ms=0.0))
    (d,) = w.report(observed_step_ms=8.0)
    assert "profile-mismatch" in d.reason


def test_policy_update_reaches_session_and_replans() -> None:
    """A policy update triggers a re-plan at the next report, made with the new version."""
    _, w, store = make()
    w.add("a", 100)
    w.report()
    store.update({"alpha": 0.5})
    (d,) = w.report()
    assert d.reason == "policy-change" and d.policy_version == 2


# Memory-tight batch: A=320, B=160, C=96 tokens (~21/11/7 blocks per layer after the window);
# fully offloaded each needs only its staging layer, so A+B (33) fit 36 blocks, all three (39) do not.
TIGHT = 36


def _tight(rule: str, **policy: object) -> tuple[SessionController, WorkerLoop, PolicyStore]:
    store = PolicyStore(Policy.from_dict({**FIXED_WINDOW, "victim_rule": rule, **policy}))
    session, w, store = make(store, budget=TIGHT)
    w.add("A", 320)
    w.add("B", 160)
    w.add("C", 96)
    return session, w, store


@pytest.mark.parametrize(("rule", "victim"), [("largest", "A"), ("shortest", "C")])
def test_infeasible_batch_pauses_victim_by_rule(rule: str, victim: str) -> None:
    """When the batch cannot fit, the decision pauses the victim the policy's rule names."""
    session, w, _ = _tight(rule)
    (d,) = w.report()
    assert d.pause == (victim,) and d.plan.paused == (victim,)
    assert victim not in d.plan.placements and d.plan.feasible
    assert session.status().paused == (victim,)


def test_paused_request_resumes_only_when_a_feasible_plan_includes_it() -> None:
    """A paused request stays paused across expiries while infeasible; a finish lets it back in."""
    session, w, _ = _tight("largest")
    (d,) = w.report()
    assert d.pause == ("A",)
    for _ in range(3 * 4):  # several windows: expiry re-plans try to resume A and must fail
        for dec in w.report():
            assert "A" not in dec.resume
    assert session.status().paused == ("A",)
    w.finish("C")
    (d,) = w.report()
    assert d.resume == ("A",) and "A" in d.plan.placements and d.plan.feasible
    assert session.status().paused == ()


def test_starvation_guard_resumes_and_pauses_another_victim() -> None:
    """After max_paused_steps a paused request is resumed even if another must be paused for it."""
    session, w, _ = _tight("largest", max_paused_steps=3)
    (d,) = w.report()
    assert d.pause == ("A",)
    seen = []
    for _ in range(4):
        seen += w.report()
    guard = [d for d in seen if "A" in d.resume]
    assert guard, "the starvation guard never resumed A"
    g = guard[0]
    assert "starvation" in g.reason
    assert g.pause == ("B",)  # the largest of the others; A + C fit
    assert "A" in g.plan.placements and g.plan.feasible
    assert session.status().paused == ("B",)


def test_deposit_accounting_reaches_the_planner() -> None:
    """Each request's deposit balance (generated minus delivered) is what the planner receives."""
    batches: list[Batch] = []

    class Recording:
        """The real planner, recording its inputs."""

        def __init__(self) -> None:
            self.inner = Planner()

        def plan(self, batch: Batch, **kw: object) -> Plan:
            batches.append(batch)
            return self.inner.plan(batch, **kw)  # type: ignore[arg-type]

    session, w, _ = make(planner=Recording())
    w.add("a", 100)
    for _ in range(6):
        w.report()  # one token per 10 ms, delivered one per 1000 ms -> the deposit grows
    dep = session.deposit("a")
    # First seen with 2 tokens (already delivered by the worker), then 5 more held by the deposit.
    assert dep is not None and dep.generated == 7 and dep.delivered == 2 and dep.balance == 5
    w.add("b", 10)
    w.report()
    spec = {r.id: r for r in batches[-1].requests}
    assert spec["a"].deposit_tokens == session.deposit("a").balance  # type: ignore[union-attr]
    assert spec["a"].context_tokens == w.ctx["a"] + 1  # planned one step ahead


def test_a_request_near_its_output_limit_is_planned_for_its_remaining_growth_only() -> None:
    """The planner's ``b_r`` counts a request's KV growth over the decode window (OrbitFlow
    §3.3.1), capped at the tokens it still decodes: ``max_new_tokens`` less those generated, one
    step ahead. A short request under a budget that holds its remaining growth but not a whole
    window's keeps every layer on the GPU; control: the same request with no known limit is
    provisioned for the window and offloads."""
    layers = worker_info(1).model.layers
    outcome = {}
    for limit in (6, None):
        class Recording:
            def __init__(self) -> None:
                self.inner, self.batches = Planner(), []

            def plan(self, batch: Batch, **kw: object) -> Plan:
                self.batches.append(batch)
                return self.inner.plan(batch, **kw)  # type: ignore[arg-type]

        recording = Recording()

        # 102 tokens one step ahead: 7 blocks of 16 per layer; + 3 remaining: still 7; + a 64-step window: 11
        store = PolicyStore(Policy.from_dict({"window_min": 64, "window_max": 64, "slo_tbt_ms": 1000.0}))
        session, w, _ = make(store, budget=7 * layers + 2, planner=recording)
        w.add("a", 100, max_new_tokens=limit)
        (d,) = w.report()
        spec = recording.batches[-1].requests[0]
        assert spec.remaining_tokens == (None if limit is None else limit - w.gen["a"] - 1)
        outcome[limit] = d.plan.placements["a"].count(0) if "a" in d.plan.placements else None
    assert outcome[6] == 0, outcome  # all layers resident
    assert outcome[None] is not None and outcome[None] > 0, outcome  # offloaded without the limit


def test_fcfs_admission_is_not_repeated_while_queued() -> None:
    """A queued request is admitted once; it is not admitted again while still in the queue."""
    _, w, _ = make(scheduler="fcfs")
    w.auto_admit = False  # the worker lags: q1 stays in its queue for a while
    w.add("a", 100)
    w.report()
    w.queued.append(QueuedRequest("q1", prompt_tokens=64, arrival_ms=5.0))
    (d,) = w.report()
    assert d.admit == ("q1",) and d.reason == "schedule"
    for _ in range(5):
        assert all("q1" not in x.admit for x in w.report())


def test_invalid_reports_are_rejected_with_the_field() -> None:
    """Non-increasing steps or shrinking token counts raise InvalidArgument naming the field."""
    session, w, _ = make()
    w.add("a", 100)
    w.report()
    with pytest.raises(InvalidArgument, match="step"):
        session.report(StepReport(step=w.step, now_ms=w.now_ms + 1))
    with pytest.raises(InvalidArgument, match=r"running\[0\]\.generated_tokens"):
        session.report(
            StepReport(step=w.step + 1, now_ms=w.now_ms + 1, running=(RequestState("a", 200, 0),))
        )
    with pytest.raises(InvalidArgument, match="layer_compute_ms"):
        session.report(StepReport(step=w.step + 2, now_ms=w.now_ms + 2, layer_compute_ms=(1.0,)))
    session.close()
    with pytest.raises(Unavailable):
        session.report(StepReport(step=w.step + 3, now_ms=w.now_ms + 3))


def test_unknown_worker_scheduler_is_rejected_at_open() -> None:
    """WorkerInfo.scheduler is validated when the session is created."""
    with pytest.raises(InvalidArgument, match=r"worker\.scheduler: 'edf'"):
        SessionController(worker_info(scheduler="edf"), planner=Planner())


class GatedPlanner:
    """The real planner behind a gate the test opens (to make planning observably slow)."""

    def __init__(self) -> None:
        self.inner = Planner()
        self.gate = threading.Event()
        self.calls = 0

    def plan(self, batch: Batch, **kw: object) -> Plan:
        self.calls += 1
        if not self.gate.wait(30):
            raise TimeoutError("gate never opened")
        return self.inner.plan(batch, **kw)  # type: ignore[arg-type]


def test_async_report_never_waits_for_the_planner() -> None:
    """In async mode report() returns at once while planning is blocked; a later report delivers."""
    planner = GatedPlanner()
    session, w, _ = make(planner=planner, synchronous=False)
    try:
        w.add("a", 100)
        assert w.report() == []  # returned although the planner is blocked on its gate
        w.add("b", 100)  # a second trigger while the first plan is in flight: coalesced
        assert w.report() == []
        assert session.status().planning
        planner.gate.set()
        assert session.flush(30)
        out = w.report()
        assert [d.reason for d in out] == ["initial", "batch-change"]
        assert all(d.apply_at_step == w.step + 1 for d in out)
        assert set(out[-1].plan.placements) == {"a", "b"}
        assert planner.calls == 2
    finally:
        session.close()


def test_async_poll_returns_decisions_between_reports() -> None:
    """poll() hands out a decision finished after the last report."""
    session, w, _ = make(synchronous=False)
    try:
        w.add("a", 100)
        w.report()
        assert session.flush(30)
        (d,) = session.poll()
        assert d.apply_at_step == w.step + 1 and session.poll() == []
    finally:
        session.close()


def test_observers_count_plans_pauses_resumes() -> None:
    """Counters and Prometheus metrics (on a passed-in registry) see plans, pauses and resumes."""
    counters = ControllerCounters()
    registry = CollectorRegistry()
    store = PolicyStore(Policy.from_dict({**FIXED_WINDOW, "victim_rule": "largest"}))
    session, w, _ = make(
        store, budget=TIGHT, observer=FanOutObserver([counters, PrometheusObserver(registry)])
    )
    w.add("A", 320)
    w.add("B", 160)
    w.add("C", 96)
    w.report()
    w.finish("C")
    w.report()
    snap = counters.snapshot()
    assert snap.plans == 2 and snap.pauses == 1 and snap.resumes == 1
    assert snap.triggers == {"initial": 1, "batch-change": 1}
    assert registry.get_sample_value("kvplane_pauses_total") == 1.0
    assert registry.get_sample_value("kvplane_resumes_total") == 1.0
    assert registry.get_sample_value("kvplane_plans_total", {"feasible": "true"}) == 2.0
    assert registry.get_sample_value("kvplane_plan_solve_seconds_count") == 2.0


def test_sync_mode_is_deterministic() -> None:
    """Sync sessions with a completing (clock-free) search make identical decisions for identical reports."""

    def run() -> list[tuple]:
        store = PolicyStore(
            Policy.from_dict({**FIXED_WINDOW, "victim_rule": "random", "max_paused_steps": 5})
        )
        session = SessionController(
            worker_info(budget_blocks=140, h2d_gbps=0.05),
            policy_source=store.get,
            planner=Planner(use_mip=False, exact_search=False),
            synchronous=True,
            time_budget_ms=60_000,
        )
        w = WorkerLoop(session)
        for i in range(10):
            w.add(f"r{i}", 100 + 37 * i)
        for i in range(12):
            if i == 6:
                w.finish("r3")
            w.report(observed_step_ms=4.0 + (i % 3))
        return [
            (d.reason, d.pause, d.resume, d.plan.placements, d.expiry_step) for d in w.decisions
        ]

    first = run()
    assert any(d[1] for d in first), "scenario should pause someone"
    assert any(0 in row for d in first for row in d[3].values()), (
        "scenario should offload some layers"
    )
    assert run() == first


def test_failing_observer_never_breaks_planning() -> None:
    """An observer that raises is logged and ignored; decisions still flow."""

    class Broken(ControllerCounters):
        def on_plan(self, worker_id: str, reason: str, solve_ms: float, feasible: bool) -> None:
            raise RuntimeError("exporter down")

    _, w, _ = make(observer=Broken())
    w.add("a", 100)
    (d,) = w.report()
    assert d.plan.feasible


def test_rejected_report_changes_nothing() -> None:
    """A report rejected for one bad request leaves every deposit and the step counter untouched."""
    session, w, _ = make()
    w.add("a", 100)
    w.add("b", 100)
    w.report()
    dep_a = session.deposit("a")
    assert dep_a is not None
    before = (dep_a.generated, dep_a.balance)
    bad = StepReport(
        step=w.step + 1,
        now_ms=w.now_ms + 10,
        running=(RequestState("a", 200, w.gen["a"] + 5), RequestState("b", 200, 0)),
    )
    with pytest.raises(InvalidArgument, match=r"running\[1\]\.generated_tokens"):
        session.report(bad)
    assert (dep_a.generated, dep_a.balance) == before
    w.report()  # the same step number is still accepted
    assert dep_a.generated == before[0] + 1

