"""``LayeredTritonDecode``: replaces SGLang's ``triton`` attention backend under
``--enable-layered-kv``: decode through kvplane's Triton paged-decode kernel
(:func:`kernels.paged_decode.paged_decode`) over the step's per-layer page tables; extend
through the paged-extend kernel over the same tables (``LayeredPagedDecode``).

The kernel runs natively on CUDA and under the Triton interpreter (``TRITON_INTERPRET=1``) on
CPU, which is how CI serves real SGLang requests through the same kernel code a GPU runs
(``tests/sglang/test_triton_server.py``). On CPU without the interpreter the kernel's torch
reference (the same paged-table decode) runs instead. Soft cap and sliding window come from the
layer (``logit_cap``, ``sliding_window_size``).
"""

from __future__ import annotations

from typing import Any

import structlog
import torch

from kernels.block_copy import triton_usable
from kernels.paged_decode import paged_decode
from sglang_ext.dataplane.layer_cap_window import layer_cap_window
from sglang_ext.layered_paged_decode import LayeredPagedDecode

log = structlog.get_logger(__name__)


class LayeredTritonDecode(LayeredPagedDecode):
    """Triton paged decode over the layered tables."""

    def __init__(self, model_runner: Any) -> None:
        super().__init__(model_runner)
        self.decode_layers = 0
        """Layer decodes served through the paged kernel (per process)."""

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
        )
