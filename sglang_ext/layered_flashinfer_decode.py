"""``LayeredFlashInferDecode``: the layered GPU serving backend (replaces SGLang's ``flashinfer``
under ``--enable-layered-kv``): decode through FlashInfer over the step's per-layer page tables,
extend through kvplane's Triton paged-extend kernel over the same tables (``LayeredPagedDecode``).

One FlashInfer plan per step and per distinct layer parameters (soft cap, sliding window:
:class:`~sglang_ext.dataplane.flashinfer_attention.AttentionParams`), on FlashInfer's eager
(dynamic) wrappers, one per parameter set, as SGLang's own backend builds them (its ``fa2``
decode, its tensor-core choice); per layer the page ids are row ``l`` of the step's one
``[L, n]`` table. Staging is always reserved (the pool makes room),
so there is no fallback path. CUDA graphs are off under the flag (``launch_decision.py``).
"""

from __future__ import annotations

from typing import Any

import torch

from sglang_ext import compat
from sglang_ext.dataplane.flashinfer_attention import (
    HAVE_FLASHINFER,
    AttentionParams,
    FlashInferLayeredDecode,
)
from sglang_ext.dataplane.results import LayerView
from sglang_ext.layered_paged_decode import LayeredPagedDecode


class LayeredFlashInferDecode(LayeredPagedDecode):
    """FlashInfer paged decode over the layered tables (CUDA only)."""

    def __init__(self, model_runner: Any) -> None:
        super().__init__(model_runner)
        if not HAVE_FLASHINFER or self.pool.store.device.type != "cuda":
            raise RuntimeError("LayeredFlashInferDecode needs CUDA and an importable flashinfer")
        # FlashInfer's kernel for the model's heads as SGLang's own backend picks it
        self.flashinfer = FlashInferLayeredDecode(self.pool.store.device, self.pool.store.config.logical_pages,
                                                  tensor_cores=compat.should_use_tensor_core)
        self._params: dict[tuple[int, torch.dtype], AttentionParams] = {}
        """Each layer's attention parameters (fixed by the model), made once, not once a step."""

    def new_step(self) -> None:
        self.flashinfer.new_step()

    def decode_layer(self, q: torch.Tensor, layer: Any, index: int) -> torch.Tensor:
        tables, store = self.pool.tables, self.pool.store
        view = LayerView(
            layer=index, k_cache=store.dev[0], v_cache=store.dev[1], kv_indptr=tables.kv_indptr,
            kv_indices=tables.tab[index], kv_lens=tables.kv_lens, last_page_len=tables.last_page_len,
            rids=(),
        )
        key = (layer.layer_id, q.dtype)
        params = self._params.get(key)
        if params is None:  # soft cap, window
            params = self._params[key] = AttentionParams.of_layer(layer, layer.tp_q_head_num, q.dtype)
        if not self.flashinfer.planned(params):  # from the host CSR: no wait for the GPU here
            self.flashinfer.plan(tables.plan_view(view), layer.tp_q_head_num, params=params)
        return self.flashinfer.run(q, view, params)
