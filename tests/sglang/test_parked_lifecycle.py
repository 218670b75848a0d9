"""Parked (keep-KV paused) requests through SGLang's lifecycle calls and a control-plane outage
(scheduler review, session 54): ``sglang_ext/parked_lifecycle.py`` and the boundary's fallback.

The real :class:`~sglang_ext.pause.PauseManager`, :class:`~sglang_ext.step_boundary.StepBoundary`,
:class:`~sglang_ext.admission.AdmissionGate` and :class:`~sglang_ext.tp_sync.PlacementInstaller`
on the part of SGLang's batch they touch; the real server's retract-and-flush sequence is in
``test_pause_server.py``."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest

from controlplane.api import Decision
from controlplane.model import Plan
from sglang_ext import compat, parked_lifecycle
from sglang_ext.admission import AdmissionGate
from sglang_ext.decision_inbox import DecisionInbox
from sglang_ext.pause import PauseManager
from sglang_ext.step_boundary import StepBoundary
from sglang_ext.tp_sync import PlacementInstaller, StepInstall, TpSync
from tests.sglang.test_pause_drop_finished import _Batch as _SplitBatch
from tests.sglang.test_pause_finishing import _Req
from tests.sglang.test_scheduler_roles import FakeClient


@dataclass
class _Batch(_SplitBatch):
    """Also merges (a resume)."""

    model_config: Any = None
    forward_mode: Any = None

    def merge_batch(self, other: Any) -> None:
        self.reqs.extend(other.reqs)


@pytest.fixture(autouse=True)
def _fresh_sampling(monkeypatch):
    """A resume rebuilds the batch's sampling tensors through SGLang; these batches have none."""
    monkeypatch.setattr(compat, "SamplingBatchInfo", SimpleNamespace(
        from_schedule_batch=lambda batch, vocab: SimpleNamespace(penalizer_orchestrator=None)), raising=False)


def _req(rid: str) -> _Req:
    return _Req(rid, 1, None)


def _batch(*reqs: _Req) -> _Batch:
    return _Batch(list(reqs), sampling_info=SimpleNamespace(penalizer_orchestrator=None),
                  model_config=SimpleNamespace(vocab_size=8, is_encoder_decoder=False), forward_mode=SimpleNamespace(is_extend=lambda: False))


def _decision(**fields: Any) -> Decision:
    plan = Plan(True, (), fields.pop("placements", {}), 1.0, 8, 0, 0, "test", 0.0)
    return Decision(plan=plan, apply_at_step=0, expiry_step=10_000, **fields)


def _boundary(client: FakeClient, gate: bool = False) -> StepBoundary:
    return StepBoundary(tp=TpSync(0, 1), installer=PlacementInstaller(None, 4), pauser=PauseManager(),
                        admission=AdmissionGate(enabled=gate), inbox=DecisionInbox(), client=client,
                        pages_of=lambda r: (), keep_record=True)  # a stats line takes the records


@pytest.mark.parametrize("outage", [True, False], ids=["outage", "control-plane-up"])
def test_without_a_control_plane_nobody_stays_parked_and_no_deferred_pause_lands(outage):
    """A plan pauses ``p`` while it is still prefilling (deferred) and parks ``q``; then the control
    plane goes away. Nothing would resume ``q``, and ``p``'s pause would land with nobody left to
    undo it: in fallback the boundary resumes ``q`` and drops ``p``'s pause. Control: with the
    control plane up, ``q`` stays parked and ``p`` is parked once it decodes."""
    client = FakeClient()
    boundary = _boundary(client)
    q, p = _req("q"), _req("p")
    running = _batch(_req("a"), q)
    prefill = _batch(p)
    prefill.forward_mode = SimpleNamespace(is_extend=lambda: True)
    boundary.inbox.receive([_decision(pause=("p", "q"))])
    running = boundary.apply(running, prefill, 0)
    assert "q" in boundary.pauser and "p" in boundary.inbox.deferred_pause
    client.in_fallback = outage
    running.reqs.append(p)  # p's prefill is done: it decodes in the running batch
    for step in range(1, 40):  # steady load: the running batch is never empty
        running = boundary.apply(running, running, step)
    rids = {r.rid for r in running.reqs}
    if outage:
        assert len(boundary.pauser) == 0 and {"a", "p", "q"} <= rids
        assert not boundary.inbox.deferred_pause
    else:
        assert set(boundary.pauser.paused_ids) == {"p", "q"} and rids == {"a"}


