"""SGLang scheduler calls that must see kvplane's parked requests (keep-KV pause, ``pause.py``).

A parked request is out of SGLang's running batch but keeps its request row, its KV slots and its
radix-tree lock, and the step boundary merges it back later. SGLang's own calls that act on
"everything in flight" do not see it, so each is wrapped here (AROUND hooks, registered by
:func:`sglang_ext.scheduler_hooks.register`; pass-throughs on a scheduler without kvplane):

* ``Scheduler.abort_request``: a parked request being aborted is resumed first, so SGLang's own
  abort finishes it and frees its KV once; a request aborted while still queued (SGLang drops it
  from the queue without a batch, so no step ever ends it) has kvplane's per-request install state
  released (it grew without bound under repeated aborts).
* ``Scheduler.pause_generation`` in ``retract`` mode (RL weight updates: pause, update weights
  with ``flush_cache``, continue): parked requests are resumed first, so SGLang retracts them with
  the running batch. Before, they stayed parked through the flush, which cleared the request rows,
  the radix tree and the KV allocator under them; at ``/continue_generation`` they resumed on
  freed KV and later freed slots that belonged to other requests.
* ``Scheduler.update_running_batch`` when the KV pool cannot hold the next decode step: parked
  requests are merged back first, so that SGLang's retraction (longest first; the last request
  left is aborted with "out of memory") chooses among them too. Before, it retracted and aborted
  running requests while parked ones kept their KV slots.
* ``Scheduler.is_fully_idle``: not idle while any request is parked (it gates ``flush_cache``,
  weight updates, HiCache attach / detach and the health check; an in-place pause with parked
  requests now refuses a flush, as SGLang does with running ones).
* ``Scheduler.get_prefill_adder_class``: SGLang's prefill admission reserves the tokens each
  running request may still decode (``PrefillAdder``: ``min(max_new_tokens - output,
  CLIP_MAX_NEW_TOKENS) x new_token_ratio`` into its budget's ``total_offset``); parked requests
  will decode theirs after resuming, so the adder it builds reserves theirs too
  (:func:`reserving_adder`). Before, new prompts were admitted into that room, and when the pool
  filled every parked request was merged back and SGLang retracted requests: their KV dropped and
  prefilled again. Its priority preemption (``preempt_to_schedule``) finds the parked requests
  it takes merged back first (:func:`_preempting`).
* ``Scheduler.init_load_inquirer``: SGLang's load snapshot (``/v1/loads``, DP balancing, the
  router's load gauge) counts the running batch's requests; the inquirer's running batch then
  includes the parked ones (:func:`around_init_load_inquirer`). Their KV was counted already
  (the allocator's used tokens); before, a server with most requests parked looked idle to a
  router, which sent it more.
* ``Scheduler._poll_timeout_aborts`` (``SGLANG_REQ_RUNNING_TIMEOUT``): SGLang aborts a request
  whose first forward is older than the timeout, scanning its in-flight batches only; a parked
  request never timed out and could hold its KV for good. SGLang's own rule is run once more over
  the parked requests (:func:`around_poll_timeout_aborts`), and each abort it emits resumes its
  request through ``abort_request`` above (SGLang's abort of a running request: one more decode
  step, then the KV is freed). Rank 0 polls; the aborts reach the other ranks with its requests.
* ``Scheduler.can_schedule_lora_req`` (``--enable-lora``): SGLang admits a request whose adapter
  fits, with the running batch's, in ``--max-loras-per-batch``; the parked requests' adapters are
  counted too (:func:`around_can_schedule_lora_req`), so a resume never brings back more distinct
  adapters than one batch may hold. Before, a resume did, and SGLang's LoRA manager's assertion
  stopped the scheduler (LoRA check, session 81; from then until session 82 a LoRA server paused
  nothing). SGLang's LoRA drainer (``--lora-drain-wait-threshold``) sees the parked requests as
  running too (:func:`drainer_seeing_parked`, bound to the scheduler's drainer instance).
* ``Scheduler.collect_inflight_reqs``: the requests in flight include the parked ones. Its
  callers: a weight-version change (``/update_weight_version``, ``update_weights_*`` with a
  ``weight_version``) records the old version's token count on each request in flight, from
  which a finished request's ``meta_info["weight_versions"]`` spans come; a parked request's
  old-weight tokens were reported as the new version's (scheduler audit, session 82). SGLang's
  abort marks matching requests in flight (a parked match was resumed first, above).
* ``Scheduler.get_num_allocatable_reqs``: the running batch's size it subtracts from the
  micro-batch cap (``--pp-max-micro-batch-size``, ``/set_internal_state``) counts the parked
  requests, which join the batch at their resume (before, a resume could take the batch past
  the cap; the cap's default, ``--max-running-requests``, was held by the request rows anyway).
"""

