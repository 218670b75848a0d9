"""LivePages: a boundary's view of the tracked requests' pages, for :class:`SlotResidency`.

A full reconciliation (and :class:`StagingRoom`'s lazy eviction) needs, per layer-page, whether
it is wanted, resident, paused or *orphan* (a prefix-cache page no tracked request uses). Only the
pages of tracked requests can be wanted, dropped or loaded, so everything is computed on the
``[L, U]`` columns of those ``U`` pages -- proportional to the live requests, never to the pool
(``[L, P]``). Orphan layer-pages are only *counted* at a boundary (device pages in use, minus
those lent as staging, minus the live resident ones: no pool scan); they are enumerated only
when space is needed, from the residency's list of pages that may have become orphans (pages of
released, dropped or re-observed requests), with a full scan of the map as a fallback if that
list disagrees with the count. The result is the same as the mask computation over the whole
pool, in the same order (row-major: layer, then page).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np

from sglang_ext.dataplane.slot_kv_store import SlotKVStore


def live_page_union(requests: Iterable) -> np.ndarray:  # noqa: ANN001 - residency's _Request
    """Sorted distinct pages of ``requests`` (int64)."""
    parts = [r.pages.numpy() for r in requests if r.pages.numel()]
    if not parts:
        return np.zeros(0, dtype=np.int64)
    return np.unique(np.concatenate(parts))


def live_layer_pages(store: SlotKVStore, requests: Iterable) -> tuple[int, int]:
    """(live layer-pages, of which only on host) of ``requests``' distinct pages."""
    pages = live_page_union(requests)
    if not pages.size:
        return 0, 0
    return int(pages.size) * store.config.layers, int((store.map_np[:, pages] < 0).sum())


class LivePages:
    """Wants, residency and removable layer-pages on the live pages' columns (module docstring)."""

    def __init__(self, store: SlotKVStore, requests: list, maybe_orphan: set[int], staging: int = 0) -> None:
        """``staging``: device pages lent out as staging (allocated, in no map entry)."""
        self.store = store
        self.staging = staging
        self.requests = requests
        self.layers = store.config.layers
        self.maybe_orphan = maybe_orphan
        """The residency's pages that may be orphan (pruned here when enumerated)."""
        self.pages = live_page_union(requests)
        """``U``: sorted distinct pages of the tracked requests."""
        self._cols = [np.searchsorted(self.pages, r.pages.numpy()) for r in requests]
        self.paused = np.zeros(self.pages.size, dtype=bool)
        """``[U]``: a paused request uses the page (its resident layers are lazy)."""
        for req, cols in zip(requests, self._cols, strict=True):
            if req.paused and cols.size:
                self.paused[cols] = True
        self.resident = np.zeros((self.layers, 0), dtype=bool)
        self.orphan_resident = 0
        self.refresh()

    def refresh(self) -> None:
        """Re-read the map (after moves): ``resident [L, U]`` and the orphan layer-page count."""
        self.resident = self.store.map_np[:, self.pages] >= 0
        self.orphan_resident = self.resident_total() - int(self.resident.sum())

    def resident_total(self) -> int:
        """Layer-pages with a device copy: device pages in use that are not staging."""
        return self.store.allocator.used_count - self.staging

    def target(self) -> np.ndarray:
        """``[L, U]``: wanted on device (some live, not paused user wants the layer)."""
        target = np.zeros((self.layers, self.pages.size), dtype=bool)
        for req, cols in zip(self.requests, self._cols, strict=True):
            if req.paused or not cols.size:
                continue
            layers = [i for i, on in enumerate(req.gpu_layers) if on]
            if layers:
                target[np.asarray(layers)[:, None], cols[None, :]] = True
        return target

    def flat(self, layers: np.ndarray, cols: np.ndarray) -> np.ndarray:
        """Flat ids ``l * P + p`` of ``[L, U]`` positions."""
        return layers.astype(np.int64) * self.store.config.logical_pages + self.pages[cols]

    # ----- orphans ------------------------------------------------------------------------

    def _orphans(self) -> tuple[np.ndarray, np.ndarray]:
        """(orphan pages with a device copy, ascending; ``[L, n]`` their residency)."""
        store = self.store
        cand = np.fromiter(self.maybe_orphan, dtype=np.int64, count=len(self.maybe_orphan))
        cand.sort()
        if self.pages.size and cand.size:
            pos = np.minimum(np.searchsorted(self.pages, cand), self.pages.size - 1)
            cand = cand[self.pages[pos] != cand]
        res = store.map_np[:, cand] >= 0
        keep = res.any(axis=0)
        cand, res = cand[keep], res[:, keep]
        self.maybe_orphan.clear()
        self.maybe_orphan.update(cand.tolist())
        if int(res.sum()) != self.orphan_resident:  # the list missed some: scan the map
            used = np.zeros(store.config.logical_pages, dtype=bool)
            used[self.pages] = True
            res_all = store.map_np >= 0
            cand = np.flatnonzero(res_all.any(axis=0) & ~used)
            res = res_all[:, cand]
            self.maybe_orphan.update(cand.tolist())
        return cand, res

    # ----- give-up order ------------------------------------------------------------------

    def removable_order(self, removable: np.ndarray) -> Iterator[tuple[int, np.ndarray]]:
        """Removable layer-pages in give-up order, as ``(layer, pages)``: cached pages nobody uses
        first, then paused requests' (``removable [L, U]``; oldest pause first); within each,
        highest layer first, pages ascending. Lazy: stops being computed when not iterated."""
        if self.orphan_resident > 0:
            cand, res = self._orphans()
            for layer in range(self.layers - 1, -1, -1):
                pages = cand[res[layer]]
                if pages.size:
                    yield layer, pages
        paused = sorted((i for i, r in enumerate(self.requests) if r.paused),
                        key=lambda i: self.requests[i].pause_seq)
        taken = np.zeros_like(removable)
        for i in paused:
            cols = np.unique(self._cols[i])
            for layer in range(self.layers - 1, -1, -1):
                sel = cols[removable[layer, cols] & ~taken[layer, cols]]
                if sel.size:
                    taken[layer, sel] = True
                    yield layer, self.pages[sel]
