"""StoreCacheWriter: a layer's new K and V rows in ONE launch, with SGLang's own KV store kernel.

Vanilla SGLang's MHA pool writes a layer's new KV with one fused kernel on CUDA
(``store_cache``, a JIT kernel that copies each new token's K row and V row to its slot:
``MHATokenToKVPool.set_kv_buffer`` -> ``_set_kv_buffer_impl``). The layered core's default is
two ``index_copy_`` launches (K, then V) per layer: at 32 layers a decode step makes 64 write
launches where vanilla makes 32, host time that counts against every step of an eager forward
(``kvplane gpu-check``'s "kvplane CPU time per step", whose write part was 0.8 ms of a 12 ms
all-resident step on an H200). On CUDA the adapter hands the core this writer
(:attr:`~sglang_ext.dataplane.slot_kv_store.SlotKVStore.row_writer`): the same kernel vanilla
uses, one launch a layer, into the core's device rows (the flat page pool, or an identity layer
in place).

One argument differs from SGLang's call: ``reserved_skip_index``. SGLang's kernel skips writes
to index 0 by default (its padding slot, a sink for CUDA-graph padding); in the layered pool
row 0 is real KV (device page 0 of the paged layout holds some layer-page; in the identity
layout, token 0 of a layer's page 0). The writer passes -1: nothing is skipped
(``tests/sglang/test_store_cache_writer.py``, with the default as the negative control).

Sources whose rows are not contiguous (the kernel views each as ``[n, H * D]``) go through the
two ``index_copy_`` instead (:attr:`StoreCacheWriter.fallbacks` counts them); SGLang's attention
passes contiguous rows. Off CUDA, or where SGLang cannot build the kernel for the row width,
:meth:`StoreCacheWriter.for_device` answers None and the core keeps its two launches.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import structlog
import torch

from kernels.row_write import rows_contiguous
from sglang_ext import compat

log = structlog.get_logger(__name__)

NO_SKIP = -1
"""``reserved_skip_index`` that skips no row (module docstring)."""


class StoreCacheWriter:
    """A :data:`~sglang_ext.dataplane.slot_kv_store.RowWriter` over SGLang's ``store_cache``."""

    def __init__(self, store_cache: Callable[..., Any], row_bytes: int) -> None:
        if row_bytes < 1:
            raise ValueError(f"StoreCacheWriter: row_bytes must be >= 1, got {row_bytes}")
        self._store = store_cache
        self.row_bytes = row_bytes
        """Bytes of one token's K (or V) row: ``H * D * element size``."""
        self.calls = 0
        """Layer writes made with the kernel."""
        self.fallbacks = 0
        """Layer writes made with two ``index_copy_`` (a source without contiguous rows)."""

    @classmethod
    def for_device(cls, device: torch.device, row_bytes: int) -> StoreCacheWriter | None:
        """The writer for a pool on ``device`` with rows of ``row_bytes``, or None (CPU, or
        SGLang cannot build its kernel for that width: the core then writes with two launches).
        On CUDA this builds the kernel now (SGLang's JIT), not at the first forward."""
        if device.type != "cuda":
            return None
        try:
            store_cache = compat.resolve(compat.KV_STORE_CACHE.path)
            usable = compat.resolve(compat.KV_CAN_USE_STORE_CACHE.path)(row_bytes, row_bytes)
        except Exception as exc:  # noqa: BLE001 - an optional speed-up: two launches still write
            log.warning("layered_kv_store_kernel_unavailable", error=f"{type(exc).__name__}: {exc}",
                        row_bytes=row_bytes, now="two index_copy_ launches per layer")
            return None
        if not usable:
            log.warning("layered_kv_store_kernel_unavailable", error="SGLang's store_cache refused the row width",
                        row_bytes=row_bytes, now="two index_copy_ launches per layer")
            return None
        log.info("layered_kv_store_kernel", row_bytes=row_bytes, launches_per_layer=1)
        return cls(store_cache, row_bytes)

    def __call__(self, k_dst: torch.Tensor, v_dst: torch.Tensor, rows: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor) -> None:
        """``k_dst[rows] = k``, ``v_dst[rows] = v`` in one launch."""
        if not (rows_contiguous(k) and rows_contiguous(v)):
            k_dst.index_copy_(0, rows, k)
            v_dst.index_copy_(0, rows, v)
            self.fallbacks += 1
            return
        width = k.shape[1] * k.shape[2]
        self._store(k.view(-1, width), v.view(-1, width), k_dst.view(-1, width), v_dst.view(-1, width), rows,
                    row_bytes=self.row_bytes, v_row_bytes=self.row_bytes, reserved_skip_index=NO_SKIP)
        self.calls += 1

