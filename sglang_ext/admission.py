"""Admission gate: SGLang's queued prefills wait for the control plane's ``admit`` (issue 5).

With ``--kv-scheduler layerkv`` (LayerKV §3.1, SLO-aware admission: Eq. 1-2 admit queued
prefills while the running requests' TBT slack allows, Eq. 4 keeps ``min_gpu_layers`` of each
admitted prefill on the GPU) or ``lvf`` (SuperInfer §4.2, Largest-VLT-First rotation) the control
plane decides *when* a queued request starts its prefill. SGLang's scheduler pulls prefills from
``scheduler.waiting_queue`` inside ``get_next_batch_to_run``; around that call the gate hides the
requests not admitted yet and puts them back afterwards in their arrival order, so SGLang's own
prefill logic (memory checks, chunking, radix prefix matching) runs unchanged on the admitted
ones. ``fcfs`` is not gated: SGLang's own first-come-first-served order is that policy.

Liveness rules (never a request stuck because of the control plane):

* work-conserving: when nothing runs, nothing is paused and no admitted request is queued, the
  head of the queue goes in without waiting (also covers an idle server, which sends no reports
  and so would never hear an ``admit``);
* the control plane unreachable (the install's ``fallback`` flag): the gate is open.

Every TP rank runs the gate from the same broadcast install and the same queue, so all ranks
admit the same requests.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from sglang_ext.pacing import SLO_PARAM, request_slo_tbt_ms

GATED_SCHEDULERS = frozenset({"layerkv", "lvf"})
"""``--kv-scheduler`` values whose admissions come from the control plane."""


def request_slo(req: Any) -> float | None:
    """The request's own TBT SLO (``custom_params.kvplane_slo_tbt_ms``), None for the policy's.

    Values were validated at the HTTP entry (:mod:`sglang_ext.pacing`); a bad one here is ignored.
    """
    custom = getattr(getattr(req, "sampling_params", None), "custom_params", None)
    if not isinstance(custom, dict) or custom.get(SLO_PARAM) is None:
        return None
    try:
        return request_slo_tbt_ms({"custom_params": custom}, 0.0)
    except ValueError:
        return None


def prefill_joins(last_batch: Any) -> bool:
    """Whether the step that just ran was a prefill whose requests join the running batch inside
    SGLang's ``get_next_batch_to_run`` (after kvplane's boundary and gate run)."""
    return last_batch is not None and not last_batch.is_empty() and last_batch.forward_mode.is_extend()


def live_request_ids(scheduler: Any, running_batch: Any, last_batch: Any, pauser: Any) -> set[str]:
    """The ids of every request this worker still holds before SGLang picks the next batch:
    queued, running, just prefilled (``last_batch``: it joins the running batch inside
    ``get_next_batch_to_run``), prefilling in chunks, or parked by a pause."""
    live = {req.rid for req in getattr(scheduler, "waiting_queue", None) or ()}
    for batch in (running_batch, last_batch):
        if batch is not None:
            live.update(req.rid for req in batch.reqs)
    chunked = getattr(scheduler, "chunked_req", None)
    if chunked is not None:
        live.add(chunked.rid)
    if len(pauser):
        live.update(p.req.rid for p in pauser.parked())
    return live


class AdmissionGate:
    """Which queued requests SGLang may prefill this step."""

    def __init__(self, *, enabled: bool) -> None:
        self.enabled = enabled
        self.open = False
        """Set per step from the install: True while running without a control plane."""
        self.admitted: set[str] = set()
        """Admitted by the control plane and still queued."""
        self.local_admits = 0
        """Requests let in by the work-conserving rule."""
        self.held_total = 0
        """Sum over steps of the requests held back (a request held 3 steps counts 3)."""
        self._positions: dict[int, int] = {}

    def admit(self, rids: Iterable[str]) -> None:
        """The control plane admitted ``rids``; remembered only while the gate is on (the control
        plane sends admits under every scheduler, and nothing prunes them with the gate off)."""
        if self.enabled:
            self.admitted.update(rids)

    def hold_back(self, scheduler: Any, running_batch: Any, pauser: Any,
                  last_batch: Any = None) -> list[tuple[int, Any]]:
        """Remove the not-admitted requests from ``scheduler.waiting_queue``; returns them with
        their queue positions for :meth:`restore`. ``last_batch``: the step that just ran; a
        prefill there joins the running batch inside SGLang's ``get_next_batch_to_run`` (after
        this gate), so the server is not idle (the work-conserving rule let a second prefill in
        without the control plane's admit: scheduler review, session 63)."""
        queue = list(getattr(scheduler, "waiting_queue", None) or ())
        if not self.enabled:
            return []
        # the rest were scheduled, aborted, or never queued here (an id the control plane sent for
        # no request of this worker): forgotten at once, an empty queue included
        self.admitted &= {req.rid for req in queue}
        if not queue or self.open:
            return []
        keep: list[tuple[int, Any]] = []
        held: list[tuple[int, Any]] = []
        for item in enumerate(queue):
            (keep if item[1].rid in self.admitted else held).append(item)
        idle = (running_batch.is_empty() and getattr(scheduler, "chunked_req", None) is None and not len(pauser)
                and not prefill_joins(last_batch))
        if not keep and held and idle:
            keep.append(held.pop(0))
            self.local_admits += 1
        if not held:
            return []
        self.held_total += len(held)
        self._positions = {id(req): i for i, req in enumerate(queue)}
        scheduler.waiting_queue = [req for _, req in keep]
        return held

    def restore(self, scheduler: Any, held: list[tuple[int, Any]]) -> None:
        """Put the held requests back; arrival order kept (new entries, e.g. retracted requests,
        go after the ones that were queued before)."""
        if not held:
            return
        end = len(self._positions)
        rest = [(self._positions.get(id(req), end + j), req) for j, req in enumerate(scheduler.waiting_queue)]
        merged = sorted([*held, *rest], key=lambda item: item[0])
        scheduler.waiting_queue = [req for _, req in merged]
