"""SGLang's views of the requests in flight include the parked ones (scheduler audit, session 82).

Each runs SGLang 0.5.23's own method (its runtime-context getters stood in) with kvplane's hook
and without it (the control): a weight-version change's per-request events
(``Scheduler.collect_inflight_reqs``), the micro-batch cap of prefill admission
(``Scheduler.get_num_allocatable_reqs``), and the full-batch flag once a request that finished
while parked is dropped (``SchedulerHooks.end_step``).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from sglang_ext import parked_lifecycle
from sglang_ext.pause import PauseManager
from tests.sglang.test_parked_lifecycle import _batch, _fresh_sampling, _req  # noqa: F401 (a fixture)
from tests.sglang.test_pause_finishing import _Req

pytest.importorskip("sglang")

from sglang.srt.managers import scheduler as sglang_scheduler  # noqa: E402
from sglang.srt.managers.scheduler import Scheduler  # noqa: E402


class _HashedReq(_Req):
    """Hashed by identity, as SGLang's ``Req``."""

    __hash__ = object.__hash__
    __eq__ = object.__eq__


def _hooked(pauser: PauseManager, **attrs: Any) -> SimpleNamespace:
    return SimpleNamespace(_kvplane=SimpleNamespace(pauser=pauser), **attrs)


def _spans_after_a_weight_update(monkeypatch: pytest.MonkeyPatch, park: bool, hooked: bool) -> dict[str, list]:
    """Two requests with 5 tokens under v1; ``/update_weight_version`` to v2 (b parked or not);
    3 more tokens each under v2: each request's weight-version spans, as its finish reports them."""
    from sglang.srt.utils.weight_versions import compute_weight_version_spans

    state = {"weight_version": "v1"}
    monkeypatch.setattr(sglang_scheduler, "get_parallel", lambda: SimpleNamespace(pp_size=1))
    monkeypatch.setattr(sglang_scheduler, "get_serving", lambda: SimpleNamespace(weight_version=state["weight_version"]))
    monkeypatch.setattr(sglang_scheduler, "get_context",
                        lambda: SimpleNamespace(override=lambda source, **kw: state.update(kw)))
    a, b = _HashedReq("a", 5, 100), _HashedReq("b", 5, 100)
    for req in (a, b):
        req.weight_version_events = []
    pauser = PauseManager()
    sched = _hooked(pauser, running_batch=_batch(a, b), last_batch=None, waiting_queue=[], chunked_req=None,
                    hisparse_coordinator=None, enable_continuous_input_polling=False, result_queue=None)
    sched._collect_inflight_batches = lambda: Scheduler._collect_inflight_batches(sched)
    collect = Scheduler.collect_inflight_reqs
    sched.collect_inflight_reqs = (lambda: parked_lifecycle.around_collect_inflight_reqs(collect, sched)) if hooked \
        else (lambda: collect(sched))
    if park:
        assert pauser.pause(sched.running_batch, ["b"], step=1) == ["b"]
    Scheduler.record_weight_version_change(sched, new_version="v2")
    sched.running_batch, _ = pauser.resume_all(sched.running_batch)
    spans = {}
    for req in (a, b):
        req.output_ids += [0] * 3
        got = compute_weight_version_spans(req.weight_version_events, current_version="v2",
                                           num_output_tokens=len(req.output_ids))
        spans[req.rid] = [(s.version, s.start, s.end) for s in got]
    return spans


def test_a_weight_update_splits_a_parked_requests_tokens_by_version(monkeypatch):
    """Scenario: an RL loop updates the weights (with a version) while requests decode; a finished
    request reports which of its tokens each version produced. A parked request's 5 tokens under
    v1 were reported as v2's. With the hook they split as the running request's do; control:
    without it the parked request's span is v2's alone."""
    want = _spans_after_a_weight_update(monkeypatch, park=False, hooked=True)
    assert want == {rid: [("v1", 0, 5), ("v2", 5, 8)] for rid in "ab"}
    assert _spans_after_a_weight_update(monkeypatch, park=True, hooked=True) == want
    unhooked = _spans_after_a_weight_update(monkeypatch, park=True, hooked=False)
    assert unhooked["a"] == want["a"] and unhooked["b"] == [("v2", 0, 8)]
    assert _spans_after_a_weight_update(monkeypatch, park=False, hooked=False) == want  # nothing parked: as SGLang