@pytest.mark.parametrize("ending", [("a", "b"), ("a",), ()], ids=["all-ending", "one-of-two", "none"])
def test_parked_requests_resume_when_the_step_in_flight_ends_every_running_one(ending):
    """Under SGLang's overlap loop a running request whose in-flight step finishes it by length is
    dropped from the next batch; when that is every running request the boundary resumes the
    parked ones at once (before: the loop idled one iteration with no batch, and they were
    resumed a boundary later). Controls: one running request not ending, or none known to end,
    keeps them parked (the plan's pause stands)."""
    client = FakeClient()
    seen: list[list[str]] = []

    now: tuple[str, ...] = ()  # the step in flight at the first boundary ends nobody

    def in_flight(batch: Any) -> list:
        seen.append([r.rid for r in batch.reqs])
        return [r for r in batch.reqs if r.rid in now]

    boundary = StepBoundary(tp=TpSync(0, 1), installer=PlacementInstaller(None, 4), pauser=PauseManager(),
                            admission=AdmissionGate(enabled=False), inbox=DecisionInbox(), client=client,
                            pages_of=lambda r: (), finishing_in_flight=in_flight)
    running = _batch(_req("a"), _req("b"), _req("p"))
    boundary.inbox.receive([_decision(pause=("p",))])
    running = boundary.apply(running, running, 0)
    assert boundary.pauser.paused_ids == ("p",)
    boundary.take_record()
    now = ending
    running = boundary.apply(running, running, 1)
    rids = [r.rid for r in running.reqs]
    if ending == ("a", "b"):
        assert rids == ["a", "b", "p"] and len(boundary.pauser) == 0
        assert boundary.take_record()["resumed_now"] == ["p"]
    else:
        assert rids == ["a", "b"] and boundary.pauser.paused_ids == ("p",)
    assert seen == [["a", "b", "p"], ["a", "b"]]  # once a boundary, of the running batch only


def _pause_beside(ending: tuple[str, ...] | str, pause: tuple[str, ...], *, refill: bool = False,
                  resume_too: bool = False) -> tuple[StepBoundary, _Batch, dict]:
    """Running a and p (and q parked when ``resume_too``); the step in flight ends ``ending``
    (``"aborted"``: a was aborted); the plan pauses ``pause`` (and resumes q): one boundary -> (boundary, running batch, record)."""
    boundary = StepBoundary(tp=TpSync(0, 1), installer=PlacementInstaller(None, 4), pauser=PauseManager(),
                            admission=AdmissionGate(enabled=False), inbox=DecisionInbox(), client=FakeClient(),
                            pages_of=lambda r: (), keep_record=True,
                            finishing_in_flight=lambda batch: [r for r in batch.reqs if r.rid in in_flight])
    in_flight = () if ending == "aborted" else ending
    running = _batch(_req("a"), _req("p"))
    if ending == "aborted":
        running.reqs[0].to_finish = object()  # SGLang's FINISH_ABORT, applied at its next step
    if resume_too:
        running.reqs.append(_req("q"))
        boundary.inbox.receive([_decision(pause=("q",))])
        running = boundary.apply(running, running, 0)
        assert boundary.pauser.paused_ids == ("q",)
        boundary.take_record()
    last = _batch(_req("new")) if refill else running
    if refill:
        last.forward_mode = SimpleNamespace(is_extend=lambda: True)
    boundary.inbox.receive([_decision(pause=pause, resume=("q",) if resume_too else ())])
    running = boundary.apply(running, last, 1)
    return boundary, running, boundary.take_record()


@pytest.mark.parametrize("ending", [("a",), "aborted", ()],
                         ids=["the-other-ends-in-flight", "the-other-aborted", "control-none-ending"])