from __future__ import annotations

import copy
import dataclasses
from types import SimpleNamespace
from typing import Any

import structlog

log = structlog.get_logger(__name__)


def _hooks_of(scheduler: Any) -> Any:
    return getattr(scheduler, "_kvplane", None)


def _resume(hooks: Any, batch: Any, predicate: Any, event: str) -> Any:
    """Merge the parked requests ``predicate`` picks into ``batch``; returns the batch (a new one
    when ``batch`` was empty), the resume logged as ``event`` and counted."""
    batch, resumed = hooks.pauser.resume_matching(batch, predicate)
    if resumed:
        log.info(event, rids=resumed)
        hooks.boundary.note_resumed(resumed)  # the next stats line's resumed_now
        if hooks.metrics is not None and hooks.tp.is_source:
            hooks.metrics.resumed(len(resumed))
    return batch


def around_abort(original: Any, scheduler: Any, recv_req: Any, *args: Any, **kwargs: Any) -> Any:
    hooks = _hooks_of(scheduler)
    if hooks is None:
        return original(scheduler, recv_req, *args, **kwargs)
    rid = getattr(recv_req, "rid", "") or ""
    every = bool(getattr(recv_req, "abort_all", False))

    def matches(req: Any) -> bool:
        return every or req.rid.startswith(rid)

    if len(hooks.pauser):
        scheduler.running_batch = _resume(hooks, scheduler.running_batch, matches, "paused_requests_aborted")
    queued = [req.rid for req in getattr(scheduler, "waiting_queue", None) or () if matches(req)]
    chunked = getattr(scheduler, "chunked_req", None)
    result = original(scheduler, recv_req, *args, **kwargs)
    still = {req.rid for req in getattr(scheduler, "waiting_queue", None) or ()} if queued else set()
    for gone in queued:
        if gone not in still:
            hooks.installer.release(gone)
    if chunked is not None and matches(chunked):  # SGLang tears it down later, never in a
        hooks.installer.forget(chunked.rid)  # processed batch's finished list (the pool: on_release)
    return result


def around_pause_generation(original: Any, scheduler: Any, recv_req: Any, *args: Any, **kwargs: Any) -> Any:
    hooks = _hooks_of(scheduler)
    if hooks is not None and len(hooks.pauser) and getattr(recv_req, "mode", None) == "retract":
        scheduler.running_batch = _resume(hooks, scheduler.running_batch, lambda req: True, "paused_requests_retracted")
    return original(scheduler, recv_req, *args, **kwargs)


def around_is_fully_idle(original: Any, scheduler: Any, *args: Any, **kwargs: Any) -> bool:
    idle = original(scheduler, *args, **kwargs)
    if not idle:
        return idle
    hooks = _hooks_of(scheduler)
    return hooks is None or not len(hooks.pauser)


