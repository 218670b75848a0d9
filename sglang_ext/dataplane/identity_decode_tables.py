"""IdentityDecodeTables: a steady decode step's page tables in the identity layout, every live
layer-page resident -- what the paged-read decode backends (FlashInfer, Triton: the CUDA defaults)
read when nothing is offloaded.

In the identity layout layer ``l``'s copy of logical page ``p`` is device page ``l * P + p``
(:meth:`SlotKVStore.identity_ids`), so with every layer-page resident the ``[L, n]`` page table is
one row of the batch's pages (request by request, position order) plus a per-layer base. The host
builds that row and the CSR (``indptr``, ``kv_lens``, ``last_page_len``) from the page lists --
one concatenate of ``B`` arrays, no per-layer or per-page Python -- and sends them in ONE upload
(:meth:`StepTables._upload`); the device adds the bases (one op). Nothing is staged, fetched or
written back; the step's bookkeeping (new pages placed, dirty, joined) is the
:class:`~sglang_ext.dataplane.decode_journal.DecodeJournal`'s, and the layers write in place by
slot id. A general step builds :class:`StepTables` instead (the same tables: ``tests/dataplane/
test_identity_decode.py`` compares them).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from sglang_ext.dataplane.step_tables import StepTables

if TYPE_CHECKING:
    from sglang_ext.dataplane.slot_kv_store import SlotKVStore


class IdentityDecodeTables(StepTables):
    """A resident identity-layout decode step's tables (module docstring). Read like
    :class:`StepTables` (``tab``, the CSR and its host copies); no launches, rows or token tables."""

    def __init__(self, store: SlotKVStore, pages: Sequence[np.ndarray], seq_lens: np.ndarray,
                 layer_base: torch.Tensor) -> None:
        """``pages``: each request's pages in position order (its last page holds its newest
        token); ``seq_lens``: its tokens; ``layer_base``: ``[L, 1]`` int32 ``l * P`` on the device."""
        layers, ps = store.config.layers, store.config.page_size
        self.identity = True
        self.staging_ids = np.zeros(0, dtype=np.int64)
        counts = np.fromiter((p.size for p in pages), dtype=np.int64, count=len(pages))
        self.batch = b = int(counts.size)
        flat = np.concatenate(pages) if b else np.zeros(0, dtype=np.int64)
        self.pages, self._n, self._m = flat, int(flat.size), b
        self.host_layer_pages = 0
        self.dirty_ids = self.new_pages = np.zeros(0, dtype=np.int64)  # the journal marks them
        self.recompute = None
        self.fetches = []
        self.writebacks = [None] * layers
        self.fetch_layer_pages = self.writeback_layer_pages = 0
        self._tok_at, self._width = -1, int(seq_lens.max()) if b else 0
        self.rows = None  # type: ignore[assignment]  # identity writes go in place by slot id
        self._upload(store, [], [flat], counts, seq_lens, ps)
        n = self._n
        self.tab = layer_base + self.i32[None, :n]
        """``[L, n]`` int32 device pages per layer (``l * P + page``)."""
        self._bind_csr(n, b)