def test_a_pause_that_would_leave_nobody_running_is_skipped_as_would_idle(ending):
    """a ends in the step in flight (or was aborted: it ends in the next step) and the plan
    pauses p, the only other running request: paused, the batch would empty, and the idle rule
    would resume p at once (a write-back for nothing, a pause and a resume on one record). The
    pause is skipped (``would_idle``) and dropped, not deferred (a lone request could keep it
    waiting for its whole generation, every boundary a full one). Negative control (before the
    rule): the record read ``paused_now == resumed_now == ['p']``. Control: with nobody
    ending, p is parked."""
    boundary, running, record = _pause_beside(ending, ("p",))
    if ending:
        assert (record["paused_now"], record["resumed_now"]) == ([], [])
        assert record["pauses_skipped"] == {"would_idle": 1} and boundary.pauser.last_dropped == ["p"]
        assert [r.rid for r in running.reqs] == ["a", "p"] and not boundary.inbox.deferred_pause
        assert boundary.pauser.skipped == {"would_idle": 1}
    else:
        assert (record["paused_now"], record["resumed_now"], record["pauses_skipped"]) == (["p"], [], {})
        assert [r.rid for r in running.reqs] == ["a"] and boundary.pauser.paused_ids == ("p",)


def test_pausing_every_running_request_keeps_one_running():
    """The plan pauses both running requests, none ending: a is parked, p (the last) is kept
    running (``would_idle``) rather than both parked and resumed at once."""
    boundary, running, record = _pause_beside((), ("a", "p"))
    assert (record["paused_now"], record["resumed_now"]) == (["a"], [])
    assert record["pauses_skipped"] == {"would_idle": 1} and [r.rid for r in running.reqs] == ["p"]


@pytest.mark.parametrize("keeps", ["refill", "resume"])
def test_a_refill_or_a_resume_in_the_same_install_lets_the_last_running_request_pause(keeps):
    """Controls of the rule: a prefill batch that joins next (refill), or a parked request the same
    install resumes, keeps the next batch non-empty -- p is parked although a ends in flight."""
    boundary, running, record = _pause_beside(("a",), ("p",), refill=keeps == "refill",
                                              resume_too=keeps == "resume")
    assert record["paused_now"] == ["p"] and record["pauses_skipped"] == {}
    assert record["resumed_now"] == (["q"] if keeps == "resume" else [])
    assert boundary.pauser.paused_ids == ("p",)


def test_admits_are_remembered_only_while_the_gate_is_on():
    """The control plane sends ``admit`` under every scheduler; with the gate off nothing pruned
    them (a set entry per request served, for the life of the process). Control: the gate keeps
    them until the request leaves the queue."""
    off, on = AdmissionGate(enabled=False), AdmissionGate(enabled=True)
    for i in range(100):
        off.admit([f"r{i}"])
        on.admit([f"r{i}"])
    assert off.admitted == set() and len(on.admitted) == 100


@dataclass
class _Scheduler:
    running_batch: Any
    waiting_queue: list
    _kvplane: Any
    finishing: tuple = ()
    """Under the overlap loop: rids whose in-flight step finishes them (SGLang drops them first)."""
    chunked_req: Any = None

    def _reqs_finishing_inflight(self, batch: Any) -> list:
        return [r for r in batch.reqs if r.rid in self.finishing]


def _scheduler(*queued: str) -> _Scheduler:
    installer, pauser, tp = PlacementInstaller(None, 4), PauseManager(), TpSync(0, 1)
    boundary = StepBoundary(tp=tp, installer=installer, pauser=pauser, admission=AdmissionGate(enabled=False),
                            inbox=DecisionInbox(), client=FakeClient(), pages_of=lambda r: (),
                            keep_record=True)  # a stats line takes the records
    hooks = SimpleNamespace(pauser=pauser, installer=installer, metrics=None, tp=tp, prefill_adders={},
                            boundary=boundary)
    return _Scheduler(_batch(_req("a"), _req("b")), [SimpleNamespace(rid=r) for r in queued], hooks)


def _sglang_abort(scheduler: _Scheduler, recv_req: Any) -> str:
    """SGLang's abort of queued requests: popped from the queue, no batch."""
    scheduler.waiting_queue = [r for r in scheduler.waiting_queue
                               if not (recv_req.abort_all or r.rid.startswith(recv_req.rid))]
    return "aborted"


def test_a_request_aborted_while_queued_has_its_install_state_released():
    """Admitted with its prefill layers (the plan's ``min_gpu_layers``), then aborted in the queue:
    no step ever ends it, so its install state stayed for good. Control: the queued request not
    aborted keeps its state."""
    sched = _scheduler("r1", "r2")
    installer = sched._kvplane.installer
    installer.apply(StepInstall(step=1, prefill_layers={"r1": 2, "r2": 3}))
    assert set(installer.prefill_placements) == {"r1", "r2"}
    out = parked_lifecycle.around_abort(_sglang_abort, sched, SimpleNamespace(rid="r1", abort_all=False))
    assert out == "aborted" and set(installer.prefill_placements) == {"r2"}


