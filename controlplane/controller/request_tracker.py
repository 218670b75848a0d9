"""Per-request state of one worker: context, progress, pause state and token deposit.

The controller owns the pause state: a request is paused from the moment a decision pausing it is
made until a decision resumes it. The worker's ``RequestState.paused`` flag is telemetry; a flag
that disagrees with the controller while no decision about that request is outstanding is a
pause/resume the worker made on its own (e.g. SGLang retracting a request under memory pressure),
which the controller adopts and treats as a batch change. A decision is outstanding until the
worker shows it or until ``APPLY_SLACK_STEPS`` after the step it was delivered for
(:meth:`RequestTracker.delivered`), or until the worker reports the pause dropped
(``StepReport.pauses_dropped``): a pause the worker never applies (it drops some for good,
``sglang_ext/pause.py``) was awaited forever, the request counted as paused while it decoded
(control-plane review, session 78).

A request whose decided pause lapsed, or that the worker reports dropped, is *held* running for a
while (:meth:`RequestTracker.held`):
planned again as a victim at once, its pause was dropped again and the controller re-planned every
third step for as long as it decoded (a batch feature such as a custom logit processor makes every
pause of a batch drop; session 79). The hold doubles with each lapse of the same request, from
``HOLD_STEPS`` up to ``HOLD_MAX_STEPS``: a pause dropped for a passing reason (``would_idle``) is
tried again soon, one dropped for good rarely; it starts from ``HOLD_STEPS`` again once a pause of
the request applies.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from controlplane.api import InvalidArgument, StepReport
from controlplane.controller.schedulers.base import RequestView
from controlplane.controller.token_deposit import TokenDeposit


@dataclass
class TrackedRequest:
    """Mutable record of one decoding request (internal to the controller)."""

    id: str
    context_tokens: int
    generated_tokens: int
    own_slo_tbt_ms: float | None
    first_seen_ms: float
    run_since_ms: float
    last_token_ms: float
    max_new_tokens: int | None
    deposit: TokenDeposit
    paused_since_step: int | None = None
    pause_reason: str = ""
    gpu_layers: int | None = None
    """Resident layers the worker last reported (telemetry)."""

    @property
    def paused(self) -> bool:
        return self.paused_since_step is not None


@dataclass(frozen=True)
class BatchEvents:
    """What changed in the batch with one report."""

    arrived: tuple[str, ...] = ()
    """Requests seen decoding for the first time."""
    finished: tuple[str, ...] = ()
    """Requests that finished (or disappeared from the report)."""
    worker_paused: tuple[str, ...] = ()
    """Requests the worker paused on its own."""
    worker_resumed: tuple[str, ...] = ()
    """Requests the worker resumed on its own."""
    generated_tokens: dict[str, int] = field(default_factory=dict)
    """Tokens generated per request since the previous report."""

    @property
    def batch_changed(self) -> bool:
        return bool(self.arrived or self.finished or self.worker_paused or self.worker_resumed)


APPLY_SLACK_STEPS = 1
"""Steps past the step it was delivered for that a decided pause or resume may take to show in the
worker's reports (slack for SGLang's overlap loop); after them the worker's own flag stands."""


HOLD_STEPS = 16
"""Steps a request whose decided pause lapsed (or was reported dropped) is held running, after its
first lapse."""
HOLD_MAX_STEPS = 1024
"""Ceiling of that hold (it doubles with each lapse of the same request)."""


