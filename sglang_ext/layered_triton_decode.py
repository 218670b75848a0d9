"""``LayeredTritonDecode``: replaces SGLang's ``triton`` attention backend under
``--enable-layered-kv``: decode through kvplane's Triton paged-decode kernel
(:func:`kernels.paged_decode.paged_decode`) over the step's per-layer page tables; extend
through the paged-extend kernel over the same tables (``LayeredPagedDecode``).

The kernel runs natively on CUDA and under the Triton interpreter (``TRITON_INTERPRET=1``) on
CPU, which is how CI serves real SGLang requests through the same kernel code a GPU runs
(``tests/sglang/test_triton_server.py``). On CPU without the interpreter the kernel's torch
reference (the same paged-table decode) runs instead. Soft cap and sliding window come from the
layer (``logit_cap``, ``sliding_window_size``).

With ``--kv-cuda-graphs on`` it also serves SGLang's decode graph runner
(:class:`~sglang_ext.layered_graph_decode.LayeredGraphDecode`'s hooks): a captured layer's decode
is this kernel over the graph buffers' tables (:meth:`LayeredTritonDecode.graph_attention`).
"""

from __future__ import annotations

from typing import Any

import structlog
import torch

from kernels.block_copy import triton_usable
from kernels.paged_decode import head_blocks, kv_splits, paged_decode, sm_count
from sglang_ext.dataplane.layer_cap_window import layer_cap_window
from sglang_ext.dataplane.results import LayerView
from sglang_ext.layered_graph_decode import LayeredGraphDecode

log = structlog.get_logger(__name__)


class LayeredTritonDecode(LayeredGraphDecode):
    """Triton paged decode over the layered tables."""

    def __init__(self, model_runner: Any) -> None:
        super().__init__(model_runner)
        self.decode_layers = 0
        """Layer decodes served through the paged kernel (per process)."""
        device = torch.device(self.device)
        self.sms = sm_count(device) if device.type == "cuda" else None
        """The GPU's SMs (the split count fills them), read once; None off CUDA (one split)."""
        self._splits: tuple[tuple[int, int, int], int] = ((-1, -1, -1), 1)
        """((batch, table width, q heads), split count) of the last eager decode step: every layer
        of a step launches with the same count, worked out at its first layer."""

    def step_splits(self, q: torch.Tensor, width: int, cache_shape: torch.Size) -> int:
        """The eager decode's split count for a step of query ``q`` over tables ``width`` pages
        wide and caches of ``cache_shape`` (:func:`kernels.paged_decode.kv_splits`, counting
        stage 1's head blocks), once per step shape."""
        key, splits = self._splits
        batch, q_heads = q.shape[0], q.shape[1]
        if key != (batch, width, q_heads):
            splits = 1  # off CUDA (where a head_dim over the kernels' is served by the torch reference)
            if self.sms is not None:
                _, page_size, kv_heads, head_dim = cache_shape
                blocks = head_blocks(q_heads // kv_heads, head_dim)
                splits = kv_splits(batch, kv_heads, self.sms, width, page_size, blocks)
            self._splits = ((batch, width, q_heads), splits)
        return splits

    def decode_layer(self, q: torch.Tensor, layer: Any, index: int) -> torch.Tensor:
        tables, store = self.pool.tables, self.pool.store
        if not self.decode_layers:
            log.info("layered_triton_decode_active",
                     impl="triton" if triton_usable(q, store.dev[0]) else "torch-reference")
        self.decode_layers += 1
        cap, window = layer_cap_window(layer)
        return paged_decode(
            q, store.dev[0], store.dev[1], tables.kv_indptr, tables.tab[index], tables.kv_lens,
            sm_scale=getattr(layer, "scaling", None), logits_soft_cap=cap, window_left=window,
            num_kv_splits=self.step_splits(q, tables.tab.shape[1], store.dev[0].shape),
        )

    def graph_attention(self, q: torch.Tensor, layer: Any, index: int, view: LayerView) -> torch.Tensor:
        store = self.pool.store
        cap, window = layer_cap_window(layer)
        # no split count: paged_decode's default, bounded by the buffers' full row width, is the
        # one a captured size serves every context length with; an eager step bounds it by its own
        # tables (step_splits), so on a GPU a replay and an eager step sum in different orders
        return paged_decode(q, store.dev[0], store.dev[1], view.kv_indptr, view.kv_indices, view.kv_lens,
                            sm_scale=getattr(layer, "scaling", None), logits_soft_cap=cap, window_left=window)
