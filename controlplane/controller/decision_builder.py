"""Turn one immutable planning snapshot into a :class:`~controlplane.api.Decision`.

Runs on the session's planning thread (or inline in synchronous mode) and touches no controller
state. Steps (OrbitFlow §3.3-3.4, plus the per-worker scheduler):

1. The scheduler (fcfs / layerkv / lvf) decides admissions and rotations.
2. Starvation guard: the longest-paused request among those paused for ``policy.max_paused_steps``
   or more must run. It joins the batch; while the planner still pauses it, the controller pauses
   another running request (chosen by ``policy.victim_rule``) and plans again. One that does not
   run even alone pauses nobody, and the next starving request is forced instead (at most
   ``MAX_RESUME_TRIALS``). Other starving requests are the first candidates of step 4. Each
   starvation decision therefore resumes the longest-waiting request that fits alone, so
   starving requests are served in FIFO order.
3. The planner places the batch one step ahead (every running request's context grows by the
   token decoded at the target step, OrbitFlow §3.3.2 "adding one token to align with the target
   step"); when infeasible it pauses victims itself. A *held* request (``PlanningInput.held``:
   the worker dropped its last pause, and would drop the next) is not paused: another one is, by
   the victim rule, as for a forced one; and a starving request that cannot run beside it is not
   forced. One that cannot run even alone is planned as the planner decides (it decodes all
   the same, so it still counts against the batch limits below).
4. Resume: a paused request (other starving ones first, then the scheduler's rotation-ins, then -
   when a request finished - the longest-paused ones) joins only if the batch limits have room
   for it and the plan with it is feasible and pauses nobody (OrbitFlow §3.4: "resumes a paused
   request only after some in-flight requests have completed and a feasible plan exists"). The
   first refusal ends the attempts, so a request never overtakes a longer-paused one, and at
   most ``MAX_RESUME_TRIALS`` extra plans are solved per decision. While nothing runs a refusal
   neither ends them nor counts (up to ``MAX_ALONE_TRIALS`` plans of one request). When the
   planner paused everyone and nothing is admitted, the requests it just paused are tried first,
   alone, last paused first: they keep running. (An admission takes the emptied batch: its
   prefill runs there.) A finish's or an idle batch's candidate is skipped (not the end) when
   the scheduler, seeing it run beside the batch and this decision's admissions, would pause it
   or another running request at the next plan (LayerKV's background rule: the resume would be
   undone, or swapped for another, moving KV in and out for nothing).
5. Admissions: the scheduler's, trimmed to the room the batch limits leave after the resumes
   (a paused request resumed on a finish goes before a new arrival, as vLLM serves its swapped
   queue before its waiting one).
6. A scheduler's rotation-outs (``SchedulerDecision.rotation``: LVF's; never of a held request)
   stand only when the decision resumes or admits something; otherwise it is made again without
   its rotations (SuperInfer §4.2.3 preempts to make "HBM space for resuming" prioritized
   requests: space for nobody idles the GPU).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol

from controlplane.api import Decision, QueuedRequest
from controlplane.controller.batch_limits import UNLIMITED, BatchLimits
from controlplane.controller.lost_first import HARD_BOUND_FACTOR, guarded_lost
from controlplane.controller.schedulers import make_scheduler
from controlplane.controller.schedulers.base import (
    RequestView,
    SchedulerDecision,
    SchedulerView,
)
from controlplane.controller.victims import select_victim, tpot_lost
from controlplane.model import Batch, Hardware, ModelSpec, Plan, Profile, RequestSpec
from controlplane.planner.slo_cap import floor_ms
from controlplane.policy import Policy

MAX_RESUME_TRIALS = 4
"""Extra planner calls per decision spent on trying to resume paused requests; also the starving
requests the guard tries to force in (each one past the first costs a plan of it alone)."""


MAX_ALONE_TRIALS = 32
"""Plans of one paused request alone a decision may try while nothing runs (a refusal there does
not end the resume attempts, nor count as one of ``MAX_RESUME_TRIALS``)."""


class PlannerLike(Protocol):
    """What the controller needs from :class:`controlplane.planner.Planner`."""

    def plan(
        self,
        batch: Batch,
        *,
        time_budget_ms: float | None = None,
        victim_rule: str = "largest",
        current_step: int | None = None,
        seed: int = 0,
        keep: frozenset[str] = frozenset(),
        first: frozenset[str] = frozenset(),
    ) -> Plan: ...


@dataclass(frozen=True)
class PlanningInput:
    """Everything one decision depends on (a snapshot taken under the controller's lock)."""

    step: int
    """Step of the report that triggered planning; the plan targets ``step + 1``."""
    now_ms: float
    """Worker clock of that report."""
    reasons: tuple[str, ...]
    """Triggers being served, in the order they fired."""
    running: tuple[RequestView, ...]
    paused: tuple[RequestView, ...]
    queued: tuple[QueuedRequest, ...]
    """Queued requests not yet admitted by an earlier decision."""
    model: ModelSpec
    hardware: Hardware
    layer_compute_ms: tuple[float, ...]
    h2d_gbps: float
    tpot_ms: float
    """Current time per output token (for LayerKV Eq. 1)."""
    predicted_step_ms: float
    """Predicted step time of the current plan (sets the solver budget)."""
    free_gpu_blocks: int
    policy: Policy
    scheduler: str
    try_resume: bool
    """True when a request finished (or nothing runs): try to resume paused requests."""
    limits: BatchLimits = UNLIMITED
    """The worker's batch limits (admissions and resumptions stay within them)."""
    recompute_ms_per_token: tuple[float, ...] | None = None
    """The worker's per-layer recompute cost (``docs/recompute.md``); None: never offered."""
    fetch_launch_ms: float = 0.0
    """Host cost of one fetch launch (:mod:`controlplane.model.timeline`), as learnt."""
    held: frozenset[str] = frozenset()
    """Running requests not to pause: the worker dropped their last pause
    (:meth:`~controlplane.controller.request_tracker.RequestTracker.held`)."""


MAX_PLAN_BUDGET_MS = 1000.0
"""Ceiling of a session plan's search budget (``solve_budget_fraction`` of the predicted step).
A worker profile claiming 5-second layers (every field valid) made a 100-second budget: the plan
came far too late to place anything, kept a core busy after its session closed, and held
``kvplane serve`` past SIGTERM (control-plane review, session 54). A second covers any real step."""


class DecisionBuilder:
    """Stateless apart from its planner; one per session."""

    def __init__(self, planner: PlannerLike, *, time_budget_ms: float | None = None) -> None:
        self._planner = planner
        self._budget_ms = time_budget_ms
        """Fixed solver budget per planner call; None = policy.solve_budget_fraction of the step."""

    def build(self, inp: PlanningInput) -> Decision:
        sd = make_scheduler(inp.scheduler).schedule(self._scheduler_view(inp))
        decision = self._decide(inp, sd)
        if sd.rotation and sd.pause and not decision.admit and not decision.resume:
            # the rotation-outs made room for nobody (the rotation-ins refused, nothing admitted
            # or resumed): carried out anyway, LVF's paused the only runnable request for one that
            # cannot run and the GPU idled every other step (control-plane review, session 78)
            decision = self._decide(inp, replace(sd, pause=(), resume=()))
        return decision

    def _decide(self, inp: PlanningInput, sd: SchedulerDecision) -> Decision:
        policy = inp.policy
        rotated_out = [
            rid for rid in sd.pause if rid not in inp.held and any(r.id == rid for r in inp.running)
        ]
        running = [r for r in inp.running if r.id not in rotated_out]
        running_by_id = {r.id: r for r in running}
        paused_by_id = {p.id: p for p in inp.paused}

        # Starvation guard (longest-paused first).
        starving = [p for p in inp.paused if p.paused_steps >= policy.max_paused_steps]
        starving.sort(key=lambda p: (-p.paused_steps, p.id))
        starving_ids = {p.id for p in starving}
        plan, members, guard_victims, tried, forced = self._guarded(inp, running, starving)
        members = [r for r in members if r.id not in plan.paused]
        # held requests the plan cannot run decode all the same (their pauses drop): they hold
        # batch slots (left out, resumes and admissions went past the limits: review, session 79)
        unplanned = [r for r in running if r.id in inp.held and r.id in plan.paused]
        resumed = list(forced)
        planner_paused = plan.paused

        # Resume attempts: scheduler rotations first, then the longest-paused on finish/expiry.
        candidates = [p.id for p in starving if p.id not in tried]
        candidates += [
            rid
            for rid in sd.resume
            if rid in paused_by_id and rid not in forced and rid not in candidates
        ]
        # the planner paused everyone (its victim order can pause a request that runs alone before
        # one that cannot) and nothing is admitted: the GPU idled until the plan expired (control-
        # plane review, session 78). Its victims run alone first, last paused first. Not when an
        # admission takes the GPU: the prefills that empty batch lets in kept kvplane-combined's
        # P99 TTFT at 28 s (451 s with victims run in their place, session 78)
        idle = not members and not unplanned and not self._admissions(sd, unplanned, inp)
        if inp.try_resume or idle:
            candidates += [
                p.id for p in inp.paused if p.id not in tried and p.id not in candidates
            ]
        if idle:
            candidates = [rid for rid in reversed(planner_paused) if rid in running_by_id] + candidates
        trials = alone = 0
        for rid in candidates:
            # while nothing runs, a refusal (a request that cannot run even alone) does not use up
            # a trial: four longer-paused ones kept one that runs alone paused and the GPU idle at
            # every re-plan (control-plane fuzz, session 79); such plans are of one request
            busy = members + unplanned
            if busy:
                trials += 1
            else:
                alone += 1
            if trials > MAX_RESUME_TRIALS or alone > MAX_ALONE_TRIALS:
                break
            cand = paused_by_id.get(rid) or running_by_id[rid]
            if not inp.limits.admits(
                len(busy), sum(r.context_tokens for r in busy), cand.context_tokens
            ):
                break
            if (
                (busy or self._admissions(sd, busy, inp))
                and rid in paused_by_id
                and rid not in sd.resume
                and rid not in starving_ids
            ):
                if self._scheduler_pauses(inp, sd, busy, cand):
                    # the scheduler pauses it, or another for it, at the next plan (LayerKV's
                    # background and prompt-room rules): its KV moved in and out for a step or
                    # two at every finish (control-plane fuzz and reviews, session 79). Skipped,
                    # not the end: the rule is the scheduler's order
                    continue
            trial = self._plan(members + [cand], inp)
            if not trial.feasible or trial.paused:
                if not busy:  # nothing runs: a candidate that cannot must not hold back the next
                    continue
                break
            if rid in running_by_id:  # a victim of this plan: it keeps running
                planner_paused = tuple(p for p in planner_paused if p != rid)
            else:
                resumed.append(rid)
            plan = replace(trial, paused=planner_paused)
            members = members + [cand]

        running_ids = {r.id for r in inp.running}
        pause = list(rotated_out) + guard_victims
        pause += [rid for rid in planner_paused if rid in running_ids and rid not in pause]
        if inp.held:  # one the plan cannot run even alone decodes all the same: its pause would drop
            pause = [rid for rid in pause if rid not in inp.held]
        expiry = (
            plan.expiry_step if plan.expiry_step is not None else inp.step + 1 + plan.window_steps
        )
        admit = self._admissions(sd, members + unplanned, inp)
        return Decision(
            plan=plan,
            apply_at_step=inp.step + 1,
            expiry_step=expiry,
            pause=tuple(pause),
            resume=tuple(resumed),
            admit=admit,
            min_gpu_layers={rid: n for rid, n in sd.min_gpu_layers.items() if rid in admit},
            reason=",".join(inp.reasons),
            policy_version=policy.version,
        )

    def _guarded(
        self, inp: PlanningInput, running: list[RequestView], starving: list[RequestView]
    ) -> tuple[Plan, list[RequestView], list[str], list[str], set[str]]:
        """The plan of ``running`` with the starvation guard: the longest-paused starving request
        that runs (alone if need be) joins, pausing others (by the victim rule) until it fits.
        Returns the plan, its members, the guard's victims, the starving requests tried and the
        one that runs (none or one). A forced request that does not run even with
        every other one paused pauses nobody (pausing them idled the GPU every other window,
        session 77), and the next starving one is forced instead (one that can never run held
        every later one paused for good, control-plane review, session 78); at most
        ``MAX_RESUME_TRIALS`` are tried. Held requests (``inp.held``) are kept running the same
        way, and are never the victims."""
        policy = inp.policy
        if policy.victim_rule == "lost-first":  # past the hard bound, forced in as under the others
            hard = [r for r in starving if r.paused_steps >= HARD_BOUND_FACTOR * policy.max_paused_steps]
            if not hard:
                return guarded_lost(self, inp, running, starving, MAX_RESUME_TRIALS)
            starving = hard
        held = inp.held
        tried: list[str] = []
        together = self._held_together(running, inp)
        for f in starving[:MAX_RESUME_TRIALS]:
            tried.append(f.id)
            # The forced request needs a batch slot: pause others until it fits the limits.
            members, guard_victims, room = self.slot_for(f, running, inp, lambda r: r.id not in held)
            if not room:  # the held ones alone fill the batch
                continue
            plan, members, kept = self._keeping(members, {f.id}, inp, guard_victims, together)
            if kept:  # a held request it cannot run beside runs all the same: not forced
                return plan, members, guard_victims, tried, {f.id}
        guard_victims = []
        plan, members, _ = self._keeping(list(running), set(), inp, guard_victims, together)
        return plan, members, guard_victims, tried, set()

    @staticmethod
    def slot_for(
        f: RequestView, running: list[RequestView], inp: PlanningInput, may_pause: Callable[[RequestView], bool]
    ) -> tuple[list[RequestView], list[str], bool]:
        """``running`` plus the forced ``f``, less the requests paused (by the victim rule, among
        those ``may_pause`` allows) until ``f`` fits the batch limits: the members, those victims,
        and whether it fits."""
        members: list[RequestView] = running + [f]
        victims: list[str] = []
        while True:
            others = [r for r in members if r.id != f.id]
            room = not others or inp.limits.admits(
                len(others), sum(r.context_tokens for r in others), f.context_tokens
            )
            pool = [r for r in others if may_pause(r)]
            if room or not pool:
                return members, victims, room
            victim = select_victim(pool, inp.policy.victim_rule, inp.model.block_size, seed=inp.step)
            victims.append(victim.id)
            members = [r for r in members if r.id != victim.id]

    def _held_together(self, running: list[RequestView], inp: PlanningInput) -> frozenset[str] | None:
        """The held running requests that run together (one plan of them alone); None: none held."""
        held = [r for r in running if r.id in inp.held]
        if not held:
            return None
        return frozenset(r.id for r in held).difference(self._plan(held, inp).paused)

    def _keeping(
        self,
        members: list[RequestView],
        keep: set[str],
        inp: PlanningInput,
        victims: list[str],
        together: frozenset[str] | None,
    ) -> tuple[Plan, list[RequestView], bool]:
        """The plan of ``members`` that runs ``keep`` (the starving request forced in, or none)
        and the held members; also returns whether it runs every one of ``keep``.

        Without held members, one plan of ``members`` with ``keep`` paused only after every other
        one (``Planner.plan(keep=...)``, the others in the victim rule's order): the others it
        pauses are the guard's victims (appended to ``victims``, left out of the members and the
        plan's pauses); ``keep`` paused means it does not run even alone, and nobody is paused
        for it. (Until session 88 a walk paused one victim per plan: 49 planner calls and 288 ms
        in one decision at 256 requests x 80 layers, the scale review of session 88.) With held
        members (``together``: those of them that run together, :meth:`_held_together`; None: no
        held member), one plan of the forced one beside them decides whether it is forced at
        all, then one plan of all members, the kept ones paused last, places them. Held ones that
        do not run together are planned as the planner decides (never paused: the decision drops
        their pauses; the walk cost 114 planner calls in a decision and paused every other
        request for two held ones that cannot run together, review of session 79)."""
        if together is not None:
            forced = frozenset(keep)
            kept = together
            if forced:  # ... and the forced one beside them, or it is not forced
                beside = self._plan([r for r in members if r.id in kept | forced], inp, keep=kept)
                if forced.intersection(beside.paused):
                    return beside, members, False
            plan = self._plan(members, inp, keep=kept | forced)
            return plan, members, not forced.intersection(plan.paused)
        plan = self._plan(members, inp, keep=frozenset(keep))
        if not keep:
            return plan, members, True
        if keep.intersection(plan.paused):
            return plan, members, False
        gone = set(plan.paused)
        victims.extend(plan.paused)
        return replace(plan, paused=()), [r for r in members if r.id not in gone], True

    def _scheduler_pauses(
        self, inp: PlanningInput, sd: SchedulerDecision, busy: list[RequestView], cand: RequestView
    ) -> bool:
        """Whether the scheduler, seeing ``cand`` run beside ``busy`` and this decision's
        admissions, pauses it, or pauses a running request that it does not pause without it
        (other than as rotations): the next plan would undo the resume, or swap it for another."""
        with_it = self._probe(inp, sd, busy + [cand])
        if with_it.rotation or not with_it.pause:
            return False
        if cand.id in with_it.pause:
            return True
        without = self._probe(inp, sd, busy)
        return bool(set(with_it.pause).difference(without.pause, inp.held))

    def _probe(
        self, inp: PlanningInput, sd: SchedulerDecision, running: list[RequestView]
    ) -> SchedulerDecision:
        """The scheduler's answer with ``running`` and the admissions they leave room for running
        (their prefill made), the prompts they leave no room for still queued (the next plan's
        scheduler pauses for them), every other request paused."""
        now, slo = inp.now_ms, inp.policy.slo_tbt_ms
        views = [replace(r, paused=False, paused_steps=0) for r in running]
        prompts = {q.id: q.prompt_tokens for q in inp.queued}
        admitted = self._admissions(sd, running, inp)
        views += [
            RequestView(rid, prompts[rid], 0, slo, now, now, now, gpu_layers=sd.min_gpu_layers.get(rid))
            for rid in admitted
        ]
        ids = {r.id for r in views}
        probe = replace(
            inp,
            running=tuple(views),
            paused=tuple(p for p in inp.paused if p.id not in ids),
            queued=tuple(q for q in inp.queued if q.id not in admitted),
        )
        return make_scheduler(inp.scheduler).schedule(self._scheduler_view(probe))

    def schedule_only(self, inp: PlanningInput) -> SchedulerDecision:
        """The scheduler's answer alone (the controller's cheap per-report probe)."""
        return make_scheduler(inp.scheduler).schedule(self._scheduler_view(inp))

    # ---- internals -----------------------------------------------------------------------
    @staticmethod
    def _admissions(
        sd: SchedulerDecision, members: list[RequestView], inp: PlanningInput
    ) -> tuple[str, ...]:
        """The scheduler's admissions that still fit the batch limits next to ``members``."""
        prompt = {q.id: q.prompt_tokens for q in inp.queued}
        n = len(members)
        tokens = sum(r.context_tokens for r in members)
        out: list[str] = []
        for rid in sd.admit:
            add = prompt.get(rid, 0)
            if not inp.limits.admits(n, tokens, add):
                break
            out.append(rid)
            n += 1
            tokens += add
        return tuple(out)

    def _scheduler_view(self, inp: PlanningInput) -> SchedulerView:
        return SchedulerView(
            step=inp.step + 1,
            now_ms=inp.now_ms,
            running=inp.running,
            paused=inp.paused,
            queued=inp.queued,
            model=inp.model,
            hardware=inp.hardware,
            layer_compute_ms=inp.layer_compute_ms,
            h2d_gbps=inp.h2d_gbps,
            fetch_launch_ms=inp.fetch_launch_ms,
            tpot_ms=inp.tpot_ms,
            free_gpu_blocks=inp.free_gpu_blocks,
            policy=inp.policy,
            limits=inp.limits,
            held=inp.held,
        )

    def _plan(
        self, members: list[RequestView], inp: PlanningInput, keep: frozenset[str] = frozenset()
    ) -> Plan:
        """The planner's plan of ``members`` (``keep``: paused only after every other one)."""
        policy = inp.policy
        if not members:
            return Plan(
                feasible=True,
                paused=(),
                placements={},
                predicted_step_ms=float(sum(inp.layer_compute_ms)),
                window_steps=policy.window_max,
                resident_blocks=0,
                staging_blocks=0,
                solver="empty-batch",
                solve_ms=0.0,
                expiry_step=inp.step + 1 + policy.window_max,
            )
        requests = tuple(
            RequestSpec(
                id=r.id,
                # One step ahead: a running request decodes one more token by the target step.
                context_tokens=r.context_tokens + (0 if r.paused else 1),
                slo_tbt_ms=r.slo_tbt_ms,
                deposit_tokens=r.deposit_tokens,
                # its growth over the window stops at its output limit (a short request's KV
                # is not provisioned for the whole window)
                remaining_tokens=r.remaining_tokens,
            )
            for r in members
        )
        batch = Batch(
            model=inp.model,
            hardware=Hardware(inp.hardware.gpu_kv_budget_blocks, inp.h2d_gbps),
            profile=Profile(inp.layer_compute_ms, inp.recompute_ms_per_token, inp.fetch_launch_ms),
            requests=requests,
            policy=policy.plan_policy,
        )
        budget_ms = (
            self._budget_ms
            if self._budget_ms is not None
            else min(policy.solve_budget_fraction * inp.predicted_step_ms, MAX_PLAN_BUDGET_MS)
        )
        first: frozenset[str] = frozenset()
        if policy.victim_rule == "lost-first":  # requests whose TPOT is already lost go first
            floor = floor_ms(inp.layer_compute_ms)
            first = frozenset(r.id for r in members if tpot_lost(r, inp.now_ms, floor))
        return self._planner.plan(
            batch, time_budget_ms=budget_ms, victim_rule=policy.victim_rule,
            current_step=inp.step + 1, seed=inp.step, keep=keep, first=first,
        )
