"""Where the recompute option joins the planner's pausing and window choice (issue 16).

The layout-only procedure of :class:`.Planner` runs first and unchanged (same searches, same
budget shares, same pauses, same polish), so the plan with recompute offered is **never worse**
than the plan the same call would return without it: :meth:`RecomputeWindows.improve` only spends
the time the layouts left (they often prove their answer optimal early), and the joint layout +
``(u, k)`` search (:class:`.RecomputeSearch`) always starts from a layout answer and keeps it
unless it finds a strictly faster one:

1. **Fewer pauses.** The last victim paused (for the "largest" rule: the smallest of them) is
   resumed when a joint search at ``window_min`` for the running requests plus it meets the SLO
   cap's threshold step (:func:`.slo_cap.max_step_ms`) within the memory budget; repeated while
   it succeeds (the paused set stays a prefix of the victim order). The pause bound with
   recompute (:meth:`.RecomputeGrid.step_lower_bound_ms`) skips hopeless tries.
2. **Larger window** (:meth:`RecomputeWindows.widen`): the joint step at the chosen window
   bounds the largest window the SLO cap allows (:func:`.slo_cap.largest_window`); that window is
   probed (layouts first, then the joint search against its threshold) and, if it fails, the
   midpoint once, as the layout procedure probes. The window only grows.
3. **Faster step**: the joint search at the final window with the rest of the budget.

Joint searches are cached per (requests, blocks), like the layout searches.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from controlplane.model import RequestSpec
from controlplane.planner.plan_context import PlanContext
from controlplane.planner.recompute_evaluator import RecomputeEvaluator
from controlplane.planner.recompute_search import RecomputeSearch
from controlplane.planner.slo_cap import largest_window, max_step_ms
from controlplane.planner.solved import Solved

SolveLayouts = Callable[[PlanContext, tuple[RequestSpec, ...], int, float, Sequence[tuple[int, ...]]], Solved]
"""The planner's layout search at one window: ``(ctx, reqs, window, share, warm) -> Solved``."""

RESUME_SHARE = 0.4
"""Share of the remaining budget for the joint search that tries to resume a victim (its layout
base gets half as much)."""
PROBE_SHARE = 0.25
"""Share for each joint probe above the chosen window (and for the joint search at it)."""


class RecomputeWindows:
    """The recompute option's part of one :meth:`Planner.plan` (see module docstring)."""

    def __init__(self, solve_layouts: SolveLayouts, *, exact: bool = True) -> None:
        self._solve = solve_layouts
        self._exact = exact

    def improve(
        self,
        ctx: PlanContext,
        chosen: Solved | None,
        paused: Sequence[RequestSpec],
        allows: Callable[[tuple[RequestSpec, ...]], bool],
    ) -> tuple[Solved | None, int]:
        """The plan with recompute from the layouts' ``chosen`` (None: every request paused)
        and ``paused`` victims in pause order; returns it and how many victims stay paused.
        ``allows(reqs)``: the pause bound with recompute does not rule ``reqs`` out."""
        running = () if chosen is None else chosen.reqs
        n_paused = len(paused)
        order = {r.id: i for i, r in enumerate(ctx.batch.requests)}
        while n_paused and ctx.left_s() > 0:
            more = tuple(sorted((*running, paused[n_paused - 1]), key=lambda r: order[r.id]))
            if not allows(more):
                break
            resumed = self._resume(ctx, more)
            if resumed is None:
                break
            chosen, running, n_paused = resumed, more, n_paused - 1
        if chosen is None or chosen.result is None:
            return chosen, n_paused
        chosen = self.widen(ctx, chosen)
        if ctx.left_s() > 0:
            chosen = self.joint(ctx, chosen, ctx.deadline, None)
        return chosen, n_paused

    def joint(
        self, ctx: PlanContext, solved: Solved, deadline: float, target: float | None
    ) -> Solved:
        """The joint search from ``solved``'s answer until ``deadline`` (or until it meets
        ``target``), continued when one of the same requests and blocks ran before."""
        assert ctx.grid is not None and solved.result is not None
        key = (tuple(r.id for r in solved.reqs), tuple(solved.ev.blocks))
        prev = ctx.joint.get(key)
        if prev is not None and prev.rsearch is not None:
            rsearch = prev.rsearch
            result = rsearch.resume(solved.result, deadline, target_ms=target)
        elif ctx.clock() >= deadline:
            return solved  # no time to build a search: the layouts' answer stands
        else:
            rsearch = RecomputeSearch(
                RecomputeEvaluator(ctx.cands, solved.ev.blocks, solved.ev.comp, solved.ev.bw, ctx.grid,
                                   solved.ev.launch_ms),
                ctx.batch.hardware.gpu_kv_budget_blocks,
                deadline,
                target_ms=target,
                clock=ctx.clock,
            )
            ctx.searches += 1
            result = rsearch.run(solved.result, exact=self._exact)
        out = dataclasses.replace(solved, result=result, rsearch=rsearch)
        ctx.joint[key] = out
        return out

    def _against_cap(self, ctx: PlanContext, solved: Solved, share: float) -> Solved:
        """``solved`` when its layouts meet the SLO cap, else the joint search against the
        threshold step of its window (:func:`.slo_cap.max_step_ms`)."""
        alpha = ctx.batch.policy.alpha
        if solved.result is None or solved.ok(alpha):
            return solved
        target = max_step_ms(solved.reqs, solved.window, alpha, solved.ev.compute_ms)
        if target < 0:  # the compute alone breaks the cap; recompute only adds compute
            return solved
        return self.joint(ctx, solved, ctx.share_deadline(share), target)

    def _resume(self, ctx: PlanContext, reqs: tuple[RequestSpec, ...]) -> Solved | None:
        """A plan for ``reqs`` at ``window_min`` with recompute, or None."""
        solved = self._solve(ctx, reqs, ctx.batch.policy.window_min, RESUME_SHARE / 2, [])
        solved = self._against_cap(ctx, solved, RESUME_SHARE)
        return solved if solved.ok(ctx.batch.policy.alpha) else None

    def widen(self, ctx: PlanContext, chosen: Solved) -> Solved:
        """The largest window the joint step allows above ``chosen``'s (or ``chosen``)."""
        pol = ctx.batch.policy
        if chosen.window >= pol.window_max or chosen.result is None or ctx.left_s() <= 0:
            return chosen
        best = chosen if chosen.rsearch is not None else self.joint(
            ctx, chosen, ctx.share_deadline(PROBE_SHARE), None
        )
        for probes_left in (2, 1):
            assert best.result is not None
            hi = largest_window(best.reqs, best.result.step_ms, pol.alpha, best.window, pol.window_max)
            if hi is None or hi <= best.window:
                break
            probe = self._probe(ctx, best, hi)
            if probe.ok(pol.alpha):
                best = probe
                continue
            mid = (best.window + hi) // 2
            if mid <= best.window or probes_left == 1:
                break
            probe = self._probe(ctx, best, mid)
            if probe.ok(pol.alpha):
                best = probe
            break
        return best

    def _probe(self, ctx: PlanContext, best: Solved, window: int) -> Solved:
        assert best.result is not None
        solved = self._solve(ctx, best.reqs, window, PROBE_SHARE / 2, [best.result.assign])
        return self._against_cap(ctx, solved, PROBE_SHARE)
