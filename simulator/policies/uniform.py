"""Batch-uniform offloading baselines as OrbitFlow §5.1 defines them.

Every request of the batch uses the same distance-driven candidate (offload every k-th layer);
they differ in how and when the candidate is chosen:

* ``deepspeed`` (DeepSpeed-Inference): every layer offloaded, next-layer prefetch only.
* ``flexgen``: one static candidate chosen at start for the worst case (``max_batch_size``
  requests holding ``token_budget`` tokens): the fewest offloaded layers that fit; never changes.
* ``flexgen+``: re-chosen whenever the batch changes (a request joins or leaves): the fastest
  candidate whose memory fits the batch at its final lengths (throughput-optimal, SLO-unaware).
* ``slo-aware``: re-chosen on batch change from the profile and the SLO: the *most* offloaded
  candidate whose predicted step time at final lengths meets the tightest TBT SLO (loose SLO ->
  more offload); when none meets it, the fastest that fits.
* ``dynamic-heuristic``: re-chosen every step: the fewest offloaded layers that fit now.

All of them also step to the next fitting candidate when KV growth would overflow memory (the
minimum any real system does), admit with the control plane's FCFS scheduler (the same admission
as ``orbitflow``: batch size and token budget, prompt layers that do not fit offloaded at
prefill, OrbitFlow §5.1), and never pause.
"""

from __future__ import annotations

from simulator.policies.base import BasePolicy
from simulator.state import Actions, EngineView


class UniformPolicy(BasePolicy):
    """A batch-uniform candidate chooser; ``mode`` selects the rule above."""

    MODES = ("deepspeed", "flexgen", "flexgen+", "slo-aware", "dynamic-heuristic")

    def __init__(self, mode: str) -> None:
        if mode not in self.MODES:
            raise ValueError(f"uniform policy mode: {mode!r} is not one of {self.MODES}")
        self.name = mode
        self.mode = mode
        self._cand: int | None = None
        self._batch: frozenset[str] = frozenset()

    def start(self, profile, trace) -> None:  # noqa: ANN001 - protocol signature
        super().start(profile, trace)
        p = profile
        if self.mode == "deepspeed":
            self._cand = self.cands.size - 1
        elif self.mode == "flexgen":
            worst = [p.blocks(-(-p.token_budget // p.max_batch_size))] * p.max_batch_size
            self._cand = self.fewest_offload_fitting(worst, p.gpu_kv_budget_blocks)
        self._batch = frozenset()

    def _choose(self, view: EngineView, ids: list) -> int:
        p = self.p
        reqs = list(ids)
        now_blocks = [r.blocks(p) for r in reqs]
        budget = p.gpu_kv_budget_blocks - sum(
            r.blocks(p) * r.resident_layers() for r in view.paused)
        if self.mode == "dynamic-heuristic":
            return self.fewest_offload_fitting(now_blocks, budget)
        final = self.projected_blocks(p, reqs)
        fits = [c for c in range(self.cands.size) if self.uniform_memory(c, final) <= budget]
        if not fits:
            return self.fewest_offload_fitting(now_blocks, budget)
        if self.mode == "flexgen+":
            return min(fits, key=lambda c: (self.uniform_time(c, final), -c))
        # slo-aware
        slo = min(r.spec.slo_tbt_ms for r in reqs)
        meeting = [c for c in fits if self.uniform_time(c, final) <= slo]
        if meeting:
            return max(meeting)
        return min(fits, key=lambda c: (self.uniform_time(c, final), -c))

    def decide(self, view: EngineView) -> Actions:
        p = self.p
        admit, keep = self.fcfs_scheduler_admit(view)
        act = Actions(admit=admit)
        running = list(view.running)
        for rid in admit:
            act.gpu_layers[rid] = keep.get(rid, p.layers)  # the rest offloaded at prefill
        if not running:
            return act
        ids = frozenset(r.id for r in running)
        if self.mode in ("flexgen+", "slo-aware"):
            if ids != self._batch or self._cand is None:
                self._cand = self._choose(view, running)
                act.solver_calls = 0
        elif self.mode == "dynamic-heuristic":
            self._cand = self._choose(view, running)
        self._batch = ids
        cand = self._cand if self._cand is not None else self.cands.size - 1
        # Growth guard: step to the next candidate that fits now.
        blocks = [r.blocks(p) for r in running]
        budget = p.gpu_kv_budget_blocks
        while cand < self.cands.size - 1 and self.uniform_memory(cand, blocks) > budget:
            cand += 1
        if self.mode != "flexgen":
            self._cand = cand
        row = self.cands.rows[cand]
        act.placements = {r.id: row for r in running}
        return act