def test_a_request_aborted_in_its_chunked_prefill_has_its_plan_bookkeeping_dropped():
    """Aborted mid chunked prefill: SGLang defers the teardown (``process_pending_chunked_abort``)
    and the request is never in a processed batch's finished list again, so its prefill placement
    stayed for good. It is forgotten at the abort; the pool is left to SGLang's own release
    (on_release), not released under the chunk in flight. Controls: another request's state stays,
    and an abort of some other rid leaves the chunked one's."""
    sched = _scheduler()
    sched.chunked_req = SimpleNamespace(rid="c1")
    installer = sched._kvplane.installer
    installer.apply(StepInstall(step=1, prefill_layers={"c1": 2, "r2": 3}))
    installer.gpu_layers("c1")
    parked_lifecycle.around_abort(_sglang_abort, sched, SimpleNamespace(rid="zz", abort_all=False))
    assert set(installer.prefill_placements) == {"c1", "r2"}
    parked_lifecycle.around_abort(_sglang_abort, sched, SimpleNamespace(rid="c1", abort_all=False))
    assert set(installer.prefill_placements) == {"r2"} and "c1" not in installer._bool_rows


def test_a_parked_request_is_resumed_into_an_abort_a_retract_and_counts_against_idle():
    sched = _scheduler()
    pauser = sched._kvplane.pauser
    assert pauser.pause(sched.running_batch, ["b"], step=1) == ["b"]
    seen: list[list[str]] = []

    def sglang(scheduler: Any, recv_req: Any) -> None:
        seen.append([r.rid for r in scheduler.running_batch.reqs])

    # idle: SGLang's answer, unless a request is parked
    assert parked_lifecycle.around_is_fully_idle(lambda s, **k: True, sched) is False
    assert parked_lifecycle.around_is_fully_idle(lambda s, **k: False, sched) is False
    # an in-place pause keeps the scheduler's state as it is: b stays parked (control)
    parked_lifecycle.around_pause_generation(sglang, sched, SimpleNamespace(mode="in_place"))
    assert seen[-1] == ["a"] and "b" in pauser
    # a retract takes what runs: b is merged back first
    assert sched._kvplane.boundary.take_record() == {}  # control: nothing resumed yet
    parked_lifecycle.around_pause_generation(sglang, sched, SimpleNamespace(mode="retract"))
    assert seen[-1] == ["a", "b"] and len(pauser) == 0
    # the next stats line lists the resume (it counted in the metrics, not on a boundary's record)
    assert sched._kvplane.boundary.take_record() == {"resumed_now": ["b"]}
    assert parked_lifecycle.around_is_fully_idle(lambda s, **k: True, sched) is True
    # an abort of a parked request resumes it first; another parked request stays (control)
    assert pauser.pause(sched.running_batch, ["a", "b"], step=2) == ["a", "b"]
    parked_lifecycle.around_abort(sglang, sched, SimpleNamespace(rid="a", abort_all=False))
    assert seen[-1] == ["a"] and pauser.paused_ids == ("b",)
    assert sched._kvplane.boundary.take_record() == {"resumed_now": ["a"]}


@pytest.mark.parametrize(("fits", "finishing"), [(False, ()), (True, ()), (False, ("a",))],
                         ids=["pool-full", "fits", "pool-full-one-finishing-in-flight"])
def test_when_the_next_decode_step_does_not_fit_parked_requests_join_the_retraction(fits, finishing):
    """SGLang retracts running requests (and aborts the last one left) when the KV pool cannot
    hold the next decode step; parked ones kept their slots out of its reach. Now they are merged
    into the batch first. Controls: when the step fits they stay parked; under the overlap loop,
    while a request's in-flight step finishes it SGLang skips a full step instead of retracting,
    and they stay parked too (review of session 54)."""
    sched = _scheduler()
    sched.finishing = finishing
    pauser = sched._kvplane.pauser
    assert pauser.pause(sched.running_batch, ["b"], step=1) == ["b"]
    batch = sched.running_batch
    batch.check_decode_mem = lambda: fits  # type: ignore[attr-defined]
    seen: list[list[str]] = []
    parked_lifecycle.around_update_running_batch(lambda s, b: seen.append([r.rid for r in b.reqs]), sched, batch)
    stays = fits or bool(finishing)
    assert seen == [["a"] if stays else ["a", "b"]]
    assert ("b" in pauser) is stays


