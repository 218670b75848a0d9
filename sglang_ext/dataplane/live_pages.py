"""LivePages: the view of a reconciliation that has to give something up, for :class:`SlotResidency`.

When the wants do not fit, a full reconciliation (and :class:`StagingRoom`'s lazy eviction) needs,
per layer-page, whether it is wanted, resident, paused or *orphan* (a prefix-cache page no
tracked request uses). Wanted, droppable or loadable layer-pages can only be on the pages whose
wants changed since the last reconciliation (the *dirty* pages of :class:`WantCounts`: the others
are settled), and removable paused layer-pages only on paused requests' pages; so everything is
computed on the ``[L, U]`` columns of those ``U`` pages, with the wants read from the counts --
proportional to the changes and the paused requests, never to the other live requests or the
pool (``[L, P]``). Orphan layer-pages are only *counted* (device pages in use, minus those lent
as staging, minus the live resident ones, which the counts keep: no scan); they are enumerated
only when space is needed, from the residency's list of pages that may have become orphans
(pages of released, dropped or re-observed requests), with a full scan of the map as a fallback
if that list disagrees with the count. The result is the same as the mask computation over the
whole pool, in the same order (row-major: layer, then page).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np

from sglang_ext.dataplane.slot_kv_store import SlotKVStore
from sglang_ext.dataplane.sorted_ids import distinct_sorted
from sglang_ext.dataplane.want_counts import WantCounts


def live_page_union(requests: Iterable) -> np.ndarray:  # noqa: ANN001 - residency's _Request
    """Sorted distinct pages of ``requests`` (int64)."""
    parts = [r.pages.numpy() for r in requests if r.pages.numel()]
    if not parts:
        return np.zeros(0, dtype=np.int64)
    return distinct_sorted(np.concatenate(parts))


def live_layer_pages(store: SlotKVStore, requests: Iterable) -> tuple[int, int]:
    """(live layer-pages, of which only on host) of ``requests``' distinct pages."""
    pages = live_page_union(requests)
    if not pages.size:
        return 0, 0
    return int(pages.size) * store.config.layers, int(np.count_nonzero(np.take(store.map_np, pages, axis=1) < 0))


class LivePages:
    """Wants, residency and removable layer-pages on the dirty and paused pages' columns."""

    def __init__(self, store: SlotKVStore, counts: WantCounts, paused: list, maybe_orphan: set[int],
                 staging: int = 0) -> None:
        """``paused``: the paused tracked requests; ``staging``: device pages lent out as staging
        (allocated, in no map entry)."""
        self.store = store
        self.counts = counts
        self.staging = staging
        self.requests = paused
        self.layers = store.config.layers
        self.maybe_orphan = maybe_orphan
        """The residency's pages that may be orphan (pruned here when enumerated)."""
        self.pages = distinct_sorted(np.concatenate([counts.dirty_live(), live_page_union(paused)]))
        """``U``: sorted distinct pages that are dirty (with a user) or used by a paused request."""
        self._cols = [np.searchsorted(self.pages, r.pages.numpy()) for r in paused]
        self.paused = counts.paused_users[self.pages] > 0
        """``[U]``: a paused request uses the page (its resident layers are lazy)."""
        self.resident = np.zeros((self.layers, 0), dtype=bool)
        self.orphan_resident = 0
        self.refresh()

    def refresh(self) -> None:
        """Re-read the map (after moves): ``resident [L, U]`` and the orphan layer-page count."""
        self.resident = np.take(self.store.map_np, self.pages, axis=1) >= 0
        self.orphan_resident = self.counts.orphan_resident(self.resident_total())

    def resident_total(self) -> int:
        """Layer-pages with a device copy: device pages in use that are not staging."""
        return self.store.allocator.used_count - self.staging

    def target(self) -> np.ndarray:
        """``[L, U]``: wanted on device (some live, not paused user wants the layer)."""
        return np.take(self.counts.want, self.pages, axis=1) > 0

    def flat(self, layers: np.ndarray, cols: np.ndarray) -> np.ndarray:
        """Flat ids ``l * P + p`` of ``[L, U]`` positions."""
        return layers.astype(np.int64) * self.store.config.logical_pages + self.pages[cols]

    # ----- orphans ------------------------------------------------------------------------

    def _orphans(self) -> tuple[np.ndarray, np.ndarray]:
        """(orphan pages with a device copy, ascending; ``[L, n]`` their residency)."""
        store = self.store
        cand = np.fromiter(self.maybe_orphan, dtype=np.int64, count=len(self.maybe_orphan))
        cand.sort()
        cand = cand[self.counts.users[cand] == 0]
        res = np.take(store.map_np, cand, axis=1) >= 0
        keep = res.any(axis=0)
        cand, res = cand[keep], res[:, keep]
        self.maybe_orphan.clear()
        self.maybe_orphan.update(cand.tolist())
        if int(res.sum()) != self.orphan_resident:  # the list missed some: scan the map
            used = self.counts.users > 0
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
        paused = sorted(range(len(self.requests)), key=lambda i: self.requests[i].pause_seq)
        taken = np.zeros_like(removable)
        for i in paused:
            cols = distinct_sorted(self._cols[i])
            for layer in range(self.layers - 1, -1, -1):
                sel = cols[removable[layer, cols] & ~taken[layer, cols]]
                if sel.size:
                    taken[layer, sel] = True
                    yield layer, self.pages[sel]
