"""Planner variants for OrbitFlow's ablation (Fig. 14a), all on the control plane's own code.

They implement the controller's ``PlannerLike`` protocol and are injected into the real
:class:`~controlplane.controller.SessionController`:

* :class:`NoDepositPlanner` — the real :class:`~controlplane.planner.Planner` with every
  ``deposit_tokens`` zeroed (the SLO cap gets no credit from a deposit the ablation lacks);
* :class:`NoPausePlanner` — the real planner with the SLO cap disabled (``alpha`` very large), so
  it only minimises the step time and pauses only when even all-offloaded does not fit memory;
* :class:`UniformPlanner` — "Batch-Uniform": one distance-driven candidate for the whole batch,
  the fastest that fits memory at the window's end, evaluated by the exact timeline
  (:class:`~controlplane.planner.evaluator.Evaluator` on the planner's candidate set). The real
  planner exposes no option to restrict its candidates, so the uniform search is done here; the
  timeline and candidates are the control plane's.
"""

from __future__ import annotations

import dataclasses
import random
import time

from controlplane.model import Batch, Plan, PlanPolicy, RequestSpec
from controlplane.planner import Planner
from controlplane.planner.candidates import candidate_set
from controlplane.planner.evaluator import Evaluator

NO_CAP_ALPHA = 1e6


def _without_deposits(batch: Batch) -> Batch:
    reqs = tuple(dataclasses.replace(r, deposit_tokens=0) for r in batch.requests)
    return dataclasses.replace(batch, requests=reqs)


class NoDepositPlanner:
    """The real planner, blind to token deposits."""

    def __init__(self, inner: Planner) -> None:
        self.inner = inner

    def plan(self, batch: Batch, **kw) -> Plan:  # noqa: ANN003 - PlannerLike signature
        return self.inner.plan(_without_deposits(batch), **kw)


class NoPausePlanner:
    """The real planner without the SLO cap (and without deposits): never pauses for SLO."""

    def __init__(self, inner: Planner) -> None:
        self.inner = inner

    def plan(self, batch: Batch, **kw) -> Plan:  # noqa: ANN003
        pol = PlanPolicy(alpha=NO_CAP_ALPHA, window_min=batch.policy.window_min,
                         window_max=batch.policy.window_max)
        return self.inner.plan(dataclasses.replace(_without_deposits(batch), policy=pol), **kw)


class UniformPlanner:
    """Batch-uniform placement: the fastest single candidate for all requests that fits."""

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
        t0 = time.perf_counter()
        cands = candidate_set(batch.model.layers)
        reqs: list[RequestSpec] = list(batch.requests)
        paused: list[str] = []
        rng = random.Random(seed)
        pol = batch.policy
        while reqs:
            for window in (pol.window_max, pol.window_min):
                blocks = [r.blocks(batch.model.block_size, window) for r in reqs]
                ev = Evaluator(cands, blocks, batch.profile.layer_compute_ms,
                               batch.bw_blocks_per_ms, launch_ms=batch.profile.fetch_launch_ms)
                best: tuple[float, int] | None = None
                for c in range(cands.size):
                    assign = (c,) * len(reqs)
                    if ev.memory(assign) > batch.hardware.gpu_kv_budget_blocks:
                        continue
                    t = ev.exact_ms(assign)
                    if best is None or t < best[0] - 1e-12:
                        best = (t, c)
                if best is not None:
                    t, c = best
                    res, stg = ev.split_memory((c,) * len(reqs))
                    return Plan(
                        feasible=True,
                        paused=tuple(paused),
                        placements={r.id: cands.rows[c] for r in reqs},
                        predicted_step_ms=t,
                        window_steps=window,
                        resident_blocks=res,
                        staging_blocks=stg,
                        solver="uniform",
                        solve_ms=(time.perf_counter() - t0) * 1e3,
                        expiry_step=None if current_step is None else current_step + window,
                    )
            # Not even all-offloaded fits: a victim must go (physical necessity, not SLO).
            victim = self._victim([r for r in reqs if r.id not in keep] or reqs, victim_rule,
                                  batch.model.block_size, rng)
            paused.append(victim.id)
            reqs = [r for r in reqs if r.id != victim.id]
        return Plan(False, tuple(paused), {}, 0.0, pol.window_min, 0, 0, "uniform",
                    (time.perf_counter() - t0) * 1e3,
                    None if current_step is None else current_step + pol.window_min)

    @staticmethod
    def _victim(reqs: list[RequestSpec], rule: str, block_size: int,
                rng: random.Random) -> RequestSpec:
        if rule == "shortest":
            return min(reqs, key=lambda r: (r.context_tokens, r.id))
        if rule == "random":
            return rng.choice(reqs)
        if rule == "longest":
            return max(reqs, key=lambda r: (r.context_tokens, r.id))
        return max(reqs, key=lambda r: (r.blocks(block_size) + r.deposit_tokens, r.id))
