"""``vllm-swap``: eLLM's vLLM-Swap baseline (eLLM §6.1, baseline 2).

"Swaps the KV caches of preempted requests to host memory when GPU memory is exhausted and
restores them to GPU memory when space is available": the victim's whole KV (every layer of
every token) goes D2H, and comes back H2D in full before it decodes again, both serialised with
the step as vLLM 0.6 does (``overlap_swaps = False``); the engine charges
``blocks * layers / link rate`` each way. Batch size from eLLM Eq. (5) at ``r = 0``
(:class:`SloBatchPolicy`).
"""

from __future__ import annotations

from simulator.policies.slo_batch import SloBatchPolicy


class VllmSwapPolicy(SloBatchPolicy):
    """vLLM with swap preemption and the r = 0 TPOT batch cap."""

    name = "vllm-swap"
    preemption = "swap"