def test_the_micro_batch_cap_counts_parked_requests(monkeypatch):
    """A micro-batch cap of 4 (``--pp-max-micro-batch-size``, ``/set_internal_state``) below 16
    request rows; 4 running, 3 of them parked: SGLang admitted 3 more, and the resume made a batch
    of 7. With the hook: none (4 in the batch once resumed); the rows' limit is unchanged.
    Control: without it, 3."""
    monkeypatch.setattr(sglang_scheduler, "get_parallel", lambda: SimpleNamespace(pp_max_micro_batch_size=4))
    pauser = PauseManager()
    sched = _hooked(pauser, running_batch=_batch(*[_req(f"r{i}") for i in range(4)]),
                    beam_coordinator=SimpleNamespace(pending_member_rows=lambda batch: 0))
    sched.req_to_token_pool = SimpleNamespace(available_size=lambda: 16 - len(sched.running_batch.reqs) - len(pauser))
    original = Scheduler.get_num_allocatable_reqs

    def allocatable(hooked: bool) -> int:
        bs = len(sched.running_batch.reqs)
        if hooked:
            return parked_lifecycle.around_num_allocatable_reqs(original, sched, bs, running_batch=sched.running_batch)
        return original(sched, bs, running_batch=sched.running_batch)

    assert allocatable(True) == allocatable(False) == 0  # nothing parked: SGLang's figure
    assert pauser.pause(sched.running_batch, ["r0", "r1", "r2"], step=1) == ["r0", "r1", "r2"]
    assert allocatable(True) == 0
    assert allocatable(False) == 3  # the control
    sched.req_to_token_pool = SimpleNamespace(available_size=lambda: 1)  # rows bind first: kept
    assert allocatable(True) == 0 and allocatable(False) == 1


def test_dropping_a_request_that_finished_while_parked_reopens_admission():
    """Under the overlap loop a request parked while its last step ran finishes at that step's
    end: its row and KV are freed, but a full batch's flag (set when admission found no room)
    stayed set -- SGLang clears it only when a running request leaves -- and no prefill ran until
    one did. Control: a step that drops nothing leaves the flag as SGLang set it."""
    from sglang_ext.scheduler_hooks import SchedulerHooks

    for finishes in (True, False):
        running = _batch(_req("a"), _req("b"))
        pauser = PauseManager()
        assert pauser.pause(running, ["b"], step=1) == ["b"]
        parked = pauser.parked()[0].req
        parked.done = finishes
        running.batch_is_full = True
        hooks = SimpleNamespace(clock=SimpleNamespace(processed=lambda: 1.0), timer=None, step=0, _ended=frozenset(),
                                pauser=pauser, installer=SimpleNamespace(release=lambda rid: None), metrics=None,
                                reporter=None, scheduler=SimpleNamespace(running_batch=running))
        step = SimpleNamespace(reqs=[parked], forward_mode=SimpleNamespace(is_decode=lambda: True))
        SchedulerHooks.end_step(hooks, step)
        assert len(pauser) == (0 if finishes else 1)
        assert running.batch_is_full is not finishes


class _PrioReq:
    """A decoding request as ``PrefillAdder.preempt_to_schedule`` reads it."""

    def __init__(self, rid: str, priority: int, out: int = 10, max_new: int = 500, prompt: int = 200) -> None:
        self.rid, self.priority, self.output_ids, self.to_finish = rid, priority, [0] * out, None
        self.sampling_params = SimpleNamespace(max_new_tokens=max_new, ignore_eos=False)
        self.time_stats = SimpleNamespace(wait_queue_entry_time=1.0)
        self.full_untruncated_fill_ids, self.prefix_len = [0] * prompt, 0
        self.kv = SimpleNamespace(req_pool_idx=None)

    def finished(self) -> bool:
        return False


