"""The SGLang scheduler calls that must see kvplane's parked (paused) requests
(:mod:`sglang_ext.parked_lifecycle`).

Part of :mod:`sglang_ext.compat.surface` (imported there, so in its ``TARGETS``). A parked request
is out of SGLang's running batch but holds its request row, KV slots and radix-tree lock; SGLang
calls that reason about "everything running" would otherwise not see it.
"""

from __future__ import annotations

from sglang_ext.compat.target import Target

_SCHEDULER = "sglang.srt.managers.scheduler.Scheduler"

__all__ = ["SCHEDULER_ABORT_REQUEST", "SCHEDULER_PAUSE_GENERATION", "PAUSE_GENERATION_REQ", "SCHEDULER_IS_FULLY_IDLE",
           "SCHEDULER_UPDATE_RUNNING_BATCH", "SCHEDULER_FINISHING_INFLIGHT", "BATCH_CHECK_DECODE_MEM",
           "SCHEDULER_PREFILL_ADDER_CLASS", "PREFILL_ADDER", "PREFILL_BUDGET", "SCHEDULER_INIT_LOAD_INQUIRER",
           "SCHEDULER_LOAD_STATE", "SCHEDULER_LOAD_INQUIRER", "SCHEDULER_POLL_TIMEOUT_ABORTS",
           "SCHEDULER_TIMEOUT_STATE", "SCHEDULER_CAN_SCHEDULE_LORA_REQ",
           "SCHEDULER_LORA_DRAINER", "LORA_DRAINER_UPDATE", "SCHEDULER_COLLECT_INFLIGHT_REQS",
           "SCHEDULER_NUM_ALLOCATABLE_REQS", "BATCH_IS_FULL", "SCHEDULE_POLICY_GET_SCHEDULE"]

SCHEDULER_ABORT_REQUEST = Target(f"{_SCHEDULER}.abort_request", params=("self", "recv_req"),
                                 used_by=("parked_lifecycle",))
"""A parked request being aborted is resumed first, so SGLang's abort finishes it."""
SCHEDULER_PAUSE_GENERATION = Target(f"{_SCHEDULER}.pause_generation", params=("self", "recv_req"),
                                    used_by=("parked_lifecycle",))
"""``/pause_generation``: its ``retract`` mode retracts the running batch, the last batch and the
chunked request, then empties the running batch -- parked requests are resumed first so that it
retracts them too (RL weight updates: pause, update with ``flush_cache``, continue)."""
PAUSE_GENERATION_REQ = Target("sglang.srt.managers.io_struct.PauseGenerationReqInput", attrs=("mode",),
                              used_by=("parked_lifecycle",))
SCHEDULER_IS_FULLY_IDLE = Target(f"{_SCHEDULER}.is_fully_idle", params=("self",),
                                 keyword=("for_health_check", "ignore_waiting"), used_by=("parked_lifecycle",))
"""Whether nothing holds KV or runs: gates ``flush_cache`` (which clears the radix tree, the request
rows and the KV allocator), weight updates, HiCache attach / detach and the health check; a
scheduler with parked requests is not idle."""
SCHEDULER_UPDATE_RUNNING_BATCH = Target(f"{_SCHEDULER}.update_running_batch", params=("self", "batch"),
                                        used_by=("parked_lifecycle",))
"""Before a decode step: when the KV pool cannot hold the step (``check_decode_mem``) it retracts
running requests (``ScheduleBatch.retract_decode``), longest first, and aborts the last one left
("out of memory even after retracting all other requests"); parked requests, holding their KV
slots, are merged back first so that the retraction chooses among them too."""
SCHEDULER_FINISHING_INFLIGHT = Target(f"{_SCHEDULER}._reqs_finishing_inflight", params=("self", "batch"),
                                      used_by=("parked_lifecycle", "scheduler_hooks", "step_boundary"))
"""Under the overlap loop, the requests whose in-flight step finishes them by length: SGLang drops
them before its memory check and skips a full step while any is there; a boundary whose running
requests all end so resumes the parked ones, and skips a pause that would take the last one
left (``StepBoundary._live``, ``would_idle``)."""
BATCH_CHECK_DECODE_MEM = Target("sglang.srt.managers.schedule_batch.ScheduleBatch.check_decode_mem", params=("self",),
                                used_by=("parked_lifecycle",))
SCHEDULER_PREFILL_ADDER_CLASS = Target(f"{_SCHEDULER}.get_prefill_adder_class", params=("self",),
                                       used_by=("parked_lifecycle",))
"""The class of each prefill's admission (``PrefillAdder``); it reserves the running requests'
remaining decode tokens, and kvplane's subclass the parked requests' too."""
PREFILL_ADDER = Target("sglang.srt.managers.schedule_policy.PrefillAdder",
                       attrs=("memory_budget", "_get_running_request_total_token_offset", "preempt_to_schedule",
                              "running_batch", "priority_scheduling_preemption_threshold"),
                       used_by=("parked_lifecycle",))
