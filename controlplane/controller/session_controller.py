"""One worker's adaptive controller (OrbitFlow §3.4): triggers, profile, deposits, pause/resume.

``report(step_report)`` ingests one step's telemetry and returns the decisions that are ready.
It re-plans when

* ``batch-change``: a request arrived, finished, or the worker paused/resumed one on its own;
* ``expiry``: ``report.step >= expiry_step`` of the current plan (the planner's decode window);
* ``profile-mismatch``: ``|observed - predicted| / predicted > policy.mismatch_threshold``, where
  ``predicted`` is the exact timeline of the placement that ran this step under the current
  profile; the profile first moves by one EWMA step (:class:`ProfileTracker`);
* ``policy-change``: the policy version differs from the one the current plan was made with;
* ``starvation``: a paused request reached ``policy.max_paused_steps``;
* ``schedule``: the scheduler (probed cheaply on every report while something is queued, or
  paused under ``lvf``) wants to admit, rotate in or rotate out a request (the same answer
  fires again only ``window_min`` steps after it last fired: one a plan carried out changes);
* ``initial``: the first report with anything to decide.

Paused requests are offered a resume only when a request finished (or nothing runs), OrbitFlow
§3.4; admissions and resumptions stay within the worker's :class:`BatchLimits`.

Asynchronous mode (default): planning runs on the session's own thread, one step ahead
(OrbitFlow §3.3.2); ``report()`` never waits for it and returns the decision with a later report
(or :meth:`poll`). Triggers that fire while a plan is being computed are coalesced into one more
plan computed from the state at the moment the running one finishes. Synchronous mode
(``synchronous=True``, for the simulator) plans inline and returns the decision at once. Decisions
are then a deterministic function of the reports whenever the planner's search does not depend on
the wall clock: give the session a planner whose stages all run to completion and a budget that
does not cut them short, e.g. ``planner=Planner(use_mip=False, exact_search=False),
time_budget_ms=60_000`` (greedy + local search converge on their own), or a batch small enough
for the exact branch and bound to finish (``plan.extras["optimal"]``). ``time_budget_ms`` (both
modes) replaces ``policy.solve_budget_fraction`` of the predicted step as the per-call budget.

Pause state is decided here (see :mod:`.request_tracker`); a decision's pauses and resumes take
effect in the controller's state when the decision is made, so the next plan already accounts
for them even before the worker has applied them.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import structlog

from controlplane.api import Decision, InvalidArgument, StepReport, Unavailable, WorkerInfo
from controlplane.controller.batch_limits import UNLIMITED, BatchLimits
from controlplane.controller.decision_builder import DecisionBuilder, PlannerLike, PlanningInput
from controlplane.controller.metrics import ControllerObserver, NullObserver, SafeObserver
from controlplane.controller.outlier_guard import OutlierGuard
from controlplane.controller.placement_rows import placement_rows
from controlplane.controller.profile_tracker import ProfileTracker, ProfileUpdate
from controlplane.controller.report_validation import validate_report
from controlplane.controller.request_tracker import RequestTracker
from controlplane.controller.schedulers import make_scheduler
from controlplane.controller.session_status import SessionStatus
from controlplane.controller.solver_warmup import warm_up_solver
from controlplane.controller.token_deposit import TokenDeposit
from controlplane.model import gpu_blocks
from controlplane.model.timeline import Recompute
from controlplane.policy import Policy

log = structlog.get_logger(__name__)

ADMIT_GRACE_STEPS = 16
"""Steps an admitted request may stay in the worker's queue before it is considered again."""

