"""``StepBoundary``: the plan installed at a scheduler step boundary, identically on every TP rank.

Called AROUND ``Scheduler.get_next_batch_to_run`` (:mod:`sglang_ext.scheduler_hooks`):

* :meth:`StepBoundary.apply` (before SGLang builds the batch): rank 0 turns the decisions in its
  :class:`~sglang_ext.decision_inbox.DecisionInbox` into one
  :class:`~sglang_ext.tp_sync.StepInstall`, broadcast to every rank
  (:class:`~sglang_ext.tp_sync.TpSync`); each rank installs the placements' policy
  (:class:`~sglang_ext.tp_sync.PlacementInstaller`), opens the admission gate for the admitted
  requests, pauses / resumes requests keeping their KV (:class:`~sglang_ext.pause.PauseManager`).
  Local rules: the running batch is never left empty while requests are parked (they are all
  resumed; under the overlap loop a request its in-flight step finishes by length counts as
  gone), so paused KV never idles a server, and a pause that would empty it is skipped
  (``would_idle``) rather than undone at once; without a control plane (fallback) nothing is
  paused and every parked request is resumed, since only the controller would resume them. A quiet single-rank boundary (nothing received,
  nobody paused or waiting to be, the fallback state unchanged) installs nothing.
* :meth:`StepBoundary.after_schedule` (SGLang allocated this step's KV): the residency wants go
  to the layered pool unless the policy is unchanged since the last install.

What the boundary did is kept in :attr:`StepBoundary.record` for the step's stats line (admitted,
paused, resumed, pauses asked for and not applied by reason, decision, install delta). A record
no processed step took before the next boundary is carried into the next one
(:func:`merged_record`), not overwritten: SGLang's overlap loop processes no step after the
boundary that follows an idle iteration (``last_batch`` is None there), e.g. when every running
request finishes in the step in flight and the parked ones are resumed a boundary later.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

import structlog

from sglang_ext.admission import AdmissionGate, prefill_joins
from sglang_ext.control_client import ControlClient
from sglang_ext.decision_inbox import DecisionInbox
from sglang_ext.pause import PauseManager
from sglang_ext.step_stats_writer import stats_dict
from sglang_ext.tp_sync import PlacementInstaller, StepInstall, TpSync

log = structlog.get_logger(__name__)

_QUIET_BOUNDARY: Mapping[str, Any] = MappingProxyType({
    "admitted_now": [],
    "paused_now": [],
    "resumed_now": [],
    "pauses_skipped": {},
    "decision": None,
})
"""What a boundary that installs nothing did (copied per step: the stats line extends it)."""

_LISTS = ("admitted_now", "paused_now", "resumed_now")
_LEVELS = frozenset({"shortfall_layer_pages"})
"""Install fields that are a state after the install, not a count of moves: the latest one holds
(two boundaries leaving the same pages short are not twice as short)."""


def merged_record(first: Mapping[str, Any], then: Mapping[str, Any]) -> dict[str, Any]:
    """Two boundaries' records as one: requests admitted, paused and resumed in order, skipped
    pauses and install moves summed by key (a level, :data:`_LEVELS`, the latest), decisions
    joined, ``fallback`` the latest."""
    out = dict(first)
    out.update(then)
    for key in _LISTS:
        if key in first and key in then:
            out[key] = [*first[key], *then[key]]
    for key in ("pauses_skipped", "install_delta"):
        a, b = first.get(key), then.get(key)
        if a and b:
            out[key] = {k: b[k] if k in _LEVELS and k in b else a.get(k, 0) + b.get(k, 0)
                        for k in dict.fromkeys([*a, *b])}
        elif key in out:
            out[key] = a or b
    decisions = [d for d in (first.get("decision"), then.get("decision")) if d]
    if "decision" in out:
        out["decision"] = ",".join(decisions) or None
    return out


def _carries(record: Mapping[str, Any]) -> bool:
    """Whether a record holds anything a stats line would miss (a quiet one does not)."""
    return any(record.get(k) for k in (*_LISTS, "pauses_skipped", "install_delta", "decision"))


class StepBoundary:
    """Installs the control plane's decisions at step boundaries (one per scheduler, every rank)."""

    def __init__(
        self,
        *,
        tp: TpSync,
        installer: PlacementInstaller,
        pauser: PauseManager,
        admission: AdmissionGate,
        inbox: DecisionInbox,
        client: ControlClient | None,
        pages_of: Callable[[Any], Sequence[int]],
        keep_record: bool = False,
        finishing_in_flight: Callable[[Any], Sequence[Any]] | None = None,
    ) -> None:
        self.tp = tp
        self.installer = installer
        self.pauser = pauser
        self.admission = admission
        self.inbox = inbox
        self.client = client
        self.pages_of = pages_of
        self.keep_record = keep_record
        """A stats line takes the records (:meth:`take_record`, TP rank 0 with a stats file):
        build the install record even without a layered pool, and carry a record no line took.
        False: nothing is carried (no line would ever take it)."""
        self.finishing_in_flight = finishing_in_flight
        """The running batch's requests that the step in flight finishes by length (SGLang's
        overlap loop drops them from the next batch); None: none are known."""
        self.record: dict[str, Any] = {}
        """What the last boundary did (admitted, paused, resumed, decision, install delta)."""
        self._carried: dict[str, Any] = {}
        """Earlier boundaries' records no stats line took yet (:meth:`take_record`)."""

    def compose(self, step: int) -> StepInstall:
        """Rank 0: the decisions received since the last boundary -> one install for ``step + 1``."""
        inbox = self.inbox
        if self.client is not None:
            inbox.receive(self.client.poll())
        decisions = inbox.take()
        pause: dict[str, None] = dict.fromkeys(inbox.deferred_pause)
        resume: dict[str, None] = {}
        admit: dict[str, None] = {}
        prefill_layers: dict[str, int] = {}
        placements = recompute = None
        reasons: list[str] = []
        for d in decisions:
            admit.update(dict.fromkeys(d.admit))
            prefill_layers.update(d.min_gpu_layers)
            for rid in d.pause:
                resume.pop(rid, None)
                pause[rid] = None
                inbox.deferred_pause.setdefault(rid, step)
            for rid in d.resume:
                pause.pop(rid, None)
                inbox.deferred_pause.pop(rid, None)
                resume[rid] = None
            placements = dict(d.plan.placements)
            layers = d.plan.recompute_layers  # docs/recompute.md: u > 0 only, k alongside
            recompute = {rid: (int(u), int(layers.get(rid, 0))) for rid, u in d.plan.recompute_blocks.items()}
            reasons.append(d.reason)
        fallback = bool(self.client is not None and self.client.in_fallback)
        if fallback:  # no control plane to resume them: pause nobody (apply resumes the parked
            pause.clear()  # and drops the deferred pauses)
        return StepInstall(
            step=step + 1,
            pause=tuple(pause),
            resume=tuple(r for r in resume if r in self.pauser),
            placements=placements,
            recompute=recompute or None,
            fallback=fallback,
            reason=",".join(r for r in reasons if r),
            admit=tuple(admit),
            prefill_layers=prefill_layers or None,
        )

    def apply(self, running_batch: Any, last_batch: Any, step: int) -> Any:
        """Apply this step's install before SGLang builds the batch; returns the running batch."""
        if self.keep_record and self.record and _carries(self.record):  # no line took it: carried
            self._carried = merged_record(self._carried, self.record) if self._carried else self.record
        if self._quiet():
            self.record = dict(_QUIET_BOUNDARY, fallback=self.admission.open)
            return running_batch
        install = self.tp.share(self.compose(step) if self.tp.is_source else None)
        self.installer.apply(install)
        self.admission.admit(install.admit)
        self.admission.open = install.fallback
        deferred = self.inbox.deferred_pause
        refill = prefill_joins(last_batch)
        # the running requests the next batch keeps (asked once): none left while some are parked
        # resumes them all rather than idle (below), so a pause that would take the last of them
        # is skipped (would_idle) -- unless a refill or a resume in this install keeps it going
        live = None if refill or not (install.pause or len(self.pauser)) else self._live(running_batch)
        guard = None if live is None or install.resume or not install.pause else {  # built only for a
            i for i, req in live.items() if not self.pauser.ends_soon(req)}  # pause; ending soon: not kept
        paused = self.pauser.pause(running_batch, install.pause, step + 1, keep_one_of=guard)
        for rid in (*paused, *self.pauser.last_dropped):  # a pause skipped for good is dropped: the
            deferred.pop(rid, None)  # request may run alone for its whole generation
        running_batch, resumed = self.pauser.resume(running_batch, install.resume)
        if install.fallback:
            # without a control plane nothing would resume a parked request (OrbitFlow's pause is
            # the controller's, bounded by its policy): every rank resumes them all, and drops
            # the pauses that waited for a request to join the batch
            deferred.clear()
            if len(self.pauser):
                running_batch, more = self.pauser.resume_all(running_batch)
                resumed += more
        if len(self.pauser) and live is not None and not resumed and live.keys().isdisjoint(map(id, running_batch.reqs)):
            # idle (finished requests are filtered next): resume everyone rather than idle
            running_batch, more = self.pauser.resume_all(running_batch)
            resumed += more
        # A deferred pause waits for its request to join the running batch (it may still be
        # prefilling); it is dropped once the request is gone.
        if deferred:
            alive = {r.rid for r in running_batch.reqs}
            if refill:
                alive |= {r.rid for r in last_batch.reqs}
            for rid in list(deferred):
                if rid not in alive and rid not in self.pauser:
                    del deferred[rid]
        self.record = {
            "admitted_now": list(install.admit),
            "paused_now": paused,
            "resumed_now": resumed,
            "pauses_skipped": self.pauser.last_skipped,
            "decision": install.reason or None,
            "fallback": install.fallback,
        }
        return running_batch

    def _live(self, running_batch: Any) -> dict[int, Any]:
        """The running requests the next batch keeps, by ``id()``: not finished, and not
        finished by length in the step in flight (the overlap loop). Empty: the next batch would
        be empty. Without the second case the overlap loop idled one iteration (no batch; SGLang
        skips decoding while the in-flight step finishes them) before the parked requests were
        resumed."""
        left = {id(req): req for req in running_batch.reqs if not req.finished()}
        if left and self.finishing_in_flight is not None:
            for req in self.finishing_in_flight(running_batch):
                left.pop(id(req), None)
        return left

    def _quiet(self) -> bool:
        """Single rank, nothing to install: no decision received, nobody paused or waiting to
        be, the fallback state unchanged. Then the full boundary would change nothing."""
        inbox = self.inbox
        if self.tp.world_size != 1 or inbox.pending or inbox.deferred_pause or len(self.pauser):
            return False
        if self.client is None:
            return False
        inbox.receive(self.client.poll())
        return not inbox.pending and self.client.in_fallback == self.admission.open

    def after_schedule(self, plan: Any, step: int) -> None:
        """SGLang allocated this step's KV: install the residency wants (layered pool only)."""
        installer = self.installer
        if not installer.layered and not self.keep_record:
            return
        live: dict[str, Any] = {}
        running, to_run = getattr(plan, "running_batch", None), getattr(plan, "batch_to_run", None)
        for batch in (running, None if to_run is running else to_run):
            if batch is None:
                continue
            for req in batch.reqs:
                if not req.finished():
                    live.setdefault(req.rid, req)
        parked = {p.req.rid: p.req for p in self.pauser.parked()} if len(self.pauser) else {}
        if installer.unchanged(live, parked):
            self.record["install_delta"] = None  # steady state: nothing to install
            return
        try:  # the pages of the requests whose wants changed only
            delta = installer.install(live, parked, self.pages_of)
        except Exception:  # a failed install keeps the previous residency; never fail the step
            log.exception("residency_install_failed", step=step + 1)
            delta = None
        self.record["install_delta"] = stats_dict(delta)

    def note_resumed(self, rids: Sequence[str]) -> None:
        """Requests resumed outside a boundary (an abort, a retraction: :mod:`sglang_ext.parked_lifecycle`,
        which counts them in the metrics itself): the next stats line lists them too."""
        if rids and self.keep_record:  # only a stats line takes the carry (else it would grow)
            self._carried = merged_record(self._carried, {"resumed_now": list(rids)})

    def take_record(self) -> dict[str, Any]:
        """What the boundaries did since the last call (for the stats line: the last one's record
        with any earlier one no line took merged in front); the record restarts."""
        record, self.record = self.record, {}
        if self._carried:
            record, self._carried = merged_record(self._carried, record), {}
        return record