"""``preempt_to_schedule(req)`` (``--enable-priority-scheduling``): frees room for ``req`` by
preempting running requests of a priority lower by more than the threshold; kvplane runs it on a
copy that lists the parked requests too and resumes those it took, so that SGLang's choice includes them."""
SCHEDULE_POLICY_GET_SCHEDULE = Target("sglang.srt.managers.schedule_policy.get_schedule",
                                      used_by=("parked_lifecycle",))
"""The scheduling settings ``preempt_to_schedule`` reads its priority order from
(``schedule_low_priority_values_first``)."""
PREFILL_BUDGET = Target("sglang.srt.mem_cache.prefill_budget.PrefillBudget", attrs=("total_offset",),
                        used_by=("parked_lifecycle",))
SCHEDULER_INIT_LOAD_INQUIRER = Target(f"{_SCHEDULER}.init_load_inquirer", params=("self",),
                                      used_by=("parked_lifecycle",))
SCHEDULER_LOAD_STATE = Target(_SCHEDULER, attrs=("load_inquirer",), used_by=("parked_lifecycle",))
"""The inquirer ``init_load_inquirer`` builds (replaced by kvplane's rebuilt one)."""
SCHEDULER_LOAD_INQUIRER = Target("sglang.srt.managers.scheduler_components.load_inquirer.SchedulerLoadInquirer",
                                 attrs=("get_running_batch", "get_loads"), used_by=("parked_lifecycle",))
"""A frozen dataclass; ``get_loads`` reads ``len(get_running_batch().reqs)`` as the running count
(called by ``tests/sglang/test_parked_lifecycle.py`` against kvplane's rebuilt inquirer)."""
SCHEDULER_POLL_TIMEOUT_ABORTS = Target(f"{_SCHEDULER}._poll_timeout_aborts", params=("self",),
                                       used_by=("parked_lifecycle",))
"""Rank 0's ``SGLANG_REQ_WAITING_TIMEOUT`` / ``SGLANG_REQ_RUNNING_TIMEOUT`` scan (aborts only); kvplane
runs it again over the parked requests, on a view with only the two attributes of
:data:`SCHEDULER_TIMEOUT_STATE` (``tests/sglang/test_parked_timeout.py`` runs SGLang's method so)."""
SCHEDULER_TIMEOUT_STATE = Target(_SCHEDULER, attrs=("waiting_queue", "_collect_inflight_batches"),
                                 used_by=("parked_lifecycle",))
SCHEDULER_CAN_SCHEDULE_LORA_REQ = Target(f"{_SCHEDULER}.can_schedule_lora_req", params=("self", "req", "running_loras"),
                                         used_by=("parked_lifecycle",))
"""Prefill admission under ``--enable-lora``: whether ``req``'s adapter fits with ``running_loras``
(the running batch's adapters and those admitted so far, ``--max-loras-per-batch``); kvplane adds
the parked requests' adapters, which come back at their resume."""
SCHEDULER_LORA_DRAINER = Target(_SCHEDULER, attrs=("lora_drainer",), used_by=("scheduler_hooks",))
"""SGLang's LoRA drainer (``--lora-drain-wait-threshold`` > 0; None otherwise), built in the
scheduler's ``__init__``; kvplane binds its update to the parked requests too."""
LORA_DRAINER_UPDATE = Target("sglang.srt.lora.lora_drainer.LoRADrainer.update_draining_state",
                             params=("self", "waiting_queue", "running_reqs"), used_by=("parked_lifecycle",))
"""Once per prefill admission pass: which adapters drain (admit no new request) so that a starving
one gets a slot, from the running requests' adapters; kvplane adds the parked ones."""
SCHEDULER_COLLECT_INFLIGHT_REQS = Target(f"{_SCHEDULER}.collect_inflight_reqs", params=("self",),
                                         used_by=("parked_lifecycle",))
"""The requests in flight (running and last batch): a weight-version change records its event on
each (``record_weight_version_change``), and an abort marks matching ones; plus the parked."""
SCHEDULER_NUM_ALLOCATABLE_REQS = Target(f"{_SCHEDULER}.get_num_allocatable_reqs", params=("self", "running_bs"),
                                        used_by=("parked_lifecycle",))
"""Requests a prefill may still admit: ``min(micro-batch cap - running_bs, free request rows)``;
kvplane counts the parked requests into ``running_bs``."""
BATCH_IS_FULL = Target("sglang.srt.managers.schedule_batch.ScheduleBatch", attrs=("batch_is_full",),
                       used_by=("scheduler_hooks",))
"""Admission is shut while set; SGLang clears it when a running request leaves, kvplane when a
request that finished while parked is dropped."""
