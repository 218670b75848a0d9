"""``lvf``: SuperInfer's RotaSched (Largest-VLT-First rotation, SuperInfer §4.2).

Running requests keep all their KV on the GPU (vLLM paging, no layer-wise offload). Each step the
control plane's :class:`LvfScheduler` (Algorithm 1) picks waiting requests to admit, rotary
(swapped-out) requests to rotate back in, and running requests to rotate out, within the
transfer budget ``B_xfer``. Rotation moves a request's whole KV over the link, overlapped with the
step (DuplexKV's full-duplex, cross-iteration pipeline, §4.3.2). KV growth beyond the GPU swaps
out the newest request (vLLM's rule). Parameters: SuperInfer §5.2 (alpha=3, beta_B=0, beta_F=0.5,
B_xfer=2400 all-layer blocks).
"""

from __future__ import annotations

from controlplane.controller.schedulers import LvfScheduler
from controlplane.policy import LVFParams, Policy
from simulator.policies.base import BasePolicy
from simulator.state import Actions, EngineView

XFER_BLOCKS_ALL_LAYERS = 2400
"""SuperInfer §5.2: B_xfer in blocks of all layers."""


class LvfPolicy(BasePolicy):
    name = "lvf"
    layered = False
    overlap_swaps = True
    paused_hold_slot = False

    def start(self, profile, trace) -> None:  # noqa: ANN001
        super().start(profile, trace)
        self.cp_policy = Policy(
            slo_tbt_ms=self.cp_policy.slo_tbt_ms,
            slo_ttft_ms=self.cp_policy.slo_ttft_ms,
            scheduler="lvf",
            lvf=LVFParams(alpha=3.0, beta_b=0.0, beta_f=0.5,
                          transfer_budget_blocks=XFER_BLOCKS_ALL_LAYERS * profile.layers),
        )
        self._sched = LvfScheduler()

    def decide(self, view: EngineView) -> Actions:
        p = self.p
        L = p.layers
        act = Actions()
        budget = p.gpu_kv_budget_blocks
        running = sorted(view.running, key=lambda r: (r.spec.arrival_ms, r.id))
        need = sum(p.blocks(r.context + 1) * L for r in running)
        while running and need > budget:
            victim = running.pop()
            need -= p.blocks(victim.context + 1) * L
            act.preempt_swap.append(victim.id)
        if act.preempt_swap:
            return act
        if view.queued or view.swapped:
            sv = self.scheduler_view(view, tpot_ms=view.last_step_ms,
                                     free_blocks=max(0, budget - need))
            sd = self._sched.schedule(sv)
            act.preempt_swap = [rid for rid in sd.pause
                                if any(r.id == rid for r in view.running)]
            act.resume = list(sd.resume)
            act.admit = list(sd.admit)
        return act