class SessionController:
    """Implements :class:`controlplane.api.WorkerSession` in-process for one worker."""

    def __init__(
        self,
        worker: WorkerInfo,
        *,
        policy_source: Callable[[], Policy] | None = None,
        planner: PlannerLike | None = None,
        synchronous: bool = False,
        observer: ControllerObserver | None = None,
        on_close: Callable[[SessionController], None] | None = None,
        time_budget_ms: float | None = None,
        batch_limits: BatchLimits = UNLIMITED,
    ) -> None:
        if len(worker.profile.layer_compute_ms) != worker.model.layers:
            raise InvalidArgument(
                f"worker.profile.layer_compute_ms: has {len(worker.profile.layer_compute_ms)} "
                f"entries, expected model.layers = {worker.model.layers}"
            )
        if worker.scheduler is not None:
            make_scheduler(worker.scheduler, "worker.scheduler")  # validate now, not at first plan
        if planner is None:
            from controlplane.planner import Planner

            planner = Planner()
        self._worker = worker
        self._limits = batch_limits
        self._policy_source = policy_source or Policy
        if time_budget_ms is not None and not time_budget_ms > 0:
            raise ValueError(f"time_budget_ms: {time_budget_ms} is out of range (allowed > 0)")
        self._builder = DecisionBuilder(planner, time_budget_ms=time_budget_ms)
        self._sync = synchronous
        self._observer: ControllerObserver = SafeObserver(observer or NullObserver())
        self._profile = ProfileTracker(
            worker.profile, worker.hardware.h2d_gbps, worker.model.block_bytes, worker.model.block_size
        )
        self._tracker = RequestTracker()
        self._lock = threading.RLock()
        self._settled = threading.Condition(self._lock)
        if not synchronous:
            warm_up_solver()
        self._executor: ThreadPoolExecutor | None = None if synchronous else ThreadPoolExecutor(
            max_workers=1, thread_name_prefix=f"kvplane-plan-{worker.worker_id}")
        self._closed = False
        self._on_close = on_close
        self._last: StepReport | None = None
        self._queued: tuple = ()
        self._admitted: dict[str, int] = {}
        self._current: Decision | None = None  # latest decision made
        self._installed: Decision | None = None  # decision the worker ran the last step with
        self._checked: Decision | None = None  # the one it ran the step before (launch evidence)
        self._outliers = OutlierGuard(self.worker_id)
        self._delivered: Decision | None = None  # latest decision handed to the worker
        self._planned_version: int | None = None
        self._guard_step: int | None = None
        self._scheduled: tuple[tuple, int] = ((), 0)  # the probe answer that last fired, and when
        self._ready: list[Decision] = []
        self._pending: list[str] = []
        self._pending_resume = False
        self._inflight = False
        self._last_triggers: tuple[str, ...] = ()
        self._last_update: ProfileUpdate | None = None
        self._last_observed_ms: float | None = None
        self._all_gpu_of: Decision | None = None  # decision _all_gpu was computed for
        self._all_gpu = True

    # ---- WorkerSession ---------------------------------------------------------------------
    @property
    def worker_id(self) -> str:
        return self._worker.worker_id

    @property
    def worker(self) -> WorkerInfo:
        return self._worker

    def report(self, report: StepReport) -> list[Decision]:
        """Ingest one step's telemetry; return the decisions ready now (never waits on planning)."""
        with self._lock:
            if self._closed:
                raise Unavailable(f"session {self.worker_id!r} is closed")
            self._validate(report)
            policy = self._policy_source()
            events = self._tracker.ingest(report, policy.slo_tbt_ms)
            self._last = report
            if self._delivered is not None and self._delivered.apply_at_step <= report.step:
                self._installed = self._delivered
            reasons: list[str] = []
            if events.batch_changed:
                reasons.append("batch-change")
            planning = self._inflight or bool(self._pending)
            if (
                self._current is not None
                and report.step >= self._current.expiry_step
                and not planning  # the plan being computed brings a fresh expiry
            ):
                reasons.append("expiry")
            if self._check_mismatch(report, policy):
                reasons.append("profile-mismatch")
            if self._planned_version is not None and policy.version != self._planned_version:
                reasons.append("policy-change")
            starving = self._tracker.has_paused() and [
                r.id
                for r in self._tracker.paused()
                if r.paused_since_step is not None
                and report.step - r.paused_since_step >= policy.max_paused_steps
            ]
            # Re-fire while anyone starves, at most once per window_min steps (each firing resumes
            # the longest-waiting request; a request that cannot run even alone must not make
            # every step re-plan).
            if (
                starving
                and not planning
                and (
                    self._guard_step is None or report.step - self._guard_step >= policy.window_min
                )
            ):
                self._guard_step = report.step
                reasons.append("starvation")
            self._update_queue(report)
            has_work = bool(self._queued) or bool(self._tracker)
            if self._current is None and has_work and not self._inflight and not self._pending:
                reasons = ["initial"]  # nothing planned yet: whatever fired, this is the first plan
            if not reasons and self._wants_schedule(policy, report.step):
                reasons.append("schedule")
            self._last_triggers = tuple(reasons)
            if reasons and has_work:
                for reason in reasons:
                    self._observer.on_trigger(self.worker_id, reason)
                # OrbitFlow §3.4: resume "only after some in-flight requests have completed";
                # not on every window expiry (a retried plan that looks feasible again would
                # resume and re-pause the same request every window). The starvation guard
                # (above) bounds how long a request waits; an empty batch resumes at once.
                try_resume = bool(events.finished) or not self._tracker.has_running()
                self._trigger(reasons, try_resume)
            return self._take_ready()

    def poll(self) -> list[Decision]:
        """Decisions that became ready since the last report (for push-style transports)."""
        if not self._ready:  # the usual poll, every step: no lock (a decision appended meanwhile
            return []  # is taken by the next poll or report)
        with self._lock:
            if self._last is None:
                return []
            return self._take_ready()

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until no plan is being computed or queued; False on timeout. Never needed in sync."""
        deadline = time.monotonic() + timeout_s
        with self._settled:
            while self._inflight or self._pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._settled.wait(left)
            return True

    def close(self) -> None:
        """End the session; a plan being computed is abandoned."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._pending.clear()
            self._settled.notify_all()
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
        if self._on_close is not None:
            self._on_close(self)

    @property
    def closed(self) -> bool:
        return self._closed

    # ---- introspection ---------------------------------------------------------------------
    def deposit(self, request_id: str) -> TokenDeposit | None:
        """The request's token deposit (read it; the controller advances it)."""
        with self._lock:
            tracked = self._tracker.get(request_id)
            return None if tracked is None else tracked.deposit

    def status(self) -> SessionStatus:
        with self._lock:
            return SessionStatus(
                worker_id=self.worker_id,
                step=None if self._last is None else self._last.step,
                running=tuple(r.id for r in self._tracker.running()),
                paused=tuple(r.id for r in self._tracker.paused()),
                expiry_step=None if self._current is None else self._current.expiry_step,
                layer_compute_ms=self._profile.layer_compute_ms,
                h2d_gbps=self._profile.h2d_gbps,
                planning=self._inflight or bool(self._pending),
                last_triggers=self._last_triggers,
                last_profile_update=self._last_update,
            )

    # ---- internals ---------------------------------------------------------------------------
    def _validate(self, report: StepReport) -> None:
        validate_report(report, self._last, self._worker.model.layers)

    def _check_mismatch(self, report: StepReport, policy: Policy) -> bool:
        # launch-cost evidence: the placement of the step before ran again (judged on every report)
        before, now = self._checked, self._installed
        steady = before is now or (before is not None and now is not None and before.plan.places_like(now.plan))
        self._checked = now
        observed = report.observed_step_ms
        if observed is None:
            return False
        self._last_observed_ms = observed
        # the batch the worker ran (its pause flags): the tracker pauses and resumes when a plan is
        # made, before the worker applies it (an exact observation moved the profile, session 77)
        ran = [r for r in report.running if not r.paused]
        if self._installed is None or not ran:
            return False
        all_gpu = self._installed_all_gpu()  # no transfers: the timeline is the layers' compute
        if not all_gpu and report.finished:
            return False  # the step also read the finished requests' KV, which the tracker dropped
        if not all_gpu:
            rows, blocks, rec = placement_rows(self._installed, ran, self._worker.model)
        predicted = self._profile.all_gpu_step_ms if all_gpu else self._profile.predict_step_ms(rows, blocks, rec)
        if not self._outliers.moves(observed, predicted, policy.mismatch_threshold, report.step):
            return False
        if all_gpu:  # its rows are built only when the profile moves (most steps it does not)
            rows, blocks, rec = placement_rows(self._installed, ran, self._worker.model)
        self._last_update = self._profile.update(
            ewma_factor=policy.ewma_factor,
            observed_step_ms=observed,
            predicted_step_ms=predicted,
            placement=rows,
            blocks=blocks,
            layer_compute_sample_ms=report.layer_compute_ms,
            h2d_gbps_sample=report.h2d_gbps,
            recompute=rec,
            steady=steady,
        )
        replan = self._replan_could_change(report, rows, rec)
        (log.info if replan else log.debug)(
            "profile_mismatch",
            worker=self.worker_id,
            step=report.step,
            observed_ms=round(observed, 3),
            predicted_ms=round(predicted, 3),
            h2d_gbps=round(self._profile.h2d_gbps, 3),
            replan=replan,
        )
        return replan

    def _installed_all_gpu(self) -> bool:
        """Whether the installed decision keeps every layer of every request on the GPU (requests
        it does not place run all-GPU, see :func:`.placement_rows`); cached per decision."""
        decision = self._installed
        if decision is None:
            return True
        if self._all_gpu_of is not decision:
            self._all_gpu_of = decision
            self._all_gpu = decision.plan.all_gpu()  # a recompute adds compute: not the fast path
        return self._all_gpu

    def _replan_could_change(
        self, report: StepReport, rows: list[tuple[int, ...]], rec: Recompute | None = None
    ) -> bool:
        """Whether re-running the solver on the refreshed profile can change the installed plan.

        OrbitFlow §3.4 re-runs the solver after every profile update. It cannot change anything
        while every layer of every running request is on the GPU and nobody is paused or queued:
        no placement is faster (no transfers), and the SLO cap counts an SLO below that
        all-resident step from the step (:func:`controlplane.planner.slo_cap.cap_view`), so
        nobody is late there and the solver returns the installed plan. That is the steady
        state of a server whose KV fits; skipping the solve there keeps the per-step cost of
        the controller flat. The profile is updated either way.
        """
        return bool(report.queued or self._tracker.has_paused() or any(0 in row for row in rows) or rec)

    def _update_queue(self, report: StepReport) -> None:
        waiting = {q.id for q in report.queued}
        self._admitted = {
            rid: step
            for rid, step in self._admitted.items()
            if rid in waiting and report.step - step < ADMIT_GRACE_STEPS
        }
        self._queued = tuple(q for q in report.queued if q.id not in self._admitted)

    def _scheduler_name(self, policy: Policy) -> str:
        return self._worker.scheduler or policy.scheduler

    def _wants_schedule(self, policy: Policy, step: int) -> bool:
        """Cheap probe: would the scheduler change anything now? The answer that last fired fires
        again only ``window_min`` steps later: one a plan carried out changes, one it did not (a
        rotation-in the planner refuses: the scheduler's step predictor said on time, the plan
        pauses someone) re-planned every report (control-plane review, session 77)."""
        if self._inflight:
            return False  # the next plan runs the scheduler on fresh state anyway
        if not self._queued and not (
            self._tracker.paused() and self._scheduler_name(policy) == "lvf"
        ):
            return False
        sd = self._builder.schedule_only(self._snapshot(policy, (), False))
        answer = (sd.admit, sd.pause, sd.resume)
        if sd.empty or (answer == self._scheduled[0] and step - self._scheduled[1] < policy.window_min):
            return False
        self._scheduled = (answer, step)
        return True

    def _free_gpu_blocks(self) -> int:
        assert self._last is not None
        if self._last.free_gpu_blocks is not None:
            return max(0, self._last.free_gpu_blocks)
        rows, blocks, rec = placement_rows(self._current, self._tracker.running(), self._worker.model)
        return max(0, self._worker.hardware.gpu_kv_budget_blocks - gpu_blocks(rows, blocks, rec))

    def _snapshot(
        self, policy: Policy, reasons: tuple[str, ...], try_resume: bool
    ) -> PlanningInput:
        assert self._last is not None
        step = self._last.step
        default_slo = policy.slo_tbt_ms
        predicted = (
            self._current.plan.predicted_step_ms
            if self._current is not None and self._current.plan.predicted_step_ms > 0
            else float(sum(self._profile.layer_compute_ms))
        )
        return PlanningInput(
            step=step,
            now_ms=self._last.now_ms,
            reasons=reasons,
            running=tuple(
                self._tracker.view(r, step, default_slo) for r in self._tracker.running()
            ),
            paused=tuple(self._tracker.view(r, step, default_slo) for r in self._tracker.paused()),
            queued=self._queued,
            model=self._worker.model,
            hardware=self._worker.hardware,
            layer_compute_ms=self._profile.layer_compute_ms,
            recompute_ms_per_token=self._profile.recompute_ms_per_token,
            fetch_launch_ms=self._profile.fetch_launch_ms,
            h2d_gbps=self._profile.h2d_gbps,
            tpot_ms=self._last_observed_ms if self._last_observed_ms is not None else predicted,
            predicted_step_ms=predicted,
            free_gpu_blocks=self._free_gpu_blocks(),
            policy=policy,
            scheduler=self._scheduler_name(policy),
            try_resume=try_resume,
            limits=self._limits,
            held=self._tracker.held(step + 1),
        )

    def _trigger(self, reasons: list[str], try_resume: bool) -> None:
        if self._sync:
            inp = self._snapshot(self._policy_source(), tuple(reasons), try_resume)
            t0 = time.perf_counter()
            decision = self._builder.build(inp)
            self._apply(decision, inp, (time.perf_counter() - t0) * 1e3)
            return
        self._pending.extend(r for r in reasons if r not in self._pending)
        self._pending_resume = self._pending_resume or try_resume
        if not self._inflight:
            self._submit()

    def _submit(self) -> None:
        """Snapshot the current state and plan it on the session thread (lock held)."""
        assert self._executor is not None
        inp = self._snapshot(self._policy_source(), tuple(self._pending), self._pending_resume)
        self._pending.clear()
        self._pending_resume = False
        self._inflight = True
        self._executor.submit(self._run, inp)

    def _run(self, inp: PlanningInput) -> None:
        t0 = time.perf_counter()
        decision: Decision | None = None
        try:
            decision = self._builder.build(inp)
        except Exception as exc:  # never let a planning failure kill the session
            log.exception("plan_failed", worker=self.worker_id, step=inp.step)
            self._observer.on_error(self.worker_id, repr(exc))
        solve_ms = (time.perf_counter() - t0) * 1e3
        with self._lock:
            self._inflight = False
            if not self._closed:
                if decision is not None:
                    self._apply(decision, inp, solve_ms)
                if self._pending:
                    self._submit()
            self._settled.notify_all()

    def _apply(self, decision: Decision, inp: PlanningInput, solve_ms: float) -> None:
        """Make a decision current: pause/resume state, admissions, expiry (lock held)."""
        for rid in decision.pause:
            if self._tracker.pause(rid, decision.apply_at_step, decision.reason):
                self._observer.on_pause(self.worker_id, rid, decision.reason)
        for rid in decision.resume:
            if self._tracker.resume(rid, inp.now_ms):
                self._observer.on_resume(self.worker_id, rid, decision.reason)
        for rid in decision.admit:
            self._admitted[rid] = inp.step
        self._queued = tuple(q for q in self._queued if q.id not in self._admitted)
        self._current = decision
        self._planned_version = decision.policy_version
        self._ready.append(decision)
        self._observer.on_plan(self.worker_id, decision.reason, solve_ms, decision.plan.feasible)
        log.info(
            "plan_decided",
            worker=self.worker_id,
            step=inp.step,
            reason=decision.reason,
            feasible=decision.plan.feasible,
            predicted_step_ms=round(decision.plan.predicted_step_ms, 3),
            expiry_step=decision.expiry_step,
            pause=list(decision.pause),
            resume=list(decision.resume),
            admit=list(decision.admit),
            solve_ms=round(solve_ms, 3),
        )

    def _take_ready(self) -> list[Decision]:
        assert self._last is not None
        out = [
            dataclasses.replace(d, apply_at_step=max(d.apply_at_step, self._last.step + 1))
            for d in self._ready
        ]
        self._ready.clear()
        if out:
            self._delivered = out[-1]
            for d in out:
                self._tracker.delivered(d.pause + d.resume, d.apply_at_step)
        return out