def test_prefill_admission_reserves_the_parked_requests_decode_tokens_too():
    """SGLang's real ``PrefillAdder`` reserves ``min(max_new - output, CLIP) x new_token_ratio``
    tokens for each running request; the class the hook hands out reserves the parked ones' too,
    as if they still ran, and nothing more once they are resumed. Control: SGLang's own class
    (what the hook replaced) reserves the running request's only."""
    pytest.importorskip("sglang")
    from sglang.srt.managers.schedule_policy import PrefillAdder
    from sglang.srt.mem_cache.prefill_budget import PrefillBudget

    sched = _scheduler()
    a, b = sched.running_batch.reqs
    a.sampling_params.max_new_tokens, b.sampling_params.max_new_tokens = 101, 61  # 100 and 60 left
    for req in (a, b):
        req.sampling_params.ignore_eos = False
    allocator = SimpleNamespace(page_size=1)
    allocator.create_prefill_budget = lambda tree, num_mixed_decode_tokens=0: PrefillBudget(
        allocator, tree, num_mixed_decode_tokens=num_mixed_decode_tokens)
    tree = SimpleNamespace(supports_mamba=lambda: False, supports_prefix_sharing=lambda: True)

    def adder(cls: type) -> Any:
        return cls(1, tree, allocator, sched.running_batch, 0.5, 4096, 512)

    cls = parked_lifecycle.around_prefill_adder_class(lambda scheduler: PrefillAdder, sched)
    assert issubclass(cls, PrefillAdder)
    assert parked_lifecycle.around_prefill_adder_class(lambda scheduler: PrefillAdder, sched) is cls  # built once
    assert adder(cls).memory_budget.total_offset == (100 + 60) * 0.5  # nothing parked: SGLang's figure
    assert sched._kvplane.pauser.pause(sched.running_batch, ["b"], step=1) == ["b"]
    assert [r.rid for r in sched.running_batch.reqs] == ["a"]
    assert adder(cls).memory_budget.total_offset == (100 + 60) * 0.5
    assert adder(PrefillAdder).memory_budget.total_offset == 100 * 0.5  # the control: b's room was free
    sched.running_batch, _ = sched._kvplane.pauser.resume_all(sched.running_batch)
    assert adder(cls).memory_budget.total_offset == (100 + 60) * 0.5  # resumed: counted once
    no_kvplane = SimpleNamespace(_kvplane=None)
    assert parked_lifecycle.around_prefill_adder_class(lambda scheduler: PrefillAdder, no_kvplane) is PrefillAdder


class _Zero:
    """Any attribute is 0 and calling it gives 0 (the scheduler's stats and collaborators that
    ``get_loads`` reads besides the running batch)."""

    def __getattr__(self, name: str) -> Any:
        return 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self


