"""``vllm-recompute``: eLLM's vLLM-Recompute baseline (eLLM §6.1, baseline 1).

"Discards all KV caches of preempted requests when GPU memory is full and recomputes them when
GPU memory becomes available" (vLLM's recompute preemption): the victim (the most recently
arrived running request) loses its KV and re-enters the queue at its head; on resume the engine
re-prefills its prompt *and* the tokens it has generated so far (LayerKV Eq. 3 over
``prompt + generated`` tokens, :meth:`SimProfile.prefill_ms`), and the prefill step produces its
next token. Batch size from eLLM Eq. (5) at ``r = 0`` (:class:`SloBatchPolicy`).
"""

from __future__ import annotations

from simulator.policies.slo_batch import SloBatchPolicy


class VllmRecomputePolicy(SloBatchPolicy):
    """vLLM with recompute preemption and the r = 0 TPOT batch cap."""

    name = "vllm-recompute"
    preemption = "recompute"
