"""``layerkv``: LayerKV (admission by its SLO-aware scheduler + layer-wise prefill offload).

* Admission: the control plane's :class:`LayerKVScheduler` (LayerKV §3.1 Eq. 1-2, prefill time by
  Eq. 3), which also returns the minimum GPU-retained layers of each admitted prefill (Eq. 4);
  the engine runs the prefill with that many layers kept and the rest offloaded, overlapped.
* Decode: LayerKV "maximises the number of layers retained on the GPU" (§5.2.3): every step the
  batch keeps the most layers that fit (uniform distance-driven candidate), offloaded layers
  are fetched layer by layer (§4). No pause, no token deposit.
"""

from __future__ import annotations

from controlplane.controller.schedulers import LayerKVScheduler
from controlplane.policy import LayerKVParams, Policy
from simulator.policies.base import BasePolicy
from simulator.state import Actions, EngineView


class LayerKVPolicy(BasePolicy):
    name = "layerkv"

    def start(self, profile, trace) -> None:  # noqa: ANN001
        super().start(profile, trace)
        p = profile
        self.cp_policy = Policy(
            slo_tbt_ms=self.cp_policy.slo_tbt_ms,
            slo_ttft_ms=self.cp_policy.slo_ttft_ms,
            scheduler="layerkv",
            layerkv=LayerKVParams(
                model_params=p.n_params,
                hidden_size=p.layers * p.hidden,
                device_tflops=p.prefill_tflops,
                prefill_correction=p.prefill_alpha,
                offload_correction=p.offload_beta,
                # LayerKV predicts the output length; the trace's max_new_tokens is an oracle
                # predictor (the scheduler caps the lower bound by max_new_tokens).
                output_len_lower_bound=1 << 24,
            ),
        )
        self._sched = LayerKVScheduler("paper")  # the LayerKV baseline: the paper's rule
        self._tpot_ms = p.decode_resident_ms(0)

    def observe(self, view, info) -> None:  # noqa: ANN001
        if info.kind == "decode" and info.tokens:
            self._tpot_ms = info.dur_ms

    def decide(self, view: EngineView) -> Actions:
        p = self.p
        act = Actions()
        if view.queued:
            sv = self.scheduler_view(view, tpot_ms=self._tpot_ms,
                                     free_blocks=self.free_blocks(view))
            sd = self._sched.schedule(sv)
            act.admit = list(sd.admit)
            act.gpu_layers = dict(sd.min_gpu_layers)
        running = list(view.running)
        if running:
            blocks = [r.blocks(p) for r in running]
            cand = self.fewest_offload_fitting(blocks, p.gpu_kv_budget_blocks)
            row = self.cands.rows[cand]
            act.placements = {r.id: row for r in running}
        return act
