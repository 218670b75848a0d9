"""LoRA admission counts the parked requests' adapters (``parked_lifecycle.around_can_schedule_lora_req``).

Scenario (LoRA check, session 81): SGLang admitted a request whose adapter fit with the running
batch's, in ``--max-loras-per-batch``, not counting the adapters of requests kvplane had parked;
their resume then merged more distinct adapters into one batch than the LoRA memory pool holds
and SGLang's LoRA manager's assertion stopped the scheduler. SGLang's own check runs here (its
``Scheduler.can_schedule_lora_req`` and ``LoRAManager.validate_lora_batch``, unbound, on the
attributes they read).
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest

from sglang_ext import parked_lifecycle
from tests.sglang.test_parked_lifecycle import _fresh_sampling, _scheduler  # noqa: F401 (a fixture)


def _lora_scheduler(max_loras: int) -> Any:
    pytest.importorskip("sglang")
    from sglang.srt.lora.lora_manager import LoRAManager

    sched = _scheduler()
    manager = SimpleNamespace(max_loras_per_batch=max_loras, num_pinned_loras=0)
    manager.validate_lora_batch = lambda ids: LoRAManager.validate_lora_batch(manager, ids)
    sched.lora_drainer = None
    sched.enable_lora_overlap_loading = False
    sched.tp_worker = SimpleNamespace(model_runner=SimpleNamespace(lora_manager=manager))
    a, b = sched.running_batch.reqs
    a.lora_id, b.lora_id = "A", "B"
    return sched


def _admits(sched: Any, lora_id: str | None, running: set[str | None], hooked: bool = True) -> bool:
    from sglang.srt.managers.scheduler import Scheduler

    req = SimpleNamespace(rid="new", lora_id=lora_id)
    if not hooked:
        return Scheduler.can_schedule_lora_req(sched, req, running)
    return parked_lifecycle.around_can_schedule_lora_req(Scheduler.can_schedule_lora_req, sched, req, running)


def test_a_new_adapter_is_not_admitted_into_the_slot_a_parked_request_holds():
    sched = _lora_scheduler(max_loras=2)
    assert _admits(sched, "C", {"A"})  # nothing parked: SGLang's figure ({A, C})
    assert not _admits(sched, "C", {"A", "B"})
    assert sched._kvplane.pauser.pause(sched.running_batch, ["b"], step=1) == ["b"]
    running = {r.lora_id for r in sched.running_batch.reqs}
    assert running == {"A"}
    assert _admits(sched, "C", running, hooked=False)  # the control: SGLang alone admits C...
    assert not _admits(sched, "C", running)  # ...whose batch after b's resume would hold A, B, C
    assert running == {"A"}  # SGLang's own set untouched (it grows it with each admitted request)
    assert _admits(sched, "B", running) and _admits(sched, "A", running)  # adapters already counted
    assert not _admits(sched, None, running)  # the base model takes a slot too (SGLang counts None)
    sched.running_batch, _ = sched._kvplane.pauser.resume_all(sched.running_batch)
    assert {r.lora_id for r in sched.running_batch.reqs} == {"A", "B"}  # within 2: the resume fits


def test_the_parked_adapters_are_counted_through_pauses_resumes_and_ends():
    sched = _lora_scheduler(max_loras=3)
    pauser, b = sched._kvplane.pauser, sched.running_batch.reqs[1]
    b.lora_id = "A"
    assert pauser.pause(sched.running_batch, ["a", "b"], step=1) == ["a", "b"]
    assert set(pauser.lora_ids) == {"A"}
    sched.running_batch, _ = pauser.resume(sched.running_batch, ["a"])
    assert set(pauser.lora_ids) == {"A"}  # b still parked
    sched.running_batch, _ = pauser.resume(sched.running_batch, ["b"])
    assert not set(pauser.lora_ids)


def test_room_for_the_parked_adapters_admits_as_before_and_without_kvplane_nothing_changes():
    sched = _lora_scheduler(max_loras=3)
    sched._kvplane.pauser.pause(sched.running_batch, ["b"], step=1)
    assert _admits(sched, "C", {"A"})  # A, B, C: 3
    assert not _admits(sched, "D", {"A", "C"})  # A, B, C, D
    pauser = sched._kvplane.pauser
    pauser.parked()[0].req.done = True  # finished while parked (the overlap loop's step in flight):
    assert pauser.drop_finished(["b"]) == ["b"]  # forgotten at that step's end, its slot with it
    assert not list(pauser.lora_ids)
    assert _admits(sched, "D", {"A", "C"})  # A, C, D
    plain = SimpleNamespace(_kvplane=None, **{k: getattr(sched, k) for k in
                                             ("lora_drainer", "enable_lora_overlap_loading", "tp_worker")})
    from sglang.srt.managers.scheduler import Scheduler

    req = SimpleNamespace(rid="x", lora_id="D")
    assert parked_lifecycle.around_can_schedule_lora_req(Scheduler.can_schedule_lora_req, plain, req, {"A", "C"}) \
        is Scheduler.can_schedule_lora_req(plain, req, {"A", "C"})


def _waiting(rid: str, lora: str, max_new: int, waited_s: float) -> SimpleNamespace:
    return SimpleNamespace(rid=rid, lora_id=lora, output_ids=[], sampling_params=SimpleNamespace(max_new_tokens=max_new),
                           time_stats=SimpleNamespace(wait_queue_entry_time=time.monotonic() - waited_s))


def _drained(sched: Any, parked_b: bool, seeing: bool, left: tuple[int, int]) -> tuple[dict, dict]:
    """One admission pass as SGLang runs it with ``--lora-drain-wait-threshold 1``: the drainer's
    update, then each waiting request's check (C waited 30 s; a new long request of A and of B).
    Returns (adapter -> the adapter it drains for, rid -> admitted)."""
    from sglang.srt.lora.lora_drainer import LoRADrainer
    from sglang.srt.managers.scheduler import Scheduler

    for req, n in zip(sched.running_batch.reqs, left, strict=True):
        req.sampling_params = SimpleNamespace(max_new_tokens=n)
    if parked_b:
        assert sched._kvplane.pauser.pause(sched.running_batch, ["b"], step=1) == ["b"]
    drainer = sched.lora_drainer = LoRADrainer(2, 1.0)
    update = drainer.update_draining_state
    if seeing:
        update = parked_lifecycle.drainer_seeing_parked(update, sched._kvplane.pauser)
    waiting = [_waiting("c", "C", 50, 30.0), _waiting("a2", "A", 4000, 0.0), _waiting("b2", "B", 4000, 0.0)]
    update(waiting, sched.running_batch.reqs)
    running = {req.lora_id for req in sched.running_batch.reqs}
    admitted = {}
    for req in waiting:
        admitted[req.rid] = parked_lifecycle.around_can_schedule_lora_req(
            Scheduler.can_schedule_lora_req, sched, req, running)
        if admitted[req.rid]:
            running.add(req.lora_id)
    return {k: v.is_draining_for for k, v in drainer.adapter_to_stats.items() if v.is_draining_for}, admitted


@pytest.mark.parametrize("left", [(10, 1000), (1000, 10)], ids=["a-nearly-done", "b-nearly-done"])
def test_the_lora_drainer_sees_parked_requests_as_running(left):
    """Scenario (review of this fix, session 82): SGLang's drainer (``--lora-drain-wait-threshold``)
    drains a running adapter -- admits no new request of it -- when one waits too long and every
    slot is taken. Fed the running batch only, it counted a parked request's slot as free: no
    drain began (a new long A request took the slot C waited for), or B, whose only request was
    parked, counted as drained. With the parked requests it drains as stock SGLang does with b
    running (the reference: the same pass, nothing parked). Control: without them it does not."""
    want = _drained(_lora_scheduler(max_loras=2), parked_b=False, seeing=False, left=left)
    assert want[0] and not want[1]["c"]  # stock drains one adapter for C
    assert _drained(_lora_scheduler(max_loras=2), parked_b=True, seeing=True, left=left) == want
    assert _drained(_lora_scheduler(max_loras=2), parked_b=True, seeing=False, left=left) != want
