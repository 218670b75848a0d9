"""The placement planner (issue 2 §3): window selection, SLO cap, pausing victims.

For a batch, :meth:`Planner.plan`

1. sizes every request at the window's end: ``b_r = ceil((context_r + Δ) / block_size)`` (the
   plan is computed one step ahead and must stay valid for Δ steps; OrbitFlow §3.3.2 "adding one
   token to align with the target step", §3.3.1 decode window);
2. searches candidate layouts (:class:`PlacementSearch`, with the CBC stage when the budget allows)
   for the least exact step time ``T`` that fits memory;
3. checks the SLO cap of OrbitFlow §3.3.1 with token deposits (§3.2): the requests' shares of
   the window's steps that fail their TBT SLO, ``late_r = 1 - deposit_r / (Δ (T / slo_r - 1))``
   once ``T > slo_r (1 + deposit_r / Δ)`` (else 0), sum to at most alpha (:mod:`.slo_cap`); an
   SLO below the all-resident step, which no placement or pause beats, counts from that step
   (:func:`.slo_cap.cap_view`);
4. picks the largest feasible Δ in ``[window_min, window_max]`` analytically from the step
   times found (feasibility is monotone: a larger Δ has more blocks, hence a larger optimal
   ``T``, and a smaller deposit credit per step ``deposit_r / Δ``), with at most four searches that stop
   as soon as they meet the cap; the chosen window's search is then polished with the rest of
   the budget;
5. when even ``window_min`` is infeasible (memory or SLO cap), pauses a victim by the victim rule
   and re-plans, repeatedly (§3.4) — directly, without a search, while a valid lower bound on
   the step time already proves it (:meth:`Planner.step_lower_bound_ms`).

When the batch offers recompute (issue 16, ``docs/recompute.md``: the profile has
``recompute_ms_per_token`` and ``policy.max_recompute_ratio > 0``), the layout-only procedure
above runs first and unchanged; :class:`.RecomputeWindows` then spends the time it left on the
joint layout + ``(u, k)`` search: resuming victims it can fit, larger windows, a faster step.
Same SLO cap, windows and memory budget; never worse than the layout-only plan of the same call.

See README.md for the budget split and the measured figures.

``feasible`` in the returned plan: the placements of the running requests fit memory and meet the
SLO cap, and at least one request runs (or the batch was empty). A batch whose every request had
to be paused gives ``feasible=False`` with all ids in ``paused``.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Sequence

import structlog

from controlplane.model import Batch, Plan, RequestSpec
from controlplane.planner.evaluator import Evaluator
from controlplane.planner.late_pauses import LATE_BISECT_MIN, late_pause_count
from controlplane.planner.mip_search import MipStage
from controlplane.planner.placement_search import PlacementSearch
from controlplane.planner.plan_builder import build_plan
from controlplane.planner.plan_context import PlanContext
from controlplane.planner.recompute_grid import RecomputeGrid
from controlplane.planner.recompute_windows import RecomputeWindows
from controlplane.planner.slo_cap import cap_view, largest_window, late_fraction, max_step_ms
from controlplane.planner.solved import Solved

log = structlog.get_logger(__name__)

VICTIM_RULES = ("largest", "longest", "shortest", "random", "lost-first")
"""``lost-first`` orders as ``largest`` here; the controller passes the requests whose TPOT SLO is
already lost as ``first`` (:func:`controlplane.controller.victims.tpot_lost`)."""
FINISHING_TOKENS = 1
"""A request with at most this many tokens left after the target step's (``remaining_tokens``)
is paused last, whatever the rule: its KV is freed when it finishes a step or two later, and
the data plane leaves running a request whose last token comes in the next step or, under
SGLang's overlap loop, in the step in flight (``sglang_ext/pause.py``: it would not pause
anyway, and the plan would have counted its memory as freed)."""


def about_to_finish(remaining_tokens: int | None) -> bool:
    """At most :data:`FINISHING_TOKENS` tokens left after the target step's: paused last."""
    return remaining_tokens is not None and remaining_tokens <= FINISHING_TOKENS
