"""WantCounts: :class:`SlotResidency`'s incremental bookkeeping of wants, in host NumPy arrays.

Per page, the tracked requests that use it (``users``, with multiplicity) and the paused ones
among them; per (layer, page), the live, not paused users that want the layer (``want``). A
layer-page is *wanted* iff ``want > 0``, *lazy* (removable, given up only when space is
needed) iff resident, not wanted and ``paused_users > 0``. Every want change updates the counts
of the changed request's pages only (O(its pages x L)) and marks those pages *dirty*; the
residency counts the live layer-pages with a device copy (``live_resident``) through every move
it makes, so the orphan count (``used - staging - live_resident``) and the live stats need no
pass over the live pages.

*Settled* invariant (what a full reconciliation leaves): on every live page that is not dirty,
a wanted layer-page is resident and an unwanted resident one is lazy. A reconciliation therefore
only looks at the dirty pages' columns; whatever breaks the invariant elsewhere (wants left short,
evictions for staging) marks its pages dirty.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from sglang_ext.dataplane.distinct_ids import DistinctIds
from sglang_ext.dataplane.slot_kv_store import SlotKVStore
from sglang_ext.dataplane.sorted_ids import distinct_counts, distinct_sorted
from sglang_ext.dataplane.tracked_request import TrackedRequest

SMALL = 8
"""Up to this many pages, :meth:`WantCounts.add` uses scalar operations."""


class WantCounts:
    """Per-page and per-layer-page want counts, the live resident count and the dirty pages."""

    def __init__(self, store: SlotKVStore) -> None:
        self.store = store
        layers, pages = store.config.layers, store.config.logical_pages
        self.layers = layers
        self._none = (False,) * layers
        self.want = np.zeros((layers, pages), dtype=np.int32)
        """``[L, P]``: live, not paused users wanting layer ``l`` of page ``p``."""
        self.users = np.zeros(pages, dtype=np.int32)
        """``[P]``: tracked requests using the page (paused ones included; with multiplicity)."""
        self.paused_users = np.zeros(pages, dtype=np.int32)
        """``[P]``: paused requests using the page."""
        self.live_count = 0
        """Pages with a user."""
        self.live_resident = 0
        """Layer-pages of pages with a user that have a device copy."""
        self._dirty_mask = np.zeros(pages, dtype=bool)
        self._ids = DistinctIds(pages)
        """The repeat check of :meth:`_distinct`; its scratch serves :meth:`members` too."""
        self._dirty: list[np.ndarray] = []
        self._dirty_small: list[int] = []
        self.check_appended = False
        """The fast path appended pages to a request that does not want every layer."""
        self._kept = False
        """The last fast path left unsettled pages dirty."""
        self.paused_requests = 0
        self.partial_requests = 0
        """Tracked requests that are paused / do not want every layer."""
        self.active_pages = 0
        self.offloading_pages = 0
        """Distinct pages of the not paused requests / of those among them that do not want every
        layer: the staging reserve's two sums (a page several staged requests share takes one
        staging page, :mod:`~sglang_ext.dataplane.staging_columns`)."""
        self._active_holders = np.zeros(pages, dtype=np.int32)
        self._offloading_holders = np.zeros(pages, dtype=np.int32)
        """``[P]``: the requests behind each page of the two sums (with multiplicity)."""

    # ----- requests -----------------------------------------------------------------------

    def track(self, req: TrackedRequest, sign: int) -> None:
        """``req`` as it is now joins (``sign=1``) or leaves (``-1``) the counts."""
        pages = req.pages.numpy()
        u = req.uncached
        if u:
            self.add(pages[:u], self._none, req.paused, sign)  # the uncached prefix: no layer wanted
            self.add(pages[u:], req.gpu_layers, req.paused, sign)
        else:
            self.add(pages, req.gpu_layers, req.paused, sign)
        self._requests_moved(1, pages, req.paused, not u and all(req.gpu_layers), sign)

    def track_many(self, reqs: Sequence[TrackedRequest], sign: int) -> None:
        """:meth:`track` of several requests, one pass per distinct (wants, pause state) for
        those without an uncached prefix (requests ending together mostly want the same)."""
        groups: dict[tuple[bool, tuple[bool, ...]], list[np.ndarray]] = {}
        for req in reqs:
            if req.uncached:
                self.track(req, sign)
            else:
                groups.setdefault((req.paused, tuple(req.gpu_layers)), []).append(req.pages.numpy())
        self._add_groups(groups, sign, whole=True)

    def _add_groups(self, groups: dict[tuple[bool, tuple[bool, ...]], list[np.ndarray]], sign: int, *,
                    whole: bool) -> None:
        """One :meth:`add` per (pause state, wants) of the requests' page arrays in ``groups``;
        ``whole``: the requests join or leave (else only these pages of requests that stay)."""
        for (paused, layers), group in groups.items():
            pages = group[0] if len(group) == 1 else np.concatenate(group)
            self.add(pages, layers, paused, sign)
            self._requests_moved(len(group) if whole else 0, pages, paused, all(layers), sign)

    def _requests_moved(self, requests: int, pages: np.ndarray, paused: bool, every: bool, sign: int) -> None:
        """The per-request sums of ``requests`` requests (0: pages of a request that stays)
        holding ``pages`` (repeats allowed), paused or not, wanting every layer or not."""
        self.paused_requests += sign * requests * paused
        self.partial_requests += sign * requests * (not every)
        if not paused:
            held = [self._active_holders] if every else [self._active_holders, self._offloading_holders]
            changes = self._held(held, pages, sign)
            self.active_pages += changes[0]
            if not every:
                self.offloading_pages += changes[1]

    def _held(self, held: list[np.ndarray], pages: np.ndarray, sign: int) -> list[int]:
        """``pages`` (repeats allowed) gain (``sign=1``) or lose (``-1``) a holder in each array of
        ``held``; how the number of held pages changed in each. O(len(pages)), the pages counted
        once for all the arrays."""
        if pages.size <= SMALL:  # a decode step's appended page: no NumPy call per array
            listed, changes = pages.tolist(), []
            for holders in held:
                change = 0
                for page in listed:
                    was = int(holders[page])
                    holders[page] = was + sign
                    change += (was + sign > 0) - (was > 0)
                changes.append(change)
            return changes
        if self._distinct(pages):
            uniq, step = pages, sign
        else:
            uniq, reps = distinct_counts(pages)
            step = sign * reps
        changes = []
        for holders in held:
            before = holders[uniq]
            after = before + step
            holders[uniq] = after
            changes.append(int(np.count_nonzero(after)) - int(np.count_nonzero(before)))
        return changes

    def track_added(self, req: TrackedRequest, added: np.ndarray) -> None:
        """Pages appended to ``req`` join the counts."""
        self.add(added, req.gpu_layers, req.paused, 1)  # appended pages are never in the prefix
        self._requests_moved(0, added, req.paused, not req.uncached and all(req.gpu_layers), 1)

    def track_replaced(self, req: TrackedRequest, new: np.ndarray) -> np.ndarray | None:
        """``req`` is about to hold ``new`` instead of its pages (SGLang rewrote its row, e.g. a
        prefill's duplicate prefix swapped for the tree's copy): only the pages that differ move
        the counts -- what leaving and rejoining does, for a few pages instead of all. Returns
        the pages it gave up; None (nothing done) when either side repeats a page or it has an
        uncached prefix (whose wants shift with position): then it leaves and rejoins."""
        old = req.pages.numpy()
        if req.uncached or not self._distinct(old) or not self._distinct(new):
            return None
        gone = old[~self.members(old, new)]
        added = new[~self.members(new, old)]
        if gone.size:
            self.track_removed(req, gone)
        if added.size:
            self.track_added(req, added)
        return gone

    def track_removed(self, req: TrackedRequest, removed: np.ndarray) -> None:
        """Pages cut from ``req`` (it keeps others; no uncached prefix) leave the counts: one
        pass over the cut pages instead of the request leaving and rejoining."""
        self.track_removed_many(((req, removed),))

    def track_removed_many(self, cuts: Sequence[tuple[TrackedRequest, np.ndarray]]) -> None:
        """:meth:`track_removed` of several requests (``(request, its cut pages)``; none with an
        uncached prefix), one pass per distinct (wants, pause state), as :meth:`track_many`."""
        groups: dict[tuple[bool, tuple[bool, ...]], list[np.ndarray]] = {}
        for req, removed in cuts:
            if req.uncached:
                raise ValueError("track_removed: a request with an uncached prefix leaves and rejoins")
            groups.setdefault((req.paused, tuple(req.gpu_layers)), []).append(removed)
        self._add_groups(groups, -1, whole=False)

    # ----- want changes -------------------------------------------------------------------

    def add(self, pages: np.ndarray, gpu_layers: Sequence[bool], paused: bool, sign: int) -> None:
        """A request's ``pages`` (int64, any order, repeats allowed) with these wants join
        (``sign=1``) or leave (``sign=-1``) the counts; the pages become dirty."""
        if not pages.size:
            return
        if pages.size <= SMALL:
            self._add_small(pages.tolist(), gpu_layers, paused, sign)
            return
        if self._distinct(pages):
            uniq, delta = pages, sign
        else:  # repeats (requests sharing prefix pages): counted per page, no slow ufunc.at
            uniq, reps = distinct_counts(pages)
            delta = sign * reps
        users = self.users[uniq]
        after = users + delta
        self.users[uniq] = after
        if sign > 0:  # joining: pages may only gain their first user
            self._live_changed(uniq[users == 0], 1)
        else:  # leaving: pages may only lose their last one
            self._live_changed(uniq[after == 0], -1)
        if paused:
            self.paused_users[uniq] += delta
        else:
            on = np.flatnonzero(np.asarray(gpu_layers, dtype=bool))
            if on.size == self.layers:  # a column gather, add, scatter: ~2x NumPy's in-place fancy add
                self.want[:, uniq] = np.take(self.want, uniq, axis=1) + delta
            elif on.size:
                self.want[on[:, None], uniq[None, :]] += delta
        self.mark_dirty(uniq)

    def _distinct(self, pages: np.ndarray) -> bool:
        """True when ``pages`` has no repeat: O(len), no sort (a request's pages are nearly always
        distinct; :class:`DistinctIds`)."""
        return self._ids.distinct(pages)

    def members(self, pages: np.ndarray, of: np.ndarray) -> np.ndarray:
        """``np.isin(pages, of)`` for page ids, O(len) with the page-sized scratch (no sort and no
        table sized to the ids' range)."""
        scratch = self._ids.scratch
        scratch[pages] = 0
        scratch[of] = 1
        return scratch[pages] == 1

    def _add_small(self, pages: list[int], gpu_layers: Sequence[bool], paused: bool, sign: int) -> None:
        """:meth:`add` of a few pages with scalar operations (a decode step's appended page:
        NumPy's per-call overhead would dominate)."""
        users, mask = self.users, self._dirty_mask
        # a partial request's wants: one add of its 0/1 layer column (a fancy-indexed add costs ~4x)
        on = None if paused or all(gpu_layers) else np.array(gpu_layers, dtype=np.int32) * sign
        for page in pages:
            was = int(users[page])
            users[page] = was + sign
            if (was > 0) != (was + sign > 0):
                resident = sum(1 for dev in self.store.map_np[:, page].tolist() if dev >= 0)
                self.live_count += sign
                self.live_resident += sign * resident
            if paused:
                self.paused_users[page] += sign
            elif on is None:
                self.want[:, page] += sign
            else:
                column = self.want[:, page]
                column += on
            if not mask[page]:
                mask[page] = True
                self._dirty_small.append(page)

    def add_fresh(self, pages: np.ndarray) -> None:
        """Distinct pages no request used, every layer wanted and resident (the decode fast
        path's new pages): joined without dirtying them (they are settled)."""
        self.users[pages] += 1
        self.want[:, pages] += 1
        self.active_pages += self._held([self._active_holders], pages, 1)[0]
        self.live_count += int(pages.size)
        self.live_resident += self.layers * int(pages.size)

    def join_fresh(self, pages: np.ndarray, want: np.ndarray | None) -> None:
        """A few distinct pages no request used join, each with one not paused user wanting the
        layers of its column of ``want`` (``[L, n]`` bool; None: every layer): counted in the
        staging reserve's sums, not dirtied (the caller places every wanted layer, so they are
        settled) and not resident yet (the caller adds what it places to ``live_resident``). What
        :meth:`add` and :meth:`_requests_moved` do for pages nobody held, with scalar writes
        (a decode step's opened pages); :meth:`add_fresh` for pages already resident everywhere."""
        users, active, offloading = self.users, self._active_holders, self._offloading_holders
        every = [True] * int(pages.size) if want is None else want.all(axis=0).tolist()
        self.live_count += int(pages.size)
        self.active_pages += int(pages.size)
        for i, page in enumerate(pages.tolist()):
            users[page] += 1
            active[page] += 1
            if every[i]:
                self.want[:, page] += 1
            else:
                assert want is not None
                self.want[:, page] += want[:, i]
                offloading[page] += 1
                self.offloading_pages += 1

    @property
    def all_settled(self) -> bool:
        """No page is dirty and no check is pending (:meth:`forget_settled`): every live page's
        wants are placed."""
        return not (self._dirty or self._dirty_small or self._kept or self.check_appended)

    def _live_changed(self, pages: np.ndarray, sign: int) -> None:
        if pages.size:
            self.live_count += sign * int(pages.size)
            self.live_resident += sign * int(np.count_nonzero(np.take(self.store.map_np, pages, axis=1) >= 0))

    # ----- moves --------------------------------------------------------------------------

    def moved(self, pages: np.ndarray, sign: int, layers: int = 1) -> None:
        """``layers`` layer-pages of each of ``pages`` got (``sign=1``) or lost (``-1``) their
        device copy (pages may repeat: one entry per layer-page)."""
        if pages.size:
            self.live_resident += sign * layers * int((self.users[pages] > 0).sum())

    # ----- dirty pages --------------------------------------------------------------------

    def mark_dirty(self, pages: np.ndarray) -> None:
        """These pages may be unsettled."""
        if pages.size:
            new = pages[~self._dirty_mask[pages]]
            if new.size:
                self._dirty_mask[new] = True
                self._dirty.append(new)

    def dirty_live(self) -> np.ndarray:
        """Sorted distinct dirty pages that have a user."""
        if not self._dirty and not self._dirty_small:
            return np.zeros(0, dtype=np.int64)
        pages = distinct_sorted(np.concatenate([*self._dirty, np.asarray(self._dirty_small, dtype=np.int64)]))
        return pages[self.users[pages] > 0]

    def clear_dirty(self) -> None:
        """Every page is settled."""
        self._kept = False
        for part in self._dirty:
            self._dirty_mask[part] = False
        self._dirty_mask[self._dirty_small] = False
        self._dirty, self._dirty_small = [], []

    def settle_plan(self, room: int) -> tuple[np.ndarray, np.ndarray] | None:
        """The full reconciliation on the dirty live pages' columns: sorted flat ids ``l * P + p``
        to drop (resident, unwanted, not lazy) and to load (wanted, host-only); None when the
        loads do not fit in ``room`` free pages plus the drops (space is short)."""
        cols = self.dirty_live()
        resident = np.take(self.store.map_np, cols, axis=1) >= 0
        target = np.take(self.want, cols, axis=1) > 0
        drop = resident & ~target & (self.paused_users[cols] == 0)[None, :]
        need = target & ~resident
        if int(need.sum()) - int(drop.sum()) > room:
            return None
        logical = self.store.config.logical_pages
        out = []
        for mask in (drop, need):
            layers, at = np.nonzero(mask)  # row-major over sorted pages: sorted flat ids
            out.append(layers.astype(np.int64) * logical + cols[at])
        return out[0], out[1]

    def forget_settled(self) -> None:
        """After the append-only fast path: if every dirty page is settled now (its new wants
        placed, nothing to drop), none stays dirty -- the next full reconciliation then looks
        at the next changes only, not at the pages appended since the last one.

        The dirty pages are then the pages appended since the last full reconciliation (any
        other change forces a full one), and the fast path placed every wanted layer of them:
        only a request that does not want every layer can leave one to drop (a prefix page
        resident at a layer nobody wants), so only then, or when an earlier check kept pages
        dirty, are they checked."""
        check, self.check_appended = self.check_appended or self._kept, False
        if not self._dirty and not self._dirty_small:
            return
        if check:
            plan = self.settle_plan(0)
            if plan is None or plan[0].size or plan[1].size:
                self._kept = True
                return
        self.clear_dirty()

    # ----- views --------------------------------------------------------------------------

    def orphan_resident(self, resident_total: int) -> int:
        """Resident layer-pages no live request uses, of ``resident_total`` resident ones."""
        return resident_total - self.live_resident

    def live_stats(self) -> tuple[int, int]:
        """(live layer-pages, of which only on host)."""
        live = self.live_count * self.layers
        return live, live - self.live_resident
