"""LayerKV's SLO-aware scheduler (LayerKV §3.1, Eq. 1-4, Algorithm 1).

Admit queued prefills in arrival order as long as the decoding requests keep their TPOT SLO:

* Eq. 1, for each decoding request ``i``::

      T_allow_prefill^i = T_tpot^i * (N_past^i + N_future^i) - (T_past^i + T_future^i)

  ``T_tpot^i = tpot_margin * slo_tbt_ms`` (the TPOT target), ``N_past`` = tokens generated so
  far, ``T_past`` = time since the controller first saw it decoding (includes waiting),
  ``N_future`` = conservative remaining tokens: ``max(1, lower_bound - N_past)`` where the lower
  bound is ``output_len_lower_bound`` (capped by ``max_new_tokens`` when known) - the paper takes
  it from a length classifier's lower range bound; we take it from the policy - and
  ``T_future = current TPOT * N_future``.
* Eq. 2: admit ``q_1..q_n`` while ``sum_k T_prefill^{q_k} < min_i T_allow_prefill^i`` (no
  decoding request: no TPOT bound).
* Eq. 3: ``T_prefill = alpha * seqlen * (2 * n_param + 2 * seqlen * n_hidden) / FLOPS`` with
  ``alpha = prefill_correction``.
* Eq. 4: ``T_offload(x) = beta * seqlen * 2 (L - x) * d_head * n_heads * f_precision / PCIe_bw``;
  ``2 * d_head * n_heads * f_precision`` is the KV bytes of one token in one layer, i.e.
  ``block_bytes / block_size``, and the PCIe bandwidth is the profiled link bandwidth. The minimum
  GPU-retained layers ``x`` is the smallest integer with ``T_offload(x) <= T_prefill`` (so the
  offload hides under the prefill compute) -> ``Decision.min_gpu_layers``.

Memory: an admitted prefill holds ``max(x, 1)`` of its layers on the GPU (at least one layer is the
send buffer the offload streams from), which must fit the free blocks. The summed prompt tokens of
one step are capped by ``max_prefill_tokens``; a head-of-queue prompt longer than the cap is
admitted alone (the engine chunks it) so it can never block the queue forever.
"""

from __future__ import annotations

import math

from controlplane.controller.schedulers.base import (
    RequestView,
    SchedulerDecision,
    SchedulerView,
    prompt_blocks,
)
from controlplane.policy import LayerKVParams


def allow_prefill_ms(r: RequestView, view: SchedulerView, params: LayerKVParams) -> float:
    """LayerKV Eq. 1: prefill time request ``r`` can absorb and still meet its TPOT target."""
    t_tpot = params.tpot_margin * r.slo_tbt_ms
    n_past = r.generated_tokens
    lower = params.output_len_lower_bound
    if r.max_new_tokens is not None:
        lower = min(lower, r.max_new_tokens)
    n_future = max(1, lower - n_past)
    t_past = max(0.0, view.now_ms - r.first_seen_ms)
    t_future = view.tpot_ms * n_future
    return t_tpot * (n_past + n_future) - (t_past + t_future)


def prefill_ms(prompt_tokens: int, params: LayerKVParams) -> float:
    """LayerKV Eq. 3: estimated prefill time (ms) of a prompt of ``prompt_tokens``."""
    flops = prompt_tokens * (2 * params.model_params + 2 * prompt_tokens * params.hidden_size)
    return 1e3 * params.prefill_correction * flops / (params.device_tflops * 1e12)


def min_gpu_layers(prompt_tokens: int, view: SchedulerView, params: LayerKVParams) -> int:
    """LayerKV Eq. 4: fewest layers to keep on the GPU so offloading hides under the prefill."""
    layers = view.model.layers
    bytes_per_token_layer = view.model.block_bytes / view.model.block_size
    bw_bytes_per_ms = view.h2d_gbps * 1e9 / 1e3
    per_layer_ms = (
        params.offload_correction * prompt_tokens * bytes_per_token_layer / bw_bytes_per_ms
    )
    if per_layer_ms <= 0:
        return 0
    hideable = math.floor(prefill_ms(prompt_tokens, params) / per_layer_ms + 1e-9)
    return max(0, min(layers, layers - hideable))


class LayerKVScheduler:
    """Admit prefills while every decoding request keeps its TPOT SLO (LayerKV Algorithm 1)."""

    name = "layerkv"

    def schedule(self, view: SchedulerView) -> SchedulerDecision:
        params = view.policy.layerkv
        # Eq. 2's right-hand side: the tightest decoding request bounds the prefill time.
        bound_ms = min((allow_prefill_ms(r, view, params) for r in view.running), default=math.inf)
        free = view.free_gpu_blocks
        spent_ms = 0.0
        tokens = 0
        admit: list[str] = []
        retained: dict[str, int] = {}
        for q in sorted(view.queued, key=lambda q: (q.arrival_ms, q.id)):
            t_prefill = prefill_ms(q.prompt_tokens, params)
            if not spent_ms + t_prefill < bound_ms:  # Eq. 2 (strict)
                break
            if admit and tokens + q.prompt_tokens > params.max_prefill_tokens:
                break
            x = min_gpu_layers(q.prompt_tokens, view, params)
            need = max(x, 1) * prompt_blocks(q.prompt_tokens, view.model.block_size)
            if need > free:
                break
            free -= need
            spent_ms += t_prefill
            tokens += q.prompt_tokens
            admit.append(q.id)
            retained[q.id] = x
        return SchedulerDecision(admit=tuple(admit), min_gpu_layers=retained)