DEFAULT_BUDGET_FRACTION = 0.25
"""Default time budget: this fraction of the predicted step (all-on-GPU compute first)."""
DEFAULT_MAX_BUDGET_MS = 40.0
"""Ceiling of the *default* budget (an explicit ``time_budget_ms`` is never capped). Issue 2 §6
asks for p99 <= 50 ms at 64 requests x 80 layers, where 25% of the step is ~52 ms (p99 ~64 ms);
the search there keeps finding small gains until the deadline, and stopping at 40 ms costs ~0.3
points of optimality gap (see README.md)."""
DEFAULT_MIN_BUDGET_MS = 4.0
"""Floor of the *default* budget. On small models 25% of a step is 0.3-1.5 ms, a few dozen
exact evaluations in Python. Measured on 1000 random 2-4 request x 8-16 layer batches (README.md,
CPU clock): with 25% alone 4% of plans were more than 1% above the optimum (worst 21%); with
this floor none were (all optimal), while the median plan still takes ~0.45 ms because the search
stops once it has proved its plan optimal (p99 3.1 ms). Planning runs one step ahead on the
controller's thread (OrbitFlow §3.3), so a plan slower than a short step arrives a report later
rather than stalling the GPU."""

FIRST_SHARE = 0.5
"""Share of the remaining budget the first search (at ``window_max``) may take."""
SEARCH_SHARE = 0.4
"""Share for the search at the analytically chosen window (and at ``window_min``)."""
PROBE_SHARE = 0.25
"""Share for each probe above the chosen window. A probe that fails runs to its deadline, and
on small budgets the polish of the chosen window (what the plan's quality depends on) only gets
what the probes leave, so the probes stay cheap."""


