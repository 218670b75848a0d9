"""``hcache``: eLLM's HCache baseline (eLLM §6.1, baseline 3), modelled from eLLM's description.

eLLM §1: HCache "stores hidden states to enable fast restoration and recompute[s] KV caches for
all tokens of an evicted request" (request-level granularity); §6.1: it stores "hidden states of
specific layers", eLLM re-implemented its StatePartitionAlgorithm in vLLM, and restoration
overlaps the hidden-state recomputation with KV swapping between host and GPU, "balanc[ing] the
host-GPU transmission and the computation capability of GPU SMs". The HCache paper itself is
not in ``../shared/papers``; this model follows that description:

* **Preemption** as vLLM-Swap (:class:`SloBatchPolicy`, ``preemption = "swap"``): the newest
  running request leaves the GPU whole; what goes to host is, per token, the hidden state
  (``2 * hidden`` bytes, fp16) of the ``l_h`` layers restored from hidden states and the KV
  (``kv_bytes_per_token_layer``) of the other ``L - l_h`` layers, written D2H serialised with the
  step as vLLM-Swap's KV is (HCache writes its states during the forward; charging them at
  preemption is the conservative reading, and keeps the comparison with vLLM-Swap about bytes
  and restore compute only).
* **Restoration** of ``s`` tokens: the hidden-state layers are moved H2D and their K/V are
  recomputed from them (``K = X W^K``, ``V = X W^V``, eLLM §2.1), which costs
  ``2 * 2 * hidden * h_kv = hidden * kv_bytes_per_token_layer`` FLOPs per token and layer (fp16,
  ``h_kv = kv_bytes / 4``) on the prefill FLOP rate (``prefill_alpha / prefill_tflops``, as
  LayerKV Eq. 3 in :mod:`simulator.profile`), a fraction of a full recompute (16% of the GEMM
  FLOPs of Llama-2-13B, and without the attention term); the KV layers are moved H2D as in a
  swap. Transfer and compute overlap layer by layer, so restoration takes
  ``max(transfer, compute)``; the state partition picks ``l_h`` in ``0..L`` minimising it.
* With GQA, where a hidden state is larger than a layer's KV (Llama-3-8B: 8192 vs 4096 B),
  ``l_h = 0`` and HCache is vLLM-Swap (OrbitFlow §7 makes the same remark on MHA-only gains).

Not modelled: HCache's chunked host storage and multi-turn prefix reuse (no trace here reuses a
context), and the restore running in parallel with other requests' decoding (restoration is
serialised with the step as vLLM-Swap's swap-in is, so both pay the same way).
"""

from __future__ import annotations

from simulator.policies.slo_batch import SloBatchPolicy
from simulator.profile import SimProfile
from simulator.state import SimRequest

DTYPE_BYTES = 2
"""fp16 hidden states (every preset is fp16)."""


def restore_partition(p: SimProfile, tokens: int) -> tuple[int, float, float, float]:
    """HCache's state partition for ``tokens`` tokens: ``(l_h, restore_ms, h2d_ms, compute_ms)``
    with ``l_h`` the layers restored from hidden states (the rest swapped as KV), chosen to
    minimise ``max(h2d_ms, compute_ms)`` (fewest hidden layers on a tie)."""
    hidden_b = DTYPE_BYTES * p.hidden
    kv_b = p.kv_bytes_per_token_layer
    flop_ms = p.prefill_alpha / (p.prefill_tflops * 1e12) * 1e3
    proj_ms = tokens * p.hidden * kv_b * flop_ms  # K/V projection of one layer
    options = []
    for lh in range(p.layers + 1):
        h2d = tokens * (lh * hidden_b + (p.layers - lh) * kv_b) / (p.h2d_gbps * 1e6)
        comp = lh * proj_ms
        options.append((lh, max(h2d, comp), h2d, comp))
    return min(options, key=lambda o: (o[1], o[0]))


class HCachePolicy(SloBatchPolicy):
    """vLLM-Swap's scheduler with HCache's hidden-state restoration."""

    name = "hcache"
    preemption = "swap"

    def saved_bytes(self, tokens: int) -> int:
        """Bytes written to host for a preempted request of ``tokens`` tokens."""
        p = self.p
        lh = restore_partition(p, tokens)[0]
        return tokens * (lh * DTYPE_BYTES * p.hidden + (p.layers - lh) * p.kv_bytes_per_token_layer)

    def swap_out_ms(self, r: SimRequest) -> float:
        """D2H of the hidden states and KV of the partition (engine hook)."""
        return self.saved_bytes(r.context) / (self.p.d2h_gbps * 1e6)

    def swap_in_ms(self, r: SimRequest) -> float:
        """Restoration: hidden-state transfer + K/V projection overlapped with the KV layers'
        transfer (engine hook)."""
        return restore_partition(self.p, r.context)[1]
