"""SlotPageTables: per-layer paged views of a :class:`SlotKVStore` for paged attention kernels.

For kernels that read a paged pool (FlashInfer's ``[N, page_size, H, D]`` NHD layout) rather
than gathered tokens. Per step (``begin``): each request's pages in position order, the CSR
``kv_indptr``, ``kv_lens`` and ``last_page_len`` -- identical for every layer, so one FlashInfer
plan serves all layers -- and staging pages taken from the device allocator (as many as the
layer with the most host-only pages of the batch needs). Per layer (``layer_view``): the page ids
are the map's device pages where resident; host-only pages are copied into the staging pages
(one batched H2D per layer) and pointed at there. ``end`` returns the staging pages.

Must be called after the step's ``set_kv_buffer`` of that layer (new tokens of host-only pages
are written to host first, then staged). Staging reuse across layers is ordered by the stream.
"""

from __future__ import annotations

import torch

from sglang_ext.dataplane.results import LayerView
from sglang_ext.dataplane.slot_kv_store import SlotKVStore


class SlotPageTables:
    """Builds :class:`LayerView` s over the store's shared device pool, staging host-only pages."""

    def __init__(self, store: SlotKVStore) -> None:
        self.store = store
        self._pages = torch.zeros(0, dtype=torch.int64)
        self._staging: list[int] = []
        self._rids: tuple[str, ...] = ()
        self._indptr = self._kv_lens = self._last = None

    @property
    def staging_pages(self) -> int:
        """Device pages held for staging in the current step."""
        return len(self._staging)

    def begin(self, rids: list[str], per_request_slots: list[torch.Tensor]) -> bool:
        """Set up the step; False (nothing held) when the staging pages do not fit the device pool."""
        self.end()
        ps = self.store.config.page_size
        device = self.store.device
        pages, counts, lens = [], [], []
        for slots in per_request_slots:
            slots = slots.to("cpu", torch.int64)
            pages.append(slots[::ps] // ps)
            counts.append(int(pages[-1].numel()))
            lens.append(int(slots.numel()))
        self._pages = torch.cat(pages) if pages else torch.zeros(0, dtype=torch.int64)
        host_only = (self.store.map_cpu[:, self._pages] < 0).sum(dim=1)
        need = int(host_only.max()) if self._pages.numel() else 0
        staging = self.store.allocator.alloc(need)
        if staging is None:
            return False
        self._staging = staging
        self._rids = tuple(rids)
        indptr = torch.zeros(len(counts) + 1, dtype=torch.int32)
        indptr[1:] = torch.cumsum(torch.tensor(counts, dtype=torch.int32), 0)
        kv_lens = torch.tensor(lens, dtype=torch.int32)
        self._indptr = indptr.to(device)
        self._kv_lens = kv_lens.to(device)
        self._last = (kv_lens - (torch.tensor(counts, dtype=torch.int32) - 1) * ps).to(device)
        return True

    def layer_view(self, layer: int) -> LayerView:
        """Page table of ``layer`` for the batch, host-only pages staged onto the device."""
        store = self.store
        dev_pages = store.map_cpu[layer, self._pages].to(torch.int64)
        host_idx = (dev_pages < 0).nonzero().squeeze(1)
        if host_idx.numel():
            staging = torch.tensor(self._staging[: host_idx.numel()], dtype=torch.int64)
            data = store.host[self._pages[host_idx], layer]  # [m, 2, ps, H, D]
            store.dev[:, staging.to(store.device)] = data.to(store.device, non_blocking=True).movedim(1, 0)
            store.h2d_bytes += data.numel() * data.element_size()
            dev_pages[host_idx] = staging
        return LayerView(
            layer=layer,
            k_cache=store.dev[0],
            v_cache=store.dev[1],
            kv_indptr=self._indptr,
            kv_indices=dev_pages.to(torch.int32).to(store.device),
            kv_lens=self._kv_lens,
            last_page_len=self._last,
            rids=self._rids,
        )

    def end(self) -> None:
        """Return the staging pages (the step is over)."""
        if self._staging:
            self.store.allocator.free(self._staging)
        self._staging = []