def around_update_running_batch(original: Any, scheduler: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
    hooks = _hooks_of(scheduler)
    if hooks is not None and len(hooks.pauser) and batch is not None and not batch.is_empty() \
            and not scheduler._reqs_finishing_inflight(batch) and not batch.check_decode_mem():
        # (under the overlap loop SGLang first drops the requests whose in-flight step finishes
        # them, and skips a full step while any does: only a batch without them is checked here)
        _resume(hooks, batch, lambda req: True, "paused_requests_resumed_for_retraction")  # non-empty: in place
    return original(scheduler, batch, *args, **kwargs)


def reserving_adder(base: Any, hooks: Any, made: dict[Any, type]) -> type:
    """``base`` (SGLang's ``PrefillAdder`` class) subclassed so that a new adder also reserves the
    decode tokens of the parked requests (``hooks.pauser``), as ``base`` does for the running
    batch's, and so that its priority preemption can choose them (:func:`_preempting`); built once
    per ``base`` (``made`` keeps them: a scheduler hooks object's)."""
    cls = made.get(base)
    if cls is None:
        pauser = hooks.pauser

        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            base.__init__(self, *args, **kwargs)
            loras = getattr(hooks, "preempt_loras", None)
            if loras:  # a new admission pass: SGLang takes its set of running adapters afresh
                loras.clear()
            parked = pauser.parked() if len(pauser) else ()
            if parked:
                self.memory_budget.total_offset += sum(
                    self._get_running_request_total_token_offset(p.req) for p in parked)

        def preempt_to_schedule(self: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
            if len(pauser) and not args and not kwargs:
                _preempting(hooks, self, base, req)
            return base.preempt_to_schedule(self, req, *args, **kwargs)

        cls = made[base] = type(base.__name__, (base,), {
            "__init__": __init__, "preempt_to_schedule": preempt_to_schedule, "__module__": base.__module__,
            "__qualname__": base.__qualname__})
        log.info("kvplane_prefill_adder_reserves_parked", base=base.__qualname__)
    return cls


def _preempting(hooks: Any, adder: Any, base: Any, req: Any) -> None:
    """Before SGLang's priority preemption for ``req`` (``--enable-priority-scheduling``), the
    parked requests it would preempt are merged back into the running batch, where its choice
    then takes them. Before, it preempted running requests of a higher priority than parked ones
    (their KV dropped and prefilled again), or refused ``req``, while the parked ones kept their
    KV (scheduler audit, session 82).

    Which ones: SGLang's own ``preempt_to_schedule`` (``base``'s) runs first on a copy of the
    adder whose running batch lists the parked requests too and frees nothing; the parked requests
    it preempted there are resumed, none when it would fail (a resume then would only have been
    undone by the next boundary's pause, every pass). The real call then takes the same requests:
    SGLang preempts the lowest priorities first until the arrival fits, and every one the copy
    took is in the batch. Their reservation is in the adder's budget already (``__init__``), which
    the preemption takes back as for running ones. Their adapters stay counted by the LoRA check
    for the rest of the pass (``hooks.preempt_loras``): SGLang's set of running adapters was taken
    before they joined."""
    batch = getattr(adder, "running_batch", None)
    if batch is None or batch.is_empty() or getattr(req, "priority", None) is None:
        return
    parked = [p.req for p in hooks.pauser.parked() if not p.req.finished() and p.req.priority is not None]
    if not parked:
        return
    probe = copy.copy(adder)
    probe.running_batch = SimpleNamespace(reqs=[*batch.reqs, *parked], release_req=lambda *args: None,
                                          filter_batch=lambda *args, **kwargs: None)
    probe.memory_budget = copy.copy(adder.memory_budget)
    probe.preempt_list = list(adder.preempt_list)
    if not base.preempt_to_schedule(probe, req):
        return
    chosen = {id(r) for r in probe.preempt_list[len(adder.preempt_list):]}
    taken = [r for r in parked if id(r) in chosen]
    if taken:
        loras = getattr(hooks, "preempt_loras", None)
        if loras is not None:
            loras.update(getattr(r, "lora_id", None) for r in taken)
        _resume(hooks, batch, lambda r: id(r) in chosen, "paused_requests_resumed_for_preemption")  # in place


def around_prefill_adder_class(original: Any, scheduler: Any, *args: Any, **kwargs: Any) -> Any:
    base = original(scheduler, *args, **kwargs)
    hooks = _hooks_of(scheduler)
    if hooks is None:
        return base
    return reserving_adder(base, hooks, hooks.prefill_adders)


def around_init_load_inquirer(original: Any, scheduler: Any, *args: Any, **kwargs: Any) -> Any:
    """The scheduler's load inquirer (a frozen dataclass) rebuilt with a running batch that lists
    the parked requests too; kvplane's hooks are looked up at each call (they are attached after
    SGLang's ``__init__``, which builds the inquirer)."""
    result = original(scheduler, *args, **kwargs)
    inquirer = getattr(scheduler, "load_inquirer", None)
    if inquirer is None:
        return result
    running = inquirer.get_running_batch

    def with_parked() -> Any:
        batch = running()
        hooks = _hooks_of(scheduler)
        if hooks is None or not len(hooks.pauser):
            return batch
        view = copy.copy(batch)  # SGLang's batch, every other attribute as is (get_loads reads reqs)
        view.reqs = [*batch.reqs, *(p.req for p in hooks.pauser.parked())]
        return view

    scheduler.load_inquirer = dataclasses.replace(inquirer, get_running_batch=with_parked)
    log.info("kvplane_parked_load_inquirer", note="SGLang's load snapshot counts parked requests as running")
    return result


def around_poll_timeout_aborts(original: Any, scheduler: Any, *args: Any, **kwargs: Any) -> Any:
    """SGLang's timeout aborts, plus those its running-timeout rule gives for the parked requests:
    ``original`` (SGLang's own method, unbound) runs again on a view whose only in-flight batch is
    the parked requests and whose queue is empty, so the timeout, its clock, the message and the
    status code stay SGLang's. A rid already aborted is not aborted twice (a request parked by the
    step in flight is still in SGLang's ``last_batch``)."""
    aborts = original(scheduler, *args, **kwargs)
    hooks = _hooks_of(scheduler)
    if hooks is None or not len(hooks.pauser):
        return aborts
    parked = SimpleNamespace(reqs=[p.req for p in hooks.pauser.parked()])
    view = SimpleNamespace(waiting_queue=(), _collect_inflight_batches=lambda: [parked])
    named = {abort.rid for abort in aborts}
    more = [abort for abort in original(view, *args, **kwargs) if abort.rid not in named]
    if more:
        log.info("kvplane_parked_requests_timed_out", rids=[abort.rid for abort in more])
    return [*aborts, *more]


def around_can_schedule_lora_req(original: Any, scheduler: Any, req: Any, running_loras: Any,
                                 *args: Any, **kwargs: Any) -> Any:
    """SGLang's LoRA admission check with the parked requests' adapters added to ``running_loras``
    (a new set: SGLang's own, which it grows with each admitted request, is left as is).

    Keeps the adapters of the running, parked and admitted requests together within
    ``--max-loras-per-batch``: a pause moves a request's adapter from running to parked and a
    resume back, neither adds one, so no resume can overflow the batch's adapter slots."""
    hooks = _hooks_of(scheduler)
    if hooks is not None and len(hooks.pauser):
        parked = hooks.pauser.lora_ids  # kept with the parked set: no pass over it per call
        if not parked <= running_loras:
            running_loras = running_loras | parked
    resumed = getattr(hooks, "preempt_loras", None)  # resumed for a preemption in this pass
    if resumed and not resumed <= running_loras:
        running_loras = running_loras | resumed
    return original(scheduler, req, running_loras, *args, **kwargs)


def drainer_seeing_parked(original: Any, pauser: Any) -> Any:
    """SGLang's LoRA drainer's ``update_draining_state`` (``--lora-drain-wait-threshold``: an
    adapter waiting too long has running ones drained -- admitting no new request of theirs --
    until a slot frees) with the parked requests among the running ones. Without them the drainer
    counted too few adapters to start a drain while parked ones held slots, and took an adapter
    whose requests were all parked as drained, re-admitting it (review of session 82's LoRA fix).
    Bound to the scheduler's drainer instance (:class:`~sglang_ext.scheduler_hooks.SchedulerHooks`)."""

    def update_draining_state(waiting_queue: Any, running_reqs: Any, *args: Any, **kwargs: Any) -> Any:
        if len(pauser):
            running_reqs = [*running_reqs, *(p.req for p in pauser.parked() if not p.req.finished())]
        return original(waiting_queue, running_reqs, *args, **kwargs)

    return update_draining_state


def around_collect_inflight_reqs(original: Any, scheduler: Any, *args: Any, **kwargs: Any) -> Any:
    reqs = original(scheduler, *args, **kwargs)
    hooks = _hooks_of(scheduler)
    if hooks is None or not len(hooks.pauser):
        return reqs
    return {*reqs, *(p.req for p in hooks.pauser.parked())}


def around_num_allocatable_reqs(original: Any, scheduler: Any, running_bs: int, *args: Any, **kwargs: Any) -> Any:
    hooks = _hooks_of(scheduler)
    if hooks is not None and len(hooks.pauser):
        running_bs += len(hooks.pauser)
    return original(scheduler, running_bs, *args, **kwargs)