def _preempt(monkeypatch: pytest.MonkeyPatch, park: bool, hooked: bool, urgent: int, low_first: bool = False,
             prompt: int = 200, max_new: int = 100, hooks_out: list | None = None) -> tuple[bool, list[str], list[str]]:
    """SGLang's ``preempt_to_schedule`` for a request of priority ``urgent`` (``prompt`` +
    ``max_new`` tokens; each priority-0 request frees 245) on a full pool: two running requests of
    priority 10 and two of 0 (parked or not; adapters A, A, B, A). Returns whether it admits, the
    requests it preempted, and those still parked."""
    from sglang.srt.managers.schedule_policy import PrefillAdder

    from sglang_ext import compat

    monkeypatch.setattr(compat, "get_schedule", lambda: SimpleNamespace(schedule_low_priority_values_first=low_first),
                        raising=False)
    import sglang.srt.managers.schedule_policy as policy

    monkeypatch.setattr(policy, "get_schedule", compat.get_schedule)
    sign = -1 if low_first else 1
    running = _batch(_PrioReq("hi1", 10 * sign), _PrioReq("hi2", 10 * sign), _PrioReq("lo1", 0), _PrioReq("lo2", 0))
    for r, lora in zip(running.reqs, "AABA", strict=True):
        r.lora_id = lora
    released: list[str] = []
    running.release_req = lambda i, n: released.append(running.reqs[i].rid)
    pauser = PauseManager()
    if park:
        assert pauser.pause(running, ["lo1", "lo2"], step=1) == ["lo1", "lo2"]
    hooks = SimpleNamespace(pauser=pauser, boundary=SimpleNamespace(note_resumed=lambda rids: None), metrics=None,
                            preempt_loras={"stale"})
    if hooks_out is not None:
        hooks_out.append(hooks)
    cls = parked_lifecycle.reserving_adder(PrefillAdder, hooks, {}) if hooked else PrefillAdder

    def offset(r: Any) -> float:
        return min(r.sampling_params.max_new_tokens - len(r.output_ids), 4096) * 0.5

    adder = object.__new__(cls)  # the budget as the reserving adder's __init__ leaves it, pool full
    reserved = sum(offset(r) for r in running.reqs) + sum(offset(p.req) for p in pauser.parked())
    adder.__dict__.update(running_batch=running, preempt_list=[], new_token_ratio=0.5,
                          memory_budget=SimpleNamespace(total_offset=reserved, remaining_total=0),
                          priority_scheduling_preemption_threshold=0,
                          token_to_kv_pool_allocator=SimpleNamespace(request_slot_reserve=lambda **kw: 0))
    if hooked:
        cls.__init__ = lambda self, *args, **kwargs: None  # (built by hand above; the pass's reset:)
    ok = cls.preempt_to_schedule(adder, _PrioReq("urgent", urgent * sign, out=0, max_new=max_new, prompt=prompt))
    return ok, released, list(pauser.paused_ids)


