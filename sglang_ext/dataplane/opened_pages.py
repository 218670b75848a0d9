"""OpenedPages: a paged decode step's opened pages observed and placed in one pass.

A steady paged decode step (:class:`~sglang_ext.dataplane.paged_decode_step.PagedDecodeStep`)
appends a page to the few requests whose new token opens one. The general route is
:meth:`SlotResidency.observe` per request, then :meth:`SlotResidency.reconcile`'s append-only
fast path (:meth:`WantCounts.track_added`, ``missing_pairs``, ``_load``,
:meth:`WantCounts.forget_settled`): ~165-175 us of Python and NumPy calls at Llama-3-8B's batch on
the 2-core host, for about two pages (this pass: ~120 us). Usually each opened page is fresh (no
user, no KV, no device copy at any layer) and nothing else is unsettled; then what that route does
comes down to a few writes, which :meth:`OpenedPages.reconcile` makes directly:

- each page gains its request as its only user, its wants (the request's layers), and a holder
  in the staging reserve's sums (``active``, and ``offloading`` for a request that does not want
  every layer): ``live_count`` grows by one per page;
- every wanted layer-page is placed (identity layout, every layer wanted: the identity pages, as
  ``place_fresh_identity``; else one :meth:`SlotKVStore.onload` of the (layer, page) pairs sorted
  by layer then page, nothing copied) and counted resident;
- nothing stays dirty (the route marks the pages dirty, then ``forget_settled`` clears them: a
  fresh page has no resident layer nobody wants).

Anything else -- an unknown, paused or uncached-prefix request, a request named twice, a list
that is not the last one plus one page, a page already used, placed or holding KV, a page out of
range, repeats, dirty pages, a check pending, or pairs that do not fit beside the staging reserve
-- returns None with nothing changed, and the caller takes the general route.
``tests/dataplane/test_opened_pages.py`` compares the whole state of both routes after random
histories.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from sglang_ext.dataplane.layer_page_moves import LayerPageMoves
from sglang_ext.dataplane.slot_results import ResidencyDelta

if TYPE_CHECKING:
    from sglang_ext.dataplane.slot_residency import SlotResidency

FEW = 8
"""Up to this many opened pages take the one pass (a decode step opens ~batch / page size)."""


class OpenedPages:
    """Observe-and-reconcile of a decode step's opened pages in one pass (module docstring)."""

    def __init__(self, residency: SlotResidency) -> None:
        self.residency = residency
        self.taken = 0
        """Steps that opened pages and placed them in one pass (the others took the general route)."""

    def reconcile(self, rids: Sequence[str], lists: Sequence[np.ndarray],
                  on_moves: Callable[[LayerPageMoves], None] | None = None) -> ResidencyDelta | None:
        """``observe(rids[i], lists[i])`` for each, then ``reconcile()``: the same state and delta
        when every condition of the module docstring holds (``on_moves`` then gets the pass's
        moves, as ``LayeredKVCore._reconcile`` reports them); else None, nothing changed but what
        the general route does first anyway (pending journal entries and ended requests applied,
        a request's decode tail joined to its pages). A placement that raises leaves the pages'
        wants counted and dirty and the next pass a full one -- what the general route's
        ``onload`` leaves; its identity placement sets no full pass, this one does -- reports
        and propagates."""
        res = self.residency
        res.settle()
        counts, store = res.counts, res.store
        if res.changed or res.appended or not counts.all_settled or len(rids) > FEW or len(set(rids)) != len(rids):
            return None
        reqs, pages = [], []
        for rid, now in zip(rids, lists, strict=True):
            req = res.requests.get(rid)
            if req is None or req.paused or req.uncached:
                return None
            old = req.pages.numpy()  # the list is the last one plus a page (bytes: one call, not three)
            if now.size != old.size + 1 or now.dtype != old.dtype or now[:-1].tobytes() != old.tobytes():
                return None
            reqs.append(req)
            pages.append(int(now[-1]))
        k, layers = len(pages), res.layers
        if len(set(pages)) != k or (k and not 0 <= min(pages) <= max(pages) < store.config.logical_pages):
            return None  # repeats (-1 and P - 1 are one NumPy index: ids out of range decline too)
        order = sorted(range(k), key=pages.__getitem__)  # missing_pairs' order: layer, then page
        p = np.array([pages[j] for j in order], dtype=np.int64)
        users, has_kv = counts.users, res.has_kv_np  # scalar reads: a few pages
        if any(users.item(page) or has_kv.item(page) for page in pages) or (
                k and np.take(store.map_np, p, axis=1).max() >= 0):
            return None
        every = [all(req.gpu_layers) for req in reqs]
        identity = store.identity and all(every)
        want = None
        if identity:
            need = layers * k
            room = store.allocator.free_count
        else:
            want = np.array([reqs[j].gpu_layers for j in order], dtype=bool).T.reshape(layers, k)
            need = int(np.count_nonzero(want))
            room = store.allocator.free_count - (0 if store.identity else counts.offloading_pages + every.count(False))
        if need > room:
            return None
        tensors = [torch.from_numpy(now) for now in lists]  # one that raises does before any change
        counts.join_fresh(p, want)
        for req, tensor in zip(reqs, tensors, strict=True):
            req.pages = tensor
        res.last_moves = LayerPageMoves({}, {})
        self.taken += k > 0
        try:
            self._place(p, want, need, identity)
        finally:  # a placement that raised moved nothing: reported all the same, as the core's pass
            if on_moves is not None:
                on_moves(res.last_moves)
        counts.live_resident += need
        return ResidencyDelta(0, 0, 0, need, 0, 0, 0, 0)

    def _place(self, p: np.ndarray, want: np.ndarray | None, need: int, identity: bool) -> None:
        """Every wanted layer of the fresh sorted pages ``p`` placed (``want``: ``[L, k]`` of
        ``p``; None in the identity layout, every layer wanted)."""
        res = self.residency
        store = res.store
        try:
            if identity:  # no mirror to log for: the order is the allocator's no matter
                store.place_identity(p, store.identity_ids(p))
            elif need:
                assert want is not None
                pair_layers, at = np.nonzero(want)
                store.onload(pair_layers.astype(np.int64), p[at], np.zeros(need, dtype=bool))
        except BaseException:  # as SlotResidency._load: the wants stay due, the next pass is full
            res.counts.mark_dirty(p)
            res.changed = True
            raise