def test_the_load_snapshot_counts_parked_requests_as_running(monkeypatch):
    """SGLang's real ``SchedulerLoadInquirer.get_loads`` (its collaborators stubbed to zeros) counts
    ``len(get_running_batch().reqs)``; after the hook a parked request is counted as running, and
    once resumed it is counted once. Control: the inquirer SGLang built (before the hook replaced
    it) leaves the parked request out. A scheduler without kvplane keeps SGLang's figure."""
    pytest.importorskip("sglang")
    import dataclasses

    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.managers.scheduler_components import load_inquirer

    monkeypatch.setattr(load_inquirer, "get_parallel", lambda: SimpleNamespace(dp_rank=0))
    monkeypatch.setattr(load_inquirer, "get_lora", lambda: SimpleNamespace(enable_lora=False))
    zero = _Zero()
    pool_stats = SimpleNamespace(get_pool_stats=lambda: SimpleNamespace(get_kv_token_stats=lambda: (0, 0.0)))
    fields = {f.name: zero for f in dataclasses.fields(load_inquirer.SchedulerLoadInquirer)}
    fields.update(disaggregation_mode=DisaggregationMode.NULL, max_total_num_tokens=4096, max_running_requests=8,
                  pool_stats_observer=pool_stats, spec_algorithm=SimpleNamespace(is_none=lambda: True),
                  get_waiting_queue=lambda: [], get_chunked_req=lambda: None, get_waiting_storage_span=None,
                  waiting_queue_prefix_matched=lambda: False, get_recent_cache_hit_rate=lambda: 0.0,
                  get_decode_moment_totals=lambda: (0, 0, 0))
    sched = _scheduler()

    def sglang_init(scheduler: Any) -> None:
        scheduler.load_inquirer = load_inquirer.SchedulerLoadInquirer(
            **{**fields, "get_running_batch": lambda: scheduler.running_batch})

    sched.load_inquirer = None
    sglang_init(sched)
    original = sched.load_inquirer
    parked_lifecycle.around_init_load_inquirer(sglang_init, sched)
    assert isinstance(sched.load_inquirer, load_inquirer.SchedulerLoadInquirer)
    assert sched.load_inquirer.get_loads().num_running_reqs == 2
    assert sched._kvplane.pauser.pause(sched.running_batch, ["b"], step=1) == ["b"]
    assert sched.load_inquirer.get_loads().num_running_reqs == 2
    assert original.get_loads().num_running_reqs == 1  # the control: SGLang's own leaves b out
    assert [r.rid for r in sched.running_batch.reqs] == ["a"]  # the view did not touch the batch
    sched.running_batch, _ = sched._kvplane.pauser.resume_all(sched.running_batch)
    assert sched.load_inquirer.get_loads().num_running_reqs == 2
    bare = SimpleNamespace(_kvplane=None, running_batch=sched.running_batch, load_inquirer=None)
    parked_lifecycle.around_init_load_inquirer(sglang_init, bare)
    assert bare.load_inquirer.get_loads().num_running_reqs == 2


class _OverlapScheduler:
    """The two fields SGLang's own ``_reqs_finishing_inflight`` reads, and that method itself
    (``compat.SCHEDULER_FINISHING_INFLIGHT``, resolved from SGLang, not restated)."""

    def __init__(self, overlap: bool, in_flight: list) -> None:
        from collections import deque

        from sglang_ext.compat.checker import resolve

        self.enable_skip_finishing_decode = overlap  # set by SGLang's event_loop_overlap only
        self.result_queue = deque([(SimpleNamespace(reqs=in_flight), None)])  # the step in flight
        self._reqs_finishing_inflight = resolve(compat.SCHEDULER_FINISHING_INFLIGHT.path).__get__(self)


@pytest.mark.parametrize("case", ["overlap", "control-normal-loop", "control-not-in-flight"])
def test_sglangs_own_in_flight_finishing_drives_the_resume_rule(case):
    """The wiring ``scheduler_hooks`` installs (``getattr(scheduler, "_reqs_finishing_inflight")``)
    with SGLang's real method and real ``Req`` objects: p is parked beside a; then the step in
    flight commits a's last token (``max_new_tokens``), so the next batch would be empty and the
    boundary resumes p at once. Controls: the normal loop (SGLang's method answers [] there), or
    a not in the step in flight -- p stays parked (negative control: no hook -> fails)."""
    from array import array

    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    a = Req("a", "", array("i", [1, 2, 3]), SamplingParams(max_new_tokens=4))
    a.output_ids = [5]
    p = Req("p", "", array("i", [1, 2, 3]), SamplingParams(max_new_tokens=64))
    p.output_ids = [5]
    scheduler = _OverlapScheduler(case != "control-normal-loop", [p] if case == "control-not-in-flight" else [a, p])
    boundary = StepBoundary(tp=TpSync(0, 1), installer=PlacementInstaller(None, 4), pauser=PauseManager(),
                            admission=AdmissionGate(enabled=False), inbox=DecisionInbox(), client=FakeClient(),
                            pages_of=lambda r: (), keep_record=True,
                            finishing_in_flight=getattr(scheduler, "_reqs_finishing_inflight", None))
    running = _batch(a, p)
    boundary.inbox.receive([_decision(pause=("p",))])
    running = boundary.apply(running, running, 0)
    assert boundary.take_record()["paused_now"] == ["p"]  # a has 3 tokens to go: it keeps the batch
    a.output_ids = [5, 6, 7]  # the step in flight commits the 4th: a finishes by length
    running = boundary.apply(running, running, 1)
    record = boundary.take_record()
    if case == "overlap":
        assert record["resumed_now"] == ["p"] and [r.rid for r in running.reqs] == ["a", "p"]
    else:
        assert record["resumed_now"] == [] and boundary.pauser.paused_ids == ("p",)