class RequestTracker:
    """The decoding requests of one worker. Not thread-safe (the controller holds its lock)."""

    def __init__(self) -> None:
        self._requests: dict[str, TrackedRequest] = {}
        self._awaiting_flag: dict[str, tuple[bool, int | None]] = {}
        """Decided pause state the worker has not shown yet, and the step it is due at (None:
        not delivered yet)."""
        self._holds: dict[str, tuple[int, int]] = {}
        """Requests whose decided pause lapsed or was reported dropped: lapses so far, and the last
        step they are held running to."""

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._requests

    def __len__(self) -> int:
        """Requests tracked, running or paused."""
        return len(self._requests)

    def get(self, request_id: str) -> TrackedRequest | None:
        return self._requests.get(request_id)

    def running(self) -> list[TrackedRequest]:
        """Decoding, not paused, in arrival order."""
        return [r for r in self._requests.values() if not r.paused]

    def has_running(self) -> bool:
        """Whether any request is decoding (cheaper than ``bool(running())``)."""
        return any(r.paused_since_step is None for r in self._requests.values())

    def has_paused(self) -> bool:
        """Whether any request is paused (cheaper than ``bool(paused())``)."""
        return any(r.paused_since_step is not None for r in self._requests.values())

    def paused(self) -> list[TrackedRequest]:
        """Paused, longest-paused first."""
        out = [r for r in self._requests.values() if r.paused]
        out.sort(key=lambda r: (r.paused_since_step or 0, r.id))
        return out

    def ingest(self, report: StepReport, default_slo_tbt_ms: float) -> BatchEvents:
        """Apply one report: arrivals, finishes, progress, deposits, worker-made pause changes.

        Runs on every report the worker sends (every few steps): one validation pass, then one
        pass that touches each running request's record once."""
        now = report.now_ms
        requests = self._requests
        awaiting = self._awaiting_flag
        arrived: list[str] = []
        worker_paused: list[str] = []
        worker_resumed: list[str] = []
        generated: dict[str, int] = {}
        ended = set(report.finished)
        finished = [rid for rid in dict.fromkeys(report.finished) if rid in requests] if ended else []
        seen = self._check(report)  # validate everything before changing anything
        dropped = set(report.pauses_dropped) if report.pauses_dropped else None
        for rs in report.running:
            rid = rs.id
            if ended and rid in ended:
                continue
            slo = rs.slo_tbt_ms if rs.slo_tbt_ms is not None else default_slo_tbt_ms
            known = requests.get(rid)
            new = known is None
            if known is not None:
                tracked = known
            else:
                # Tokens generated before the controller saw the request were delivered by the
                # worker already; pacing continues from now (and costs O(1), not O(tokens)).
                tracked = requests[rid] = TrackedRequest(
                    id=rid,
                    context_tokens=rs.context_tokens,
                    generated_tokens=rs.generated_tokens,
                    own_slo_tbt_ms=rs.slo_tbt_ms,
                    first_seen_ms=now,
                    run_since_ms=now,
                    last_token_ms=now,
                    max_new_tokens=rs.max_new_tokens,
                    deposit=TokenDeposit(
                        slo,
                        delivered_tokens=rs.generated_tokens,
                        last_delivery_ms=now if rs.generated_tokens else None,
                    ),
                )
                arrived.append(rid)
                if rs.paused:
                    tracked.paused_since_step = report.step
                    tracked.pause_reason = "worker"
            delta = rs.generated_tokens - tracked.generated_tokens
            tracked.context_tokens = rs.context_tokens
            tracked.gpu_layers = rs.gpu_layers
            tracked.max_new_tokens = rs.max_new_tokens
            deposit = tracked.deposit
            if deposit.slo_tbt_ms != slo:
                deposit.set_slo(slo)
            if delta:
                deposit.generate(now, delta, deliveries=False)
                tracked.generated_tokens = rs.generated_tokens
                tracked.last_token_ms = now
                generated[rid] = delta
            else:
                deposit.advance(now, deliveries=False)
            # Reconcile the worker's pause flag with the controller's state.
            want = awaiting.get(rid) if awaiting else None
            drop = dropped is not None and rid in dropped and not rs.paused  # said so: no waiting
            if want is not None:
                due = want[1]
                if (
                    rs.paused != want[0]
                    and (due is None or report.step <= due + APPLY_SLACK_STEPS)
                    and not (drop and want[0])
                ):
                    continue  # decided, not applied yet
                # shown; or dropped; or not applied when due (the worker drops some pauses for
                # good, sglang_ext/pause.py): its flag stands, as one it set on its own
                del awaiting[rid]
                drop = drop or (want[0] and not rs.paused)
                if want[0] and rs.paused and self._holds:  # its pauses apply again: the next
                    self._holds.pop(rid, None)  # drop starts a hold from HOLD_STEPS (review, s79)
            if drop:
                self._hold(rid, report.step)
            if not new and rs.paused != (tracked.paused_since_step is not None):
                if rs.paused:
                    tracked.paused_since_step = report.step
                    tracked.pause_reason = "worker"
                    worker_paused.append(rid)
                else:
                    tracked.paused_since_step = None
                    tracked.run_since_ms = now
                    worker_resumed.append(rid)
        # A request that vanished without a finish notice is gone all the same.
        if not requests.keys() <= seen:
            listed = set(finished)
            finished.extend(rid for rid in requests if rid not in seen and rid not in listed)
        for rid in finished:
            gone = requests.pop(rid)
            gone.deposit.finish(now, deliveries=False)
            awaiting.pop(rid, None)
            self._holds.pop(rid, None)
        return BatchEvents(
            tuple(arrived), tuple(finished), tuple(worker_paused), tuple(worker_resumed), generated
        )

    def _check(self, report: StepReport) -> set[str]:
        """Validate ``report``'s running requests; returns their ids."""
        seen: set[str] = set()
        ended = report.finished
        requests = self._requests
        for i, rs in enumerate(report.running):
            if rs.id in seen:
                raise InvalidArgument(f"running[{i}].id: duplicate request id {rs.id!r}")
            seen.add(rs.id)
            if ended and rs.id in ended:
                continue
            if rs.context_tokens < 1:
                raise InvalidArgument(
                    f"running[{i}].context_tokens: {rs.context_tokens} is out of range (allowed >= 1)"
                )
            if rs.generated_tokens < 0:
                raise InvalidArgument(
                    f"running[{i}].generated_tokens: {rs.generated_tokens} is out of range "
                    "(allowed >= 0)"
                )
            if rs.slo_tbt_ms is not None and not rs.slo_tbt_ms > 0:
                raise InvalidArgument(
                    f"running[{i}].slo_tbt_ms: {rs.slo_tbt_ms} is out of range (allowed > 0)"
                )
            tracked = requests.get(rs.id)
            if tracked is not None and rs.generated_tokens < tracked.generated_tokens:
                raise InvalidArgument(
                    f"running[{i}].generated_tokens: {rs.generated_tokens} is below the "
                    f"{tracked.generated_tokens} reported before (must not decrease)"
                )
        return seen

    def pause(self, request_id: str, step: int, reason: str) -> bool:
        """Mark paused by a decision; False when unknown or already paused."""
        r = self._requests.get(request_id)
        if r is None or r.paused:
            return False
        r.paused_since_step = step
        r.pause_reason = reason
        self._awaiting_flag[request_id] = (True, None)
        return True

    def resume(self, request_id: str, now_ms: float) -> bool:
        """Mark resumed by a decision; False when unknown or not paused."""
        r = self._requests.get(request_id)
        if r is None or not r.paused:
            return False
        r.paused_since_step = None
        r.pause_reason = ""
        r.run_since_ms = now_ms
        self._awaiting_flag[request_id] = (False, None)
        return True

    def delivered(self, request_ids: Iterable[str], step: int) -> None:
        """A decision pausing or resuming ``request_ids`` reached the worker to apply at ``step``
        (a plan made on the planning thread is delivered with a later report: until then it is
        awaited whatever the reports say)."""
        awaiting = self._awaiting_flag
        for rid in request_ids:
            want = awaiting.get(rid)
            if want is not None and (want[1] is None or want[1] < step):
                awaiting[rid] = (want[0], step)

    def _hold(self, request_id: str, step: int) -> None:
        lapses = self._holds.get(request_id, (0, 0))[0] + 1
        self._holds[request_id] = (lapses, step + min(HOLD_STEPS << (lapses - 1), HOLD_MAX_STEPS))

    def held(self, step: int) -> frozenset[str]:
        """Running requests whose decided pause lapsed within their hold at ``step``: decisions
        do not pause them (the planner pauses others first, ``Planner.plan(keep=...)``)."""
        holds = self._holds
        if not holds:
            return frozenset()
        requests = self._requests
        return frozenset(
            rid
            for rid, (_, until) in holds.items()
            if until >= step and (r := requests.get(rid)) is not None and not r.paused
        )

    def view(self, r: TrackedRequest, step: int, default_slo_tbt_ms: float) -> RequestView:
        """The immutable view a scheduler and the planner input see."""
        return RequestView(
            id=r.id,
            context_tokens=r.context_tokens,
            generated_tokens=r.generated_tokens,
            slo_tbt_ms=r.own_slo_tbt_ms if r.own_slo_tbt_ms is not None else default_slo_tbt_ms,
            first_seen_ms=r.first_seen_ms,
            run_since_ms=r.run_since_ms,
            last_token_ms=r.last_token_ms,
            deposit_tokens=r.deposit.balance,
            paused=r.paused,
            paused_steps=0 if r.paused_since_step is None else max(0, step - r.paused_since_step),
            max_new_tokens=r.max_new_tokens,
            gpu_layers=r.gpu_layers,
        )
