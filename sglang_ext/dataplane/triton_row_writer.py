"""TritonRowWriter: the layered core's one-launch KV write (:data:`~sglang_ext.dataplane.slot_kv_store.RowWriter`)
with kvplane's own Triton kernel (:func:`kernels.row_write.write_rows_triton`).

The SGLang adapter writes a layer's new K and V rows with SGLang's ``store_cache`` kernel where it
can build it (:class:`sglang_ext.store_cache_writer.StoreCacheWriter`: the launch vanilla SGLang
makes). Where it cannot -- its JIT refuses the row width, or SGLang is absent, as on ``kvplane
gpu-check``'s host -- the core would fall back to two ``index_copy_`` a layer: this writer keeps
it at one launch. Sources whose rows are not contiguous go through the two ``index_copy_``
(:attr:`fallbacks`).
"""

from __future__ import annotations

from typing import Any

import torch

from kernels.row_write import HAVE_TRITON, rows_contiguous, write_rows_ref, write_rows_triton


class TritonRowWriter:
    """A :data:`~sglang_ext.dataplane.slot_kv_store.RowWriter` over :func:`write_rows_triton`."""

    def __init__(self) -> None:
        if not HAVE_TRITON:
            raise RuntimeError("TritonRowWriter: triton is not importable")
        self.calls = 0
        """Layer writes made with the kernel."""
        self.fallbacks = 0
        """Layer writes made with two ``index_copy_`` (a source without contiguous rows)."""

    @classmethod
    def for_device(cls, device: Any) -> TritonRowWriter | None:
        """The writer for a pool on ``device``: CUDA with Triton, else None (two ``index_copy_``)."""
        return cls() if HAVE_TRITON and torch.device(device).type == "cuda" else None

    def __call__(self, k_dst: torch.Tensor, v_dst: torch.Tensor, rows: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor) -> None:
        """``k_dst[rows] = k``, ``v_dst[rows] = v`` in one launch."""
        if not (rows_contiguous(k) and rows_contiguous(v)) or k.dtype != k_dst.dtype or v.dtype != v_dst.dtype:
            write_rows_ref(k_dst, v_dst, rows, k, v)
            self.fallbacks += 1
            return
        write_rows_triton(k_dst, v_dst, rows, k, v)
        self.calls += 1