class Planner:
    """Stateless placement planner; safe to share between threads."""

    def __init__(
        self,
        *,
        use_mip: bool = True,
        exact_search: bool = True,
        budget_fraction: float = DEFAULT_BUDGET_FRACTION,
        max_default_budget_ms: float = DEFAULT_MAX_BUDGET_MS,
        min_default_budget_ms: float = DEFAULT_MIN_BUDGET_MS,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        """``clock`` (seconds) measures the time budget and ``solve_ms``: wall time by default;
        ``time.process_time`` makes the budget CPU time (benchmarks on a shared machine),
        ``time.thread_time`` the calling thread's (tests sharing the process with other threads).
        The default budget (no ``time_budget_ms``) is ``budget_fraction`` of the all-on-GPU
        compute, raised to ``min_default_budget_ms`` and then capped at
        ``max_default_budget_ms`` (the cap wins)."""
        if not 0.0 < budget_fraction <= 100.0:
            raise ValueError(f"budget_fraction must be in (0, 100], got {budget_fraction}")
        if not max_default_budget_ms > 0.0:
            raise ValueError(f"max_default_budget_ms must be > 0, got {max_default_budget_ms}")
        if not min_default_budget_ms >= 0.0:
            raise ValueError(f"min_default_budget_ms must be >= 0, got {min_default_budget_ms}")
        self._max_default_ms = max_default_budget_ms
        self._min_default_ms = min_default_budget_ms
        self._mip = MipStage() if use_mip else None
        self._exact = exact_search
        self._fraction = budget_fraction
        self._clock = clock

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
    ) -> Plan:
        """The placement for ``batch``; never raises for a valid batch (see module docstring).
        ``keep``: requests paused only after every other one; ``first``: requests (not kept)
        paused before every other one (the victim rule orders each group)."""
        t0 = self._clock()
        if victim_rule not in VICTIM_RULES:
            raise ValueError(f"victim_rule {victim_rule!r} is not one of {VICTIM_RULES}")
        if time_budget_ms is not None and not time_budget_ms >= 0:
            raise ValueError(f"time_budget_ms must be >= 0, got {time_budget_ms}")
        compute_ms = sum(batch.profile.layer_compute_ms)
        budget_ms = (
            min(max(self._fraction * compute_ms, self._min_default_ms), self._max_default_ms)
            if time_budget_ms is None
            else time_budget_ms
        )
        victims = self._victim_order(
            batch, victim_rule, random.Random(seed) if victim_rule == "random" else None
        )
        if keep or first:
            lead = [v for v in victims if v.id in first and v.id not in keep]
            victims = lead + [v for v in victims if v.id not in first and v.id not in keep] + [
                v for v in victims if v.id in keep
            ]
        batch, victims = cap_view(batch, victims)
        ctx = PlanContext(batch, t0 + budget_ms / 1e3, self._clock)
        joint = None if ctx.grid is None else RecomputeWindows(self._solve, exact=self._exact)
        # Pause without searching while a valid bound proves that no assignment works: the
        # fewest leading victims whose pausing lets the bound allow the rest, found in
        # O(log R) bound evaluations (one pause at a time was O(R) evaluations of O(R) each).
        k = self._bound_prefix(batch, victims)
        gone = {id(v) for v in victims[:k]}
        reqs = tuple(r for r in batch.requests if id(r) not in gone)
        paused: list[str] = [v.id for v in victims[:k]]
        by_bound: list[bool] = [True] * k  # per pause: decided by the bound alone (no search)
        chosen: Solved | None = None
        hint: dict[str, int] = {}
        while reqs:
            # Pause without searching while a valid bound proves that no assignment works.
            if not self._bound_allows(batch, reqs, layouts_only=True):
                by_bound.append(True)
            else:
                chosen = self._best_window(ctx, reqs, hint, optimistic=not paused)
                if chosen is not None:
                    break
                rest = victims[len(paused):]
                if len(rest) > LATE_BISECT_MIN and ctx.left_s() <= 0:  # out of time: O(log R) searches
                    m, chosen = late_pause_count(reqs, rest, lambda left: self._best_window(ctx, left, hint, optimistic=False))
                    paused += [v.id for v in rest[:m]]
                    by_bound += [False] * m
                    break
                by_bound.append(False)
            victim = victims[len(paused)]
            paused.append(victim.id)
            reqs = tuple(r for r in reqs if r.id != victim.id)
        search = None if chosen is None else chosen.search
        if chosen is not None and search is not None and ctx.left_s() > 0:
            # Polish: the probes stopped at the first plan meeting the SLO cap.
            result = search.resume(ctx.deadline)
            chosen = Solved(chosen.reqs, chosen.window, chosen.ev, result, search)
        if joint is not None and ctx.left_s() > 0:  # recompute, in the time the layouts left
            chosen, n_paused = joint.improve(
                ctx, chosen, victims[: len(paused)], lambda rs: self._bound_allows(batch, rs)
            )
            del paused[n_paused:], by_bound[n_paused:]
        solve_ms = (self._clock() - t0) * 1e3
        plan = self._to_plan(batch, chosen, paused, solve_ms, current_step)
        plan.extras.update(searches=ctx.searches, paused_by_bound=sum(by_bound))
        log.info(
            "plan_solved",
            requests=len(batch.requests),
            paused=len(paused),
            paused_by_bound=sum(by_bound),
            searches=ctx.searches,
            window_steps=plan.window_steps,
            predicted_step_ms=round(plan.predicted_step_ms, 4),
            solver=plan.solver,
            solve_ms=round(solve_ms, 3),
            budget_ms=round(budget_ms, 3),
        )
        return plan

    # --- bounds ---------------------------------------------------------------------------
    @staticmethod
    def step_lower_bound_ms(
        batch: Batch, reqs: Sequence[RequestSpec], window: int, *, layouts_only: bool = False
    ) -> float:
        """A valid lower bound on the step time of *any* memory-feasible assignment of ``reqs``.

        Memory (issue 2 §2) forces an offloaded volume ``V = sum_r b_r m_r >= sum_r b_r L - B +
        staging`` with staging at least the smallest ``b_r`` once anything is offloaded. Every
        fetch lands before the last offloaded layer starts and the link moves ``bw`` blocks/ms,
        so ``T >= V / bw + comp[L-1]`` (the last layer always runs after it); and ``T >= sum comp``.
        Returns ``math.inf`` when even everything offloaded does not fit memory. When the batch
        offers recompute, :meth:`.RecomputeGrid.step_lower_bound_ms` (recomputed block-layers
        also free memory, at a compute cost); ``layouts_only`` always gives the bound above.
        """
        comp = batch.profile.layer_compute_ms
        total = sum(comp)
        if not reqs:
            return total
        blocks = [r.blocks(batch.model.block_size, window) for r in reqs]
        grid = None if layouts_only else RecomputeGrid.for_batch(batch)
        if grid is not None:
            return grid.step_lower_bound_ms(blocks, comp, batch.hardware.gpu_kv_budget_blocks)
        budget = batch.hardware.gpu_kv_budget_blocks
        if sum(blocks) > budget:
            return math.inf
        excess = sum(blocks) * len(comp) - budget
        if excess <= 0:
            return total
        volume = excess + min(blocks)
        return max(total, volume / batch.bw_blocks_per_ms + comp[-1])

    def _bound_prefix(self, batch: Batch, victims: Sequence[RequestSpec]) -> int:
        """The fewest leading ``victims`` whose pausing lets :meth:`_bound_allows` (layouts only)
        allow the rest, by bisection: pausing more lowers the memory, the offloaded volume's
        bound and every late share, so the bound's verdict turns from no to yes once. (The one
        term that can rise is the staging of the smallest request: pausing it, when the next
        smallest holds more than ``L + 1`` times its blocks, can raise the volume's bound. The
        victims come largest first, so that is near the end of the order; there bisection may
        pause one more request than pausing one at a time would, never a plan that does not
        fit: the searches after it decide.)"""

        def allows(k: int) -> bool:
            gone = {id(v) for v in victims[:k]}
            return self._bound_allows(batch, tuple(r for r in batch.requests if id(r) not in gone),
                                      layouts_only=True)

        if allows(0):
            return 0
        lo, hi = 0, len(victims)  # no request left: nothing to bound, always allowed
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if allows(mid):
                hi = mid
            else:
                lo = mid
        return hi

    def _bound_allows(
        self, batch: Batch, reqs: tuple[RequestSpec, ...], *, layouts_only: bool = False
    ) -> bool:
        """False when memory or the SLO cap is provably infeasible for ``reqs`` at ``window_min``
        (feasibility is monotone in the window, so then no window works)."""
        pol = batch.policy
        t_lb = self.step_lower_bound_ms(batch, reqs, pol.window_min, layouts_only=layouts_only)
        if math.isinf(t_lb):
            return False
        return late_fraction(reqs, t_lb, pol.window_min) <= pol.alpha + 1e-12

    # --- window selection ---------------------------------------------------------------
    def _solve(
        self,
        ctx: PlanContext,
        reqs: tuple[RequestSpec, ...],
        window: int,
        share: float,
        warm: Sequence[tuple[int, ...]] = (),
        *,
        local_first: bool = True,
        source: Solved | None = None,
    ) -> Solved:
        """Search at ``window`` for at most ``share`` of the remaining budget.

        The search stops early once its step time meets the SLO cap at this window (a
        feasibility probe); :meth:`plan` resumes the chosen one with the rest of the budget.
        Windows with the same block counts share one search.
        """
        batch = ctx.batch
        blocks = tuple(r.blocks(batch.model.block_size, window) for r in reqs)
        key = (tuple(r.id for r in reqs), blocks)
        prev = ctx.solved.get(key)
        if prev is not None:
            return Solved(reqs, window, prev.ev, prev.result, prev.search)
        now = ctx.clock()
        deadline = now + max(0.0, ctx.deadline - now) * share
        ev = Evaluator(
            ctx.cands,
            blocks,
            batch.profile.layer_compute_ms,
            batch.bw_blocks_per_ms,
            chain_cache=ctx.chain_cache,
            launch_ms=batch.profile.fetch_launch_ms,
        )
        target = max_step_ms(reqs, window, batch.policy.alpha, ev.compute_ms)
        search = PlacementSearch(
            ev, batch.hardware.gpu_kv_budget_blocks, deadline, target_ms=target, clock=ctx.clock
        )
        ctx.searches += 1
        # The constructive stages a search of the same requests at another window completed
        # would only rebuild (nearly) the same plans: the warm start already carries them.
        skip = (
            [s for s in PlacementSearch.CONSTRUCTIVE if s in source.search.done]
            if source is not None and source.search is not None and source.reqs == reqs
            else []
        )
        result = search.run(
            warm, mip=self._mip, exact=self._exact, local_first=local_first, skip=skip
        )
        solved = Solved(reqs, window, ev, result, search)
        ctx.solved[key] = solved
        return solved

    def _ok(self, solved: Solved, alpha: float) -> bool:
        return solved.ok(alpha)

    @staticmethod
    def _remember(solved: Solved, hint: dict[str, int]) -> None:
        """Keep each request's layout as a warm start for re-planning after a pause."""
        if solved.result is not None:
            hint.update((r.id, c) for r, c in zip(solved.reqs, solved.result.assign, strict=True))

    _largest_window = staticmethod(largest_window)

    def _best_window(
        self,
        ctx: PlanContext,
        reqs: tuple[RequestSpec, ...],
        hint: dict[str, int],
        *,
        optimistic: bool,
    ) -> Solved | None:
        """The plan at the largest feasible window, or None when even ``window_min`` fails.

        At most four searches (OrbitFlow §3.3.1 window, computed analytically):

        1. ``optimistic`` (nobody paused yet): search at ``window_max``; done when feasible.
           Its step time ``T_max`` bounds the step at every smaller window from above, so the
           largest Δ whose late fraction at ``T_max`` is within alpha is (almost surely)
           feasible: search there next (else at ``window_min``).
        2. With the step time ``T`` found at that Δ, the late fraction bounds the window from
           above: the largest Δ' allowed at ``T`` (a larger window has at least as many blocks,
           so its step is no smaller). Probe Δ' and, if it fails, the midpoint once.
        Each search is warm-started with the previous answer.
        """
        pol = ctx.batch.policy
        alpha = pol.alpha
        warm: list[tuple[int, ...]] = (
            [tuple(hint[r.id] for r in reqs)] if all(r.id in hint for r in reqs) else []
        )
        start = pol.window_min
        top: Solved | None = None
        if optimistic:
            top = self._solve(ctx, reqs, pol.window_max, FIRST_SHARE, warm, local_first=False)
            self._remember(top, hint)
            if self._ok(top, alpha):
                return top
            if top.result is None:  # nothing fits at window_max; try the smallest window
                start = pol.window_min
            else:
                warm = [top.result.assign]
                allowed = self._largest_window(
                    reqs, top.result.step_ms, alpha, pol.window_min, pol.window_max - 1
                )
                start = pol.window_min if allowed is None else allowed
        best = self._solve(
            ctx, reqs, start, SEARCH_SHARE, warm, local_first=optimistic, source=top if optimistic else None
        )
        self._remember(best, hint)
        if not self._ok(best, alpha) and start > pol.window_min:
            best = self._solve(
                ctx, reqs, pol.window_min, SEARCH_SHARE, self._assigns(best, warm), source=best
            )
            self._remember(best, hint)
        if not self._ok(best, alpha):
            return None
        top_window = pol.window_max - 1 if optimistic else pol.window_max
        for probes_left in (2, 1):
            assert best.result is not None
            hi = self._largest_window(reqs, best.result.step_ms, alpha, best.window, top_window)
            if hi is None or hi <= best.window:
                break
            probe = self._solve(
                ctx, reqs, hi, PROBE_SHARE, self._assigns(best), source=best
            )
            if self._ok(probe, alpha):
                best = probe
                continue
            top_window = hi - 1
            mid = (best.window + hi) // 2
            if mid <= best.window or probes_left == 1:
                break
            probe = self._solve(
                ctx, reqs, mid, PROBE_SHARE, self._assigns(best, self._assigns(probe)), source=best
            )
            if self._ok(probe, alpha):
                best = probe
            break
        return best

    @staticmethod
    def _assigns(solved: Solved, more: Sequence[tuple[int, ...]] = ()) -> list[tuple[int, ...]]:
        out = [] if solved.result is None else [solved.result.assign]
        if solved.search is not None:
            out += [a for _, a in solved.search.runners_up if a not in out]
        return out + [a for a in more if a not in out]

    # --- pausing ------------------------------------------------------------------------
    @classmethod
    def _victim_order(
        cls, batch: Batch, rule: str, rng: random.Random | None
    ) -> list[RequestSpec]:
        """Every request in the order the victim rule would pause them one by one; requests
        about to finish (:data:`FINISHING_TOKENS`) last, in the same order among themselves."""
        order = cls._rule_order(batch, rule, rng)
        finishing = [r for r in order if about_to_finish(r.remaining_tokens)]
        last = {id(r) for r in finishing}
        return [r for r in order if id(r) not in last] + finishing

    @classmethod
    def _rule_order(cls, batch: Batch, rule: str, rng: random.Random | None) -> list[RequestSpec]:
        bs = batch.model.block_size
        if rule in ("largest", "lost-first"):  # stable sorts: ties go in batch order, as max()/min() pick
            return sorted(batch.requests, key=lambda r: -(r.blocks(bs) + r.deposit_tokens))
        if rule == "longest":
            return sorted(batch.requests, key=lambda r: -r.context_tokens)
        if rule == "shortest":
            return sorted(batch.requests, key=lambda r: r.context_tokens)
        if rng is None:
            raise ValueError("the random victim rule needs an rng")
        reqs = list(batch.requests)  # "random": one draw per pause, from those left
        order = []
        while reqs:
            order.append(reqs.pop(rng.randrange(len(reqs))))
        return order

    # --- result -------------------------------------------------------------------------
    @staticmethod
    def _to_plan(
        batch: Batch,
        chosen: Solved | None,
        paused: list[str],
        solve_ms: float,
        current_step: int | None,
    ) -> Plan:
        return build_plan(
            batch,
            reqs=chosen.reqs if chosen is not None else (),
            window=chosen.window if chosen is not None else batch.policy.window_min,
            result=chosen.result if chosen is not None else None,
            ev=chosen.ev if chosen is not None else None,
            late_fraction=chosen.late_fraction() if chosen is not None else 0.0,
            paused=paused,
            solve_ms=solve_ms,
            current_step=current_step,
        )
