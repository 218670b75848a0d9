"""``StepReporter``: TP rank 0's per-step telemetry to the control plane, coalesced.

After ``Scheduler.process_batch_result`` (:mod:`sglang_ext.scheduler_hooks`) the reporter builds
a :class:`~controlplane.api.StepReport` -- running requests (paused ones included, with their GPU
layers and SLOs), the queue with first-seen arrival times, the finished requests, the mean
observed decode step time since the last report, the sampled per-layer times, the host -> device
bandwidth the data plane's copies achieved since the last report (bytes over the seconds its
clock measured them, :class:`~sglang_ext.dataplane.transfer_times.TransferTimes`; sent when at
least :data:`MIN_H2D_SAMPLE_BYTES` over :data:`MIN_H2D_SAMPLE_SECONDS` were timed; CUDA only,
``LayeredKVCore.link_account``), the free GPU blocks and the pauses the data plane dropped since
the last report (``pauses_dropped``: such a report is never coalesced) -- and sends it; the decisions it gets back go to the
:class:`~sglang_ext.decision_inbox.DecisionInbox` for the next boundary.

Steady decode steps are coalesced (:meth:`StepReporter._coalesce`), up to
``--kv-report-interval`` per report; any change is reported the step it happens. A *quiet*
stretch is coalesced up to ``--kv-report-quiet-interval`` steps instead: every running request
on the GPU at every layer, nothing recomputed, no decision since the last report that offloads,
recomputes, pauses or resumes anything, and the mean decode step steady (within
:data:`QUIET_DRIFT` of the last report's for :data:`QUIET_AFTER` reports in a row, and in the
last ``--kv-report-interval`` steps). With nothing to move the controller has nothing to
re-place, and its profile has seen that step time already. A stretch whose recent steps drift
goes back to the base interval at once (reported as soon as ``--kv-report-interval`` steps have
passed since the last report). The controller's profile-mismatch trigger (OrbitFlow §3.4) then
sees a change within about one interval of when it did before: the report's mean still holds
the quiet steps before the change, so a change of 20-30% may need the next report to cross the
controller's threshold.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Any

from controlplane.api import QueuedRequest, RequestState, StepReport
from sglang_ext.admission import request_slo
from sglang_ext.control_client import ControlClient
from sglang_ext.decision_inbox import DecisionInbox
from sglang_ext.pause import PauseManager
from sglang_ext.tp_sync import PlacementInstaller

MIN_H2D_SAMPLE_BYTES = 1 << 20
"""Fewer H2D bytes timed since the last sample send none (a few small copies time their start-up,
not the link)."""
MIN_H2D_SAMPLE_SECONDS = 1e-3
"""...nor less time timed (one short copy of a large launch)."""
QUIET_DRIFT = 0.1
"""A steady stretch is quiet while its mean decode step stays within this fraction of the last
report's (half the controller's default ``mismatch_threshold``, 0.2)."""
QUIET_AFTER = 2
"""Reports in a row whose mean decode step stayed within :data:`QUIET_DRIFT` of the one before
them, before a stretch may be quiet (the controller has then seen that step time three times)."""


class StepReporter:
    """Builds and sends one scheduler's step reports (TP rank 0)."""

    def __init__(
        self,
        *,
        scheduler: Any,
        client: ControlClient,
        inbox: DecisionInbox,
        pauser: PauseManager,
        installer: PlacementInstaller,
        pool: Any,
        layers: int,
        page_size: int,
        report_interval: int,
        quiet_interval: int | None = None,
        t0: float | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.client = client
        self.inbox = inbox
        self.pauser = pauser
        self.installer = installer
        self.pool = pool
        self.layers = layers
        self.page_size = page_size
        self.report_interval = report_interval
        self.quiet_interval = report_interval if quiet_interval is None else max(quiet_interval, report_interval)
        """Steady decode steps per report in a quiet stretch (module docstring); None: as
        ``report_interval``."""
        self._t0 = time.monotonic() if t0 is None else t0
        self._first_seen_ms: dict[str, float] = {}
        self._fixed: dict[str, tuple[Any, int, int | None, float | None]] = {}
        """Per running request, what a report reads of it that never changes: ``(req, prompt
        tokens, max_new_tokens, own TBT SLO)`` (the request object guards against a reused rid;
        entries of requests no longer reported are dropped, :meth:`_report`)."""
        # coalescing state (see _coalesce)
        self._decode_ms = 0.0
        self._decode_steps = 0
        self._layer_ms: tuple[float, ...] | None = None
        self._sent_step = 0
        self._sent_rids: tuple[str, ...] = ()
        self._h2d_sent = (0, 0.0)
        """H2D bytes and seconds the data plane had timed at the last report."""
        self._sent_ms: float | None = None
        """The mean decode step of the last report that had one."""
        self._steady_reports = 0
        """Reports in a row whose mean decode step stayed within QUIET_DRIFT of the one before."""
        self._all_gpu = False
        """The last report's running requests were all on the GPU at every layer, none paused
        or recomputing."""
        self._sent_decisions = 0
        """``inbox.received_offloading`` at the last report."""
        self._recent: collections.deque[float] = collections.deque(maxlen=report_interval)
        """The last ``report_interval`` decode step times (ms): a quiet stretch's drift is judged
        on them, not on the whole stretch, whose mean a change dilutes."""
        self._expiry_reported: int | None = None
        """The installed plan's expiry step when a report at or after it was sent (None: none)."""
        self.coalesced_quiet = False
        """The last step was coalesced past ``report_interval`` steps (the quiet cadence)."""
        self.reports = 0
        """Reports sent to the control plane."""

    def end_step(
        self,
        batch: Any,
        *,
        step: int,
        finished: tuple[str, ...],
        is_decode: bool,
        step_ms: float | None,
        layer_ms: tuple[float, ...] | None,
        build_always: bool,
    ) -> tuple[StepReport | None, bool]:
        """Account step ``step``; send its report unless it is coalesced. Returns the report
        (built when sent or when ``build_always``, e.g. for the stats line; else None) and
        whether it was sent."""
        if is_decode and step_ms is not None:
            self._decode_ms += step_ms
            self._decode_steps += 1
            self._recent.append(step_ms)
        if layer_ms is not None:
            self._layer_ms = layer_ms
        send = not self._coalesce(batch, step, finished, is_decode)
        if not send and not build_always:
            return None, False
        observed = self._decode_ms / self._decode_steps if self._decode_steps else None
        report = self._report(batch, step, finished, observed)
        if self._layer_ms is not None:
            report = dataclasses.replace(report, layer_compute_ms=self._layer_ms)
        if send and (gbps := self._h2d_gbps()) is not None:
            report = dataclasses.replace(report, h2d_gbps=gbps)
        if send and self.pauser.has_unreported_drops:
            report = dataclasses.replace(report, pauses_dropped=self.pauser.take_dropped())
        if send:
            self._sent(report, observed)
            inbox = self.inbox
            self._sent_decisions = inbox.received_offloading  # one in the answer ends quiet
            if step >= inbox.expiry_step:  # this report tells the controller the plan expired
                self._expiry_reported = inbox.expiry_step
            inbox.receive(self.client.report(report))
            self._decode_ms, self._decode_steps, self._layer_ms = 0.0, 0, None
            # the running requests the controller now knows of (a prefill's report names the
            # running batch too, so the decode step that merges them is no batch change; parked
            # ones are left out, so a resume is one)
            self._sent_step = step
            self._sent_rids = tuple([r.id for r in report.running if not r.paused])
            self.reports += 1
        return report, send

    def _sent(self, report: StepReport, observed: float | None) -> None:
        """What the quiet cadence keeps of a report about to be sent (module docstring)."""
        if self.quiet_interval == self.report_interval:
            return
        if observed is not None:
            last = self._sent_ms
            steady = last is not None and abs(observed - last) <= QUIET_DRIFT * last
            self._steady_reports = self._steady_reports + 1 if steady else 0
            self._sent_ms = observed
        layers, installer = self.layers, self.installer
        self._all_gpu = bool(report.running) and not any(
            r.paused or (r.gpu_layers is not None and r.gpu_layers != layers) for r in report.running
        ) and not (installer.uncached and any(installer.uncached.get(r.id) for r in report.running))

    def _quiet(self) -> bool:
        """This steady stretch may wait up to ``quiet_interval`` steps (module docstring)."""
        sent, recent = self._sent_ms, self._recent
        if (not self._all_gpu or self._steady_reports < QUIET_AFTER or sent is None or not recent
                or self.installer.uncached or self.inbox.received_offloading != self._sent_decisions):
            return False
        return abs(sum(recent) / len(recent) - sent) <= QUIET_DRIFT * sent

    def _h2d_gbps(self) -> float | None:
        """The H2D bandwidth of the copies timed since the last sample (None: too few bytes yet,
        or not the layered pool)."""
        times = getattr(getattr(self.pool, "core", None), "link_account", None)
        if times is None:
            return None
        nbytes, seconds = times.h2d_timed_bytes, times.h2d_timed_s  # measured, not estimated (sampling)
        moved, took = nbytes - self._h2d_sent[0], seconds - self._h2d_sent[1]
        if moved < MIN_H2D_SAMPLE_BYTES or took < MIN_H2D_SAMPLE_SECONDS:
            return None  # kept for the next report's sample
        self._h2d_sent = (nbytes, seconds)
        return moved / took / 1e9

    @staticmethod
    def _rids(batch: Any) -> tuple[str, ...]:
        return tuple(r.rid for r in batch.reqs)

    def _coalesce(self, batch: Any, step: int, finished: tuple[str, ...], is_decode: bool) -> bool:
        """Whether this step's report may wait for the next one (``--kv-report-interval``, or
        ``--kv-report-quiet-interval`` in a quiet stretch: :meth:`_quiet`).

        Only a steady decode step waits: the same requests (in order) as the last report's
        running ones, nothing finished, queued or paused, no pause dropped, the installed plan's
        expiry not reached since the last report, the control plane reachable, fewer than
        ``interval`` steps since the last report. Everything the controller acts on (OrbitFlow
        §3.4's batch-change and expiry triggers, admissions, pause state, outages) is therefore
        reported the step it happens; a steady stretch reaches it as one report with the mean decode step time (the
        profile-mismatch trigger sees it at most ``interval - 1`` steps late, or
        ``quiet_interval - 1`` in a quiet stretch) and each request's tokens generated since. An
        expiry is reported once when the next decision can arrive by ``poll`` (the controller
        fires no second expiry while it plans): the steps after it wait as usual
        (:meth:`_expiry_waits`).
        """
        inbox = self.inbox
        gap = step - self._sent_step
        quiet = gap >= self.report_interval
        coalesce = (
            is_decode
            and not finished
            and (not quiet or (gap < self.quiet_interval and self._quiet()))
            and (step < inbox.expiry_step or self._expiry_waits())
            and not self.scheduler.waiting_queue
            and not len(self.pauser)
            and not self.pauser.has_unreported_drops
            and not inbox.deferred_pause
            and not inbox.pending
            and not self.client.in_fallback
            and self._rids(batch) == self._sent_rids
        )
        self.coalesced_quiet = quiet and coalesce
        return coalesce

    def _expiry_waits(self) -> bool:
        """The installed plan has expired: a step may wait only once a report told the controller
        of this very expiry and its next decision will arrive by ``poll`` at a boundary (a
        control plane that answers only reports is reported to every step, as is an expiry that
        a stale decision brought back)."""
        return self.inbox.expiry_step == self._expiry_reported and self.client.can_poll

    def _now_ms(self) -> float:
        return (time.monotonic() - self._t0) * 1e3

    def _report(self, batch: Any, step: int, finished: tuple[str, ...], step_ms: float | None) -> StepReport:
        s = self.scheduler
        chunked = getattr(s, "chunked_req", None)
        pauser = self.pauser
        paused_any = len(pauser) > 0
        seen: dict[str, RequestState] = {}
        running = getattr(s.running_batch, "reqs", ())
        # steady decode runs the running batch itself: its requests once, not twice
        live = batch.reqs if running is batch.reqs else [*running, *batch.reqs]
        state = self._state
        # a request SGLang retracted since the batch ran is back in the queue: queued, not running
        waiting = {r.rid for r in s.waiting_queue} if s.waiting_queue else ()
        for req in live:
            rid = req.rid
            if rid in seen or req.finished() or req is chunked or (paused_any and rid in pauser) or rid in waiting:
                continue
            seen[rid] = state(req, False)
        if paused_any:
            for parked in pauser.parked():
                seen[parked.req.rid] = state(parked.req, True)
        fixed = self._fixed
        if len(fixed) > len(seen):  # requests gone since: forget what was read of them
            self._fixed = {rid: fixed[rid] for rid in seen if rid in fixed}
        now = self._now_ms()
        queued = []
        if s.waiting_queue or self._first_seen_ms:
            self._first_seen_ms = {k: v for k, v in self._first_seen_ms.items() if k in waiting}
        for req in s.waiting_queue:
            arrival = self._first_seen_ms.setdefault(req.rid, now)
            queued.append(
                QueuedRequest(id=req.rid, prompt_tokens=max(1, len(req.origin_input_ids)), arrival_ms=arrival)
            )
        return StepReport(
            step=step,
            now_ms=now,
            running=tuple(seen.values()),
            queued=tuple(queued),
            observed_step_ms=step_ms,
            finished=finished,
            free_gpu_blocks=self._free_blocks(),
        )

    def _state(self, req: Any, paused: bool) -> RequestState:
        rid = req.rid
        fixed = self._fixed.get(rid)
        if fixed is None or fixed[0] is not req:
            max_new = getattr(req.sampling_params, "max_new_tokens", None)
            fixed = self._fixed[rid] = (req, len(req.origin_input_ids), int(max_new) if max_new else None,
                                        request_slo(req))
        installer = self.installer
        gpu = (0 if paused else installer.gpu_layer_count(rid)) if installer.layered else None
        out = len(req.output_ids)
        # positional, in RequestState's field order: id, context, generated, SLO, paused, GPU
        # layers, max_new_tokens (a report builds one per running request)
        return RequestState(rid, max(1, fixed[1] + out), out, fixed[3], paused, gpu, fixed[2])

    def _free_blocks(self) -> int | None:
        if self.installer.layered and hasattr(self.pool, "free_device_pages"):
            return int(self.pool.free_device_pages())
        try:
            free_pages = int(self.scheduler.token_to_kv_pool_allocator.available_size()) // self.page_size
        except Exception:
            return None
        return free_pages * self.layers
