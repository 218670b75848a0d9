"""StagingRoom: reserves a step's staging pages inside the device budget, making room if needed.

The boundary's reconciliation keeps ``SlotResidency.staging_reserve()`` pages free, so the
step's reservation normally succeeds at once. When it does not (the batch's offloading requests
changed since the boundary, or wants were short), room is made in this order, never losing KV
(dirty pages are written back before their device copy goes):

1. removable layer-pages: cached prefixes nobody uses, then paused requests (oldest pause
   first), highest layer first -- OrbitFlow §3.4's lazy eviction "when space is needed";
2. resident layers of live requests outside this batch, largest request first, highest layer
   first;
3. resident layers of the batch's own requests, in the same order (their staging grows by at
   most their pages, which the config guarantees fit: the budget holds one layer of the whole
   slot space).

Evicted wanted layers show up as shortfall at the next boundary, which retries placing them.

Evicting the batch's own layers (step 3, or a page a batch request shares) stages more of the
batch, so the build would ask more staging than the room was made for. In the paged layout
:meth:`StagingRoom.make_room_for` asks the build's demand again after each round
(:func:`~sglang_ext.dataplane.staging_columns.staging_demand`, O(the batch's pages) from the map
mirror) and makes room until it holds: the step's tables are built at most twice (the build that
found the room short and the one that reserves), where a rebuild per round took up to ``L + 2``.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import TypeVar

import numpy as np

from sglang_ext.dataplane.slot_residency import SlotResidency
from sglang_ext.dataplane.sorted_ids import ascending, distinct_sorted

T = TypeVar("T")


class StagingRoom:
    """Staging reservation over a :class:`SlotResidency`'s store."""

    def __init__(self, residency: SlotResidency) -> None:
        self.residency = residency
        self.store = residency.store
        self.wanted = 0
        """Pages the last :meth:`take` asked for."""
        self.evicted_layer_pages = 0
        """Layer-pages evicted to make staging room (removable ones included), in total."""

    def take(self, n: int) -> np.ndarray | None:
        """``n`` device pages for staging, or None (nothing taken) when fewer are free."""
        self.wanted = n
        ids = self.store.allocator.alloc(n)
        if ids is None:
            return None
        self.residency.staging_lent += n
        # ascending: a request's staged pages then take consecutive ids where the free pages are
        # consecutive, so its fetch is a few strided runs, not one copy per page (copy engines)
        return ascending(np.asarray(ids, dtype=np.int64))

    def building(self, make: Callable[[Callable[[int], np.ndarray | None]], T]) -> T:
        """``make(take)``: step tables built with staging from :meth:`take`; a raise in the build
        (the mirror's sync, the upload) gives back what it took -- else no one would, and the
        pages would stay in use with no map entry (fault fuzz, session 77)."""
        taken: list[np.ndarray] = []

        def take(n: int) -> np.ndarray | None:
            ids = self.take(n)
            if ids is not None:
                taken.append(ids)
            return ids

        try:
            return make(take)
        except BaseException:
            for ids in taken:
                self.give_back(ids)
            raise

    def renew(self, ids: np.ndarray, extra: int) -> tuple[int, np.ndarray | None]:
        """Reserve again the leading pages of ``ids`` -- the staging the last step gave back, in
        its order -- that nothing allocated since, and new pages for the others plus ``extra``
        (:meth:`BlockAllocator.renew`): ``(kept, pages)``, the kept ones first, the new ones
        ascending; ``(kept, None)``, nothing reserved, when too few are free."""
        kept, joined = self.store.allocator.renew(ids, extra)
        self.wanted = int(ids.size) - kept + extra
        if joined is not None:
            self.residency.staging_lent += int(joined.size)
        return kept, joined

    def give_back(self, ids: np.ndarray | None) -> None:
        """Return a step's staging pages (held for the next step's :meth:`renew`: allocations
        meanwhile are served from under them, :meth:`BlockAllocator.free`)."""
        if ids is not None and ids.size:
            self.store.allocator.free(ids, hold=True)
            self.residency.staging_lent -= int(ids.size)

    def make_room_for(self, batch: Collection[str], demand: Callable[[], int] | None = None) -> bool:
        """Room for the staging the last :meth:`take` could not reserve; False if even evicting
        everything cannot make it. ``demand``: what the batch's build would ask now. Evicting a
        resident layer of the batch's own requests (or of a page they share) stages more of the
        batch, so the demand is asked again after each round and room made until it holds: the
        caller then builds its tables once more, not once per round (at most ``L + 1`` rounds:
        each stages at least one more layer of the batch)."""
        want = self.wanted
        for _ in range(self.store.config.layers + 1):
            if not self.make_room(want, batch):
                return False
            if demand is None:
                return True
            want = demand()
            if want <= self.store.allocator.free_count:
                return True
        return True

    def make_room(self, n: int, batch: Collection[str]) -> bool:
        """Free device pages until ``n`` are free; False if even evicting everything cannot."""
        short = n - self.store.allocator.free_count
        if short <= 0:
            return True
        res = self.residency
        res.changed = True  # wants may end up short: the next boundary re-places them
        short -= self._give_up_removable(short)
        if short <= 0:
            return True
        requests = [(rid, r) for rid, r in res.requests.items() if r.pages.numel()]
        outside = [r for rid, r in requests if rid not in batch]
        inside = [r for rid, r in requests if rid in batch]
        for group in (outside, inside):
            for req in sorted(group, key=lambda r: -r.pages.numel()):
                pages = distinct_sorted(req.pages.numpy())
                for layer in range(self.store.config.layers - 1, -1, -1):
                    on = pages[self.store.map_np[layer, pages] >= 0]
                    if not on.size:
                        continue
                    self.store.offload(np.full(on.size, layer), on)
                    res.counts.moved(on, -1)
                    res.counts.mark_dirty(on)  # a wanted layer went: unsettled until re-placed
                    self.evicted_layer_pages += int(on.size)
                    short -= int(on.size)
                    if short <= 0:
                        return True
        return short <= 0

    def _give_up_removable(self, short: int) -> int:
        """Drop up to ``short`` removable layer-pages in give-up order; return how many."""
        live = self.residency.live_pages()  # on the live pages' columns, not the pool's
        removable = live.resident & ~live.target() & live.paused[None, :]
        given = 0
        if short <= 0 or (live.orphan_resident == 0 and not removable.any()):
            return 0
        for layer, pages in live.removable_order(removable):
            take = pages[: short - given]
            self.store.offload(np.full(take.size, layer), take)
            self.residency.counts.moved(take, -1)
            given += int(take.size)
            if given >= short:
                break
        self.evicted_layer_pages += given
        return given