@pytest.mark.parametrize("low_first", [False, True], ids=["high-values-first", "low-values-first"])
def test_priority_preemption_chooses_among_parked_requests(monkeypatch, low_first):
    """Scenario (``--enable-priority-scheduling``, preemption on): a request of priority 100 (or
    10) arrives on a full pool. Stock SGLang preempts the two priority-0 requests. With them
    parked, SGLang preempted the two of priority 10 instead (their KV dropped and prefilled
    again) or, for priority 10, refused the arrival, while the parked ones kept their KV. The
    reserving adder merges the parked requests SGLang may preempt back first: its choice is
    stock's. In SGLang's either priority order. Control: SGLang's own adder with them parked."""
    for urgent in (100, 10):
        want = _preempt(monkeypatch, park=False, hooked=False, urgent=urgent, low_first=low_first)
        assert want == (True, ["lo1", "lo2"], [])
        assert _preempt(monkeypatch, park=True, hooked=True, urgent=urgent, low_first=low_first) == want
        control = _preempt(monkeypatch, park=True, hooked=False, urgent=urgent, low_first=low_first)
        assert control == ((True, ["hi1", "hi2"], ["lo1", "lo2"]) if urgent == 100 else (False, [], ["lo1", "lo2"]))
    # an arrival of priority 0 preempts nobody and resumes nobody
    assert _preempt(monkeypatch, park=True, hooked=True, urgent=0, low_first=low_first) == (False, [], ["lo1", "lo2"])


def test_a_priority_preemption_resumes_only_the_parked_requests_it_takes(monkeypatch):
    """Review of the fix (session 82): every lower-priority parked request was resumed, whether
    SGLang's preemption then took it or failed -- and a failed one was retried each pass, the
    boundary pausing them again: churn. SGLang's own choice, run first on a copy that frees
    nothing, picks them: an arrival that one request's room fits resumes and preempts that one
    (as stock, with it running); one that nothing fits resumes none (as stock, refused)."""
    one = _preempt(monkeypatch, park=False, hooked=False, urgent=100, prompt=100, max_new=100)
    assert one == (True, ["lo1"], [])
    assert _preempt(monkeypatch, park=True, hooked=True, urgent=100, prompt=100, max_new=100) == (True, ["lo1"], ["lo2"])
    none = _preempt(monkeypatch, park=False, hooked=False, urgent=5, prompt=400, max_new=400)
    assert none == (False, [], [])  # priority 5 may preempt only the two of 0, whose room is short
    assert _preempt(monkeypatch, park=True, hooked=True, urgent=5, prompt=400, max_new=400) == \
        (False, [], ["lo1", "lo2"])


def test_adapters_resumed_for_a_preemption_stay_counted_by_the_lora_check_in_that_pass(monkeypatch):
    """Review of the fix (session 82): SGLang's set of running adapters is taken before the
    admission loop; a parked request resumed for a preemption was then neither parked nor in it,
    so a request of a third adapter was admitted past ``--max-loras-per-batch`` (2 here). Its
    adapter is counted for the rest of the pass. Control: a pass that resumed nothing counts none."""
    from sglang.srt.lora.lora_manager import LoRAManager

    out: list = []
    assert _preempt(monkeypatch, park=True, hooked=True, urgent=100, prompt=100, max_new=100, hooks_out=out)[1] == ["lo1"]
    hooks = out[0]
    assert hooks.preempt_loras == {"stale", "B"}  # (the test skips the adder's __init__, which clears it)
    manager = SimpleNamespace(max_loras_per_batch=2, num_pinned_loras=0)
    manager.validate_lora_batch = lambda ids: LoRAManager.validate_lora_batch(manager, ids)
    sched = SimpleNamespace(_kvplane=hooks, lora_drainer=None, enable_lora_overlap_loading=False,
                            tp_worker=SimpleNamespace(model_runner=SimpleNamespace(lora_manager=manager)))
    hooks.preempt_loras.discard("stale")

    def admits(lora: str) -> bool:
        req = SimpleNamespace(rid="x", lora_id=lora)
        return parked_lifecycle.around_can_schedule_lora_req(Scheduler.can_schedule_lora_req, sched, req, {"A"})

    assert set(hooks.pauser.lora_ids) == {"A"}  # lo2 still parked
    assert admits("B") and not admits("C")  # A (running, parked), B (resumed): C would be a third
    hooks.preempt_loras.clear()  # as the next pass's adder does (the reserving adder's __init__)
    assert admits("C")  # the control: B not counted, C admitted beside the resumed B
