"""LoRA admission counts the parked requests' adapters (``parked_lifecycle.around_can_schedule_lora_req``).

Scenario (LoRA check, session 81): SGLang admitted a request whose adapter fit with the running
batch's, in ``--max-loras-per-batch``, not counting the adapters of requests kvplane had parked;
their resume then merged more distinct adapters into one batch than the LoRA memory pool holds
and SGLang's LoRA manager's assertion stopped the scheduler. SGLang's own check runs here (its
``Scheduler.can_schedule_lora_req`` and ``LoRAManager.validate_lora_batch``, unbound, on the
attributes they read).
"""

from __future__ import annotations

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


def test_room_for_the_parked_adapters_admits_as_before_and_without_kvplane_nothing_changes():
    sched = _lora_scheduler(max_loras=3)
    sched._kvplane.pauser.pause(sched.running_batch, ["b"], step=1)
    assert _admits(sched, "C", {"A"})  # A, B, C: 3
    assert not _admits(sched, "D", {"A", "C"})  # A, B, C, D
    sched._kvplane.pauser.parked()[0].req.done = True  # finished while parked: its slot is not held
    assert _admits(sched, "D", {"A", "C"})  # A, C, D
    plain = SimpleNamespace(_kvplane=None, **{k: getattr(sched, k) for k in
                                             ("lora_drainer", "enable_lora_overlap_loading", "tp_worker")})
    from sglang.srt.managers.scheduler import Scheduler

    req = SimpleNamespace(rid="x", lora_id="D")
    assert parked_lifecycle.around_can_schedule_lora_req(Scheduler.can_schedule_lora_req, plain, req, {"A", "C"}) \
        is Scheduler.can_schedule_lora_req(plain, req, {"A", "C"})
