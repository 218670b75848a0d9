"""FlashInfer paged decode over layered page tables (GPU only; import-guarded).

Every layer of a request has the same number of pages ``b_r`` (resident blocks or the staging
slot), so ``kv_indptr`` and ``last_page_len`` -- everything FlashInfer's ``plan`` schedules on --
are identical for all layers: **one plan per step serves every layer**, whatever the residency
pattern (the per-layer-group plans OrbitFlow's distance-driven layouts would need collapse to
one). Only the page ids differ per layer; they are copied into the wrapper's user-owned indices
buffer (the CUDA-graph buffer mode, where updating buffer contents between runs is the
supported pattern) before each layer's ``run``.
"""

from __future__ import annotations

import torch

from sglang_ext.dataplane.results import LayerView

try:
    import flashinfer

    HAVE_FLASHINFER = True
except Exception:  # noqa: BLE001 - flashinfer may fail to import without CUDA
    flashinfer = None
    HAVE_FLASHINFER = False

WORKSPACE_BYTES = 128 * 1024 * 1024
"""FlashInfer float workspace (its recommended size)."""


class FlashInferLayeredDecode:
    """Batch decode over a :class:`LayeredKVCache` step with one FlashInfer plan per step."""

    def __init__(self, device: torch.device | str, max_pages: int) -> None:
        if not HAVE_FLASHINFER:
            raise RuntimeError("flashinfer is not importable; use torch_layered_attention")
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise ValueError(f"FlashInferLayeredDecode needs a CUDA device, got {self.device}")
        self.max_pages = max_pages
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self._wrappers: dict[int, tuple[object, torch.Tensor]] = {}
        self._planned: tuple[object, torch.Tensor] | None = None

    def _wrapper(self, batch: int) -> tuple[object, torch.Tensor]:
        if batch not in self._wrappers:
            indices = torch.zeros(self.max_pages, dtype=torch.int32, device=self.device)
            w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace,
                "NHD",
                use_cuda_graph=True,
                use_tensor_cores=True,
                paged_kv_indptr_buffer=torch.zeros(batch + 1, dtype=torch.int32, device=self.device),
                paged_kv_indices_buffer=indices,
                paged_kv_last_page_len_buffer=torch.zeros(batch, dtype=torch.int32, device=self.device),
            )
            self._wrappers[batch] = (w, indices)
        return self._wrappers[batch]

    def plan(self, view: LayerView, num_qo_heads: int, sm_scale: float | None = None) -> None:
        """Plan once per step from any layer's view (all layers share indptr and lengths)."""
        _, page_size, num_kv_heads, head_dim = view.k_cache.shape
        batch = view.kv_lens.numel()
        if view.kv_indices.numel() > self.max_pages:
            raise ValueError(f"{view.kv_indices.numel()} pages exceed max_pages = {self.max_pages}")
        w, indices = self._wrapper(batch)
        w.plan(
            view.kv_indptr,
            view.kv_indices,
            view.last_page_len,
            num_qo_heads,
            num_kv_heads,
            head_dim,
            page_size,
            q_data_type=view.k_cache.dtype,
            kv_data_type=view.k_cache.dtype,
            sm_scale=sm_scale,
        )
        self._planned = (w, indices)

    def run(self, q: torch.Tensor, view: LayerView) -> torch.Tensor:
        """Decode attention of ``view.layer`` for q ``[B, Hq, D]``."""
        if self._planned is None:
            raise RuntimeError("FlashInferLayeredDecode.run before plan")
        w, indices = self._planned
        n = view.kv_indices.numel()
        indices[:n].copy_(view.kv_indices, non_blocking=True)
        return w.run(q, (view.k_cache, view.v_cache))
