"""The placement planner (issue 2 §3): window selection, SLO cap, pausing victims.

For a batch, :meth:`Planner.plan`

1. sizes every request at the window's end: ``b_r = ceil((context_r + Δ) / block_size)`` (the
   plan is computed one step ahead and must stay valid for Δ steps; OrbitFlow §3.3.2 "adding one
   token to align with the target step", §3.3.1 decode window);
2. searches candidate layouts (:class:`PlacementSearch`, with the CBC stage when the budget allows)
   for the least exact step time ``T`` that fits memory;
3. checks the SLO cap of OrbitFlow §3.3.1 with token deposits (§3.2):
   ``sum_r max(0, 1 - slo_r / T - deposit_r / Δ) <= alpha``;
4. picks the largest feasible Δ in ``[window_min, window_max]``: ``window_max`` first, else
   ``window_min``, then bisection (feasibility is monotone: a larger Δ has more blocks, hence a
   larger optimal ``T``, and a smaller deposit credit ``deposit_r / Δ``);
5. when even ``window_min`` is infeasible (memory or SLO cap), pauses a victim by the victim rule
   and re-plans, repeatedly (§3.4).

``feasible`` in the returned plan: the placements of the running requests fit memory and meet the
SLO cap, and at least one request runs (or the batch was empty). A batch whose every request had
to be paused gives ``feasible=False`` with all ids in ``paused``.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass

import structlog

from controlplane.model import Batch, Plan, RequestSpec
from controlplane.planner.candidates import candidate_set
from controlplane.planner.evaluator import Evaluator
from controlplane.planner.mip_search import MipStage
from controlplane.planner.search import PlacementSearch, SearchResult

log = structlog.get_logger(__name__)

VICTIM_RULES = ("largest", "longest", "shortest", "random")
DEFAULT_BUDGET_FRACTION = 0.25
"""Default time budget: this fraction of the predicted step (all-on-GPU compute first)."""


@dataclass(frozen=True)
class _Solved:
    reqs: tuple[RequestSpec, ...]
    window: int
    ev: Evaluator
    result: SearchResult | None

    def late_fraction(self) -> float:
        """``sum_r max(0, 1 - slo_r / T - deposit_r / Δ)`` (OrbitFlow §3.3.1 with §3.2)."""
        if self.result is None:
            return math.inf
        t = self.result.step_ms
        return sum(
            max(0.0, 1.0 - r.slo_tbt_ms / t - r.deposit_tokens / self.window) for r in self.reqs
        )


class Planner:
    """Stateless placement planner; safe to share between threads."""

    def __init__(
        self,
        *,
        use_mip: bool = True,
        exact_search: bool = True,
        budget_fraction: float = DEFAULT_BUDGET_FRACTION,
    ) -> None:
        if not 0.0 < budget_fraction <= 100.0:
            raise ValueError(f"budget_fraction must be in (0, 100], got {budget_fraction}")
        self._mip = MipStage() if use_mip else None
        self._exact = exact_search
        self._fraction = budget_fraction

    def plan(
        self,
        batch: Batch,
        *,
        time_budget_ms: float | None = None,
        victim_rule: str = "largest",
        current_step: int | None = None,
        seed: int = 0,
    ) -> Plan:
        """The placement for ``batch``; never raises for a valid batch (see module docstring)."""
        t0 = time.perf_counter()
        if victim_rule not in VICTIM_RULES:
            raise ValueError(f"victim_rule {victim_rule!r} is not one of {VICTIM_RULES}")
        if time_budget_ms is not None and not time_budget_ms >= 0:
            raise ValueError(f"time_budget_ms must be >= 0, got {time_budget_ms}")
        compute_ms = sum(batch.profile.layer_compute_ms)
        budget_ms = self._fraction * compute_ms if time_budget_ms is None else time_budget_ms
        deadline = t0 + budget_ms / 1e3
        rng = random.Random(seed)
        reqs = tuple(batch.requests)
        paused: list[str] = []
        chosen: _Solved | None = None
        hint: dict[str, int] = {}
        while reqs:
            chosen = self._best_window(batch, reqs, deadline, hint)
            if chosen is not None:
                break
            victim = self._victim(batch, reqs, victim_rule, rng)
            paused.append(victim.id)
            reqs = tuple(r for r in reqs if r.id != victim.id)
        solve_ms = (time.perf_counter() - t0) * 1e3
        plan = self._to_plan(batch, chosen, paused, solve_ms, current_step)
        log.info(
            "plan_solved",
            requests=len(batch.requests),
            paused=len(paused),
            window_steps=plan.window_steps,
            predicted_step_ms=round(plan.predicted_step_ms, 4),
            solver=plan.solver,
            solve_ms=round(solve_ms, 3),
            budget_ms=round(budget_ms, 3),
        )
        return plan

    # --- window selection ---------------------------------------------------------------
    def _solve(
        self,
        batch: Batch,
        reqs: tuple[RequestSpec, ...],
        window: int,
        deadline: float,
        warm: Sequence[tuple[int, ...]] = (),
    ) -> _Solved:
        cands = candidate_set(batch.model.layers)
        blocks = [r.blocks(batch.model.block_size, window) for r in reqs]
        ev = Evaluator(cands, blocks, batch.profile.layer_compute_ms, batch.bw_blocks_per_ms)
        search = PlacementSearch(ev, batch.hardware.gpu_kv_budget_blocks, deadline)
        result = search.run(warm, mip=self._mip, exact=self._exact)
        return _Solved(reqs, window, ev, result)

    def _ok(self, solved: _Solved, alpha: float) -> bool:
        return solved.result is not None and solved.late_fraction() <= alpha + 1e-12

    @staticmethod
    def _remember(solved: _Solved, hint: dict[str, int]) -> None:
        """Keep each request's layout as a warm start for re-planning after a pause."""
        if solved.result is not None:
            hint.update((r.id, c) for r, c in zip(solved.reqs, solved.result.assign, strict=True))

    @staticmethod
    def _largest_window(
        reqs: tuple[RequestSpec, ...], step_ms: float, alpha: float, lo: int, hi: int
    ) -> int | None:
        """Largest Δ in [lo, hi] whose late fraction at step time ``step_ms`` is within alpha.

        The late fraction grows with Δ (the deposit credit ``deposit_r / Δ`` shrinks).
        """

        def ok(window: int) -> bool:
            late = sum(
                max(0.0, 1.0 - r.slo_tbt_ms / step_ms - r.deposit_tokens / window) for r in reqs
            )
            return late <= alpha + 1e-12

        if lo > hi or not ok(lo):
            return None
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if ok(mid):
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _best_window(
        self,
        batch: Batch,
        reqs: tuple[RequestSpec, ...],
        deadline: float,
        hint: dict[str, int],
    ) -> _Solved | None:
        """The plan at the largest feasible window, or None when even ``window_min`` fails.

        A plan for Δ stays valid for any smaller window (fewer blocks, step time no larger), so
        the plan found at ``window_max`` bounds the step time from above: the largest window its
        step time allows is feasible. Larger windows up to the one allowed by the (smaller) step
        time at that window are then bisected with warm-started searches.
        """
        pol = batch.policy
        hinted = [tuple(hint[r.id] for r in reqs)] if all(r.id in hint for r in reqs) else []
        if hint and time.perf_counter() >= deadline:
            # Out of time while pausing victims: only check the smallest window, warm-started.
            best = self._solve(batch, reqs, pol.window_min, deadline, hinted)
            self._remember(best, hint)
            return best if self._ok(best, pol.alpha) else None
        top = self._solve(batch, reqs, pol.window_max, deadline, hinted)
        self._remember(top, hint)
        if self._ok(top, pol.alpha):
            return top
        if top.result is not None:
            start = self._largest_window(reqs, top.result.step_ms, pol.alpha, pol.window_min, pol.window_max)
            warm = [top.result.assign]
        else:
            start, warm = None, []
        best = self._solve(batch, reqs, pol.window_min if start is None else start, deadline, warm)
        self._remember(best, hint)
        if not self._ok(best, pol.alpha):
            return None
        assert best.result is not None
        lo = best.window
        hi = self._largest_window(reqs, best.result.step_ms, pol.alpha, lo, pol.window_max - 1)
        hi = lo if hi is None else hi
        while hi > lo and time.perf_counter() < deadline:
            mid = (lo + hi + 1) // 2
            probe = self._solve(batch, reqs, mid, deadline, [best.result.assign, *warm])
            if self._ok(probe, pol.alpha):
                best, lo = probe, mid
            else:
                hi = mid - 1
                if probe.result is not None:
                    warm = [probe.result.assign]
        return best

    # --- pausing ------------------------------------------------------------------------
    @staticmethod
    def _victim(
        batch: Batch, reqs: tuple[RequestSpec, ...], rule: str, rng: random.Random
    ) -> RequestSpec:
        """The request to pause (OrbitFlow §3.4: largest ``blocks + deposit_tokens``)."""
        bs = batch.model.block_size
        if rule == "largest":
            return max(reqs, key=lambda r: r.blocks(bs) + r.deposit_tokens)
        if rule == "longest":
            return max(reqs, key=lambda r: r.context_tokens)
        if rule == "shortest":
            return min(reqs, key=lambda r: r.context_tokens)
        return reqs[rng.randrange(len(reqs))]

    # --- result -------------------------------------------------------------------------
    @staticmethod
    def _to_plan(
        batch: Batch,
        chosen: _Solved | None,
        paused: list[str],
        solve_ms: float,
        current_step: int | None,
    ) -> Plan:
        window = chosen.window if chosen is not None else batch.policy.window_min
        expiry = None if current_step is None else current_step + window
        if chosen is None or chosen.result is None:
            return Plan(
                feasible=not batch.requests,
                paused=tuple(paused),
                placements={},
                predicted_step_ms=0.0,
                window_steps=window,
                resident_blocks=0,
                staging_blocks=0,
                solver="empty" if not batch.requests else "all-paused",
                solve_ms=solve_ms,
                expiry_step=expiry,
                extras={"late_fraction": 0.0, "optimal": True},
            )
        res, ev = chosen.result, chosen.ev
        rows = ev.cands.rows
        resident, staging = ev.split_memory(res.assign)
        return Plan(
            feasible=True,
            paused=tuple(paused),
            placements={r.id: rows[c] for r, c in zip(chosen.reqs, res.assign, strict=True)},
            predicted_step_ms=res.step_ms,
            window_steps=window,
            resident_blocks=resident,
            staging_blocks=staging,
            solver=res.solver,
            solve_ms=solve_ms,
            expiry_step=expiry,
            extras={
                "late_fraction": chosen.late_fraction(),
                "optimal": res.optimal,
                "evaluations": res.evaluations,
                "layouts": [ev.cands.labels[c] for c in res.assign],
            },
        )
