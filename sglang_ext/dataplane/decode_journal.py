"""DecodeJournal: the steady-decode steps' new pages, recorded at step time and applied to the
residency in one batch when anything reads it.

In the identity layout with every live layer-page resident (:meth:`SlotResidency.all_live_resident`),
a decode step's forward does not depend on the residency's bookkeeping at all: each new token is
written in place at its slot's fixed device rows and the attention reads in place. What the
bookkeeping records -- the new pages placed at every layer (device map, allocator), holding KV,
dirty on the device, joined to their request and to the want counts -- matters only to whoever
reads residency later: the step report, a plan install, a free, the next general step, a
move. So the step only checks that the fast path applies (a few flags and one dict lookup per
request) and appends its arrays here; :meth:`apply` does the bookkeeping of all the journalled
steps with one set of NumPy operations. Between two forwards a NumPy call costs 5-7 us on the
2-core host (cold caches), so the ~20 calls a step used to make were most of kvplane's per-step
cost with nothing offloaded (issue 13, ``benchmarks/results/sglang/``).

Every reader settles first (but the free-page figure of the step report, which counts the
journalled pages without applying them: :meth:`DecodeJournal.pending_layer_pages`):
:class:`SlotResidency`'s public methods and :class:`LayeredKVCore`'s
boundary and at-rest methods call :meth:`SlotResidency.settle`. The journal also applies itself
after :data:`MAX_STEPS` steps, so its size is bounded without readers.

Applying is exact whatever happened: the batch path needs distinct, fresh pages (no KV, on host at
every layer: what SGLang hands a decode step); otherwise each page is joined one at a time --
placed at its identity pages where it is not yet, counted as the general append path counts it --
and the next reconciliation is a full one. Pages are never copied from host here: their KV was
written in place by the forward, after any host copy could have been made.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from sglang_ext.dataplane.sorted_ids import distinct_sorted
from sglang_ext.dataplane.tracked_request import TrackedRequest

if TYPE_CHECKING:
    from sglang_ext.dataplane.slot_residency import SlotResidency

MAX_STEPS = 64
"""Journalled steps applied at the latest on the step after this many (bounded memory and work)."""


class DecodeJournal:
    """Steady-decode steps not yet applied to a :class:`SlotResidency` (module docstring)."""

    def __init__(self, residency: SlotResidency) -> None:
        self.residency = residency
        self.entries: list[tuple[list[TrackedRequest], list[int] | None, list[int], list[int] | None]] = []
        """Per step: the batch's requests, the batch rows that opened a page (None: every row, in
        order -- page size 1), those pages, and the pages the step wrote (None: exactly the new
        pages). Plain lists: the step makes no NumPy call (module docstring)."""
        self.steps = 0
        """Steps journalled in total."""
        self.pending_pages = 0
        """New pages in :attr:`entries` (with repeats)."""
        self._distinct: set[int] = set()
        """The distinct pages of :attr:`entries` (a repeat makes the batch path refuse)."""
        self.batches = 0
        """Applications that took the batch path (the rest joined page by page)."""
        self.slow = 0
        """Applications that joined page by page."""

    def record(self, rids: Sequence[str], owners: list[int] | None, pages: list[int],
               written: list[int] | None) -> bool:
        """A steady decode step, at step time: request ``rids[owners[i]]`` (``owners`` None:
        ``rids[i]``) opened page ``pages[i]``; the step wrote KV into ``written`` (None: ``pages``).
        Only checks that the fast path applies (:meth:`SlotResidency.journal_batch`). False,
        recording nothing, otherwise."""
        reqs = self.residency.journal_batch(rids)
        if reqs is None:
            return False
        if pages or written:
            self.entries.append((reqs, owners, pages, written))  # type: ignore[arg-type]  # none is None (checked)
            self.pending_pages += len(pages)
            self._distinct.update(pages)
            self.steps += 1
            if len(self.entries) >= MAX_STEPS:
                self.apply()
        return True

    def pending_layer_pages(self) -> int | None:
        """Device layer-pages that applying the journal will take, without applying it (O(1)):
        every layer of each new page, as the batch path places them, when the pages are distinct
        and that many are free. The batch path's other conditions (no page holding KV or already
        placed) hold for every page SGLang hands a decode step; a page breaking them is joined
        exactly by the page-by-page path, and a figure read from here may be off by its layers
        until the journal is applied. None when the pages repeat or do not fit: then only
        applying says."""
        if not self.entries:
            return 0
        res = self.residency
        n = self.pending_pages
        need = res.layers * n
        if need > res.store.allocator.free_count or len(self._distinct) != n:
            return None
        return need

    def apply(self) -> None:
        """Do the journalled steps' bookkeeping (the module docstring says what, and when)."""
        entries, self.entries = self.entries, []
        n, distinct = self.pending_pages, len(self._distinct) == self.pending_pages
        self.pending_pages = 0
        self._distinct.clear()
        if not entries:
            return
        res, store = self.residency, self.residency.store
        pages = np.fromiter(itertools.chain.from_iterable(e[2] for e in entries), dtype=np.int64, count=n)
        if not pages.size:
            ids = pages.reshape(store.config.layers, 0)
        else:  # repeats take the page-by-page path (the set of pages is already known)
            ids = res.place_fresh_identity(pages, distinct=True) if distinct else None
        if ids is None:
            self._apply_each(entries)
            return
        self.batches += 1
        res.has_kv_np[pages] = True
        first = entries[0][0]
        if all(e[1] is None and e[0] == first for e in entries):  # steady: the same batch, a page per row
            for req, column in zip(first, zip(*(e[2] for e in entries), strict=True), strict=True):
                req._tail.extend(column)
        else:
            for reqs, owners, new, _ in entries:
                for req, page in _joined(reqs, owners, new):
                    req._tail.append(page)
        res.counts.add_fresh(pages)  # fresh pages: newly live, wanted and resident everywhere
        self._mark_written(entries, ids)

    def _apply_each(self, entries: list) -> None:
        """The exact path for journals the batch path refuses (a page repeated, already holding
        KV or already placed): each page joins as the general append path would join it, after
        its unplaced layers are placed at their identity pages; the next reconciliation is full."""
        self.slow += 1
        res, store = self.residency, self.residency.store
        for reqs, owners, new, _ in entries:
            for req, page in _joined(reqs, owners, new):
                one = np.array([page], dtype=np.int64)
                ids = store.identity_ids(one).reshape(-1)
                free = ids[store.map_flat_np[ids] < 0]
                if free.size:
                    store.allocator.take_distinct(free)
                    store.map_flat_np[free] = free
                    store.map_changed(one)
                    res.counts.moved(np.full(free.size, page, dtype=np.int64), 1)
                res.counts.track_added(req, one)
                req._tail.append(page)
                res.has_kv_np[page] = True
        res.force_full_reconcile()
        self._mark_written(entries, None)

    def _mark_written(self, entries: list, ids: np.ndarray | None) -> None:
        """The journalled steps' written layer-pages are dirty on the device (every layer)."""
        store = self.residency.store
        if ids is not None and all(e[3] is None for e in entries):
            store.mark_dirty(ids.reshape(-1))  # page size 1: the new pages are what was written
            return
        written = [page for e in entries for page in (e[2] if e[3] is None else e[3])]
        store.mark_dirty_pages(distinct_sorted(np.array(written, dtype=np.int64)))


def _joined(reqs: list[TrackedRequest], owners: list[int] | None, pages: list[int]) -> zip:
    """``(request, page)`` of one journalled step: row ``owners[i]`` (None: row ``i``) opened ``pages[i]``."""
    return zip(reqs if owners is None else [reqs[i] for i in owners], pages, strict=True)
