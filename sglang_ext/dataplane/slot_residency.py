"""SlotResidency: which (layer, page) of SGLang's slot space lives on the device, per step.

Primitives (step boundaries only, on the scheduler thread): ``update_residency(wants)``, the
plan's wanted residency per request; ``observe(rid, pages)``, a request's pages as the step sees
them (``req_to_token``; without a plan all layers are wanted); ``release_request(rid)``, finished
or aborted: its wants go, tree-owned pages stay; ``reconcile()``, move data so the device holds
what is wanted, within the budget; ``mark_written(pages)``, pages receiving KV in the coming
forward; ``page_freed(pages)``, SGLang's allocator took them back.

Rules (docs/sglang-integration.md, layered pool contract):

- A layer-page is *wanted* iff some live, not paused request that uses the page wants that
  layer on the device (shared prefix pages: resident iff ANY live user wants them).
- Unwanted resident layer-pages are dropped at the boundary, except those of paused requests and
  those no live request uses any more (prefix-cache pages of finished requests): they are
  *removable*, given up lazily, only when space is needed -- cached pages first, then paused
  requests oldest pause first; highest layer first (OrbitFlow "removable cache"). Keeping cached
  prefixes while there is room is what SGLang does, and saves a prefix hit reloading them.
- When the wanted set does not fit: first removable pages go; then, for requests without a plan,
  the local heuristic switches the highest layer of the largest request to host until it fits
  (LayerKV §3: offload whole layers of the largest contexts first); what still does not fit stays
  on host, reported as shortfall. Never lost KV; a failed copy launch moves nothing (retried).
- Data never moves during a step: the device pool holds at most ``device_pages`` layer-pages.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from sglang_ext.dataplane.appended_pairs import missing_pairs
from sglang_ext.dataplane.decode_journal import DecodeJournal
from sglang_ext.dataplane.ended_requests import EndedRequests
from sglang_ext.dataplane.layer_page_moves import LayerPageMoves
from sglang_ext.dataplane.layer_page_moves import by_layer as _by_layer
from sglang_ext.dataplane.live_pages import LivePages
from sglang_ext.dataplane.slot_kv_store import SlotKVStore
from sglang_ext.dataplane.slot_results import RequestResidency, ResidencyDelta, ResidencyStats
from sglang_ext.dataplane.sorted_ids import has_repeats
from sglang_ext.dataplane.tracked_request import TrackedRequest as _Request
from sglang_ext.dataplane.want_counts import WantCounts


class SlotResidency:
    """Residency policy mechanics over a :class:`SlotKVStore` (wants, removable, fallback)."""

    def __init__(self, store: SlotKVStore) -> None:
        self.store = store
        self.layers = store.config.layers
        self.requests: dict[str, _Request] = {}
        """The tracked requests by id (their pages and wants; read by :class:`OpenedPages`,
        :class:`EndedRequests` and :class:`StagingRoom`, which change them with this class)."""
        self._pause_seq = itertools.count(1)
        self.shortfall_total = 0
        self.last_moves = LayerPageMoves({}, {})
        self.has_kv = store.has_kv  # pages holding KV (the store's flags): only these are onloaded
        self.has_kv_np = store.has_kv_np  # same memory, for the per-step fast path
        self._anonymous: set[str] = set()  # requests observed without an id (dropped at the next boundary)
        self.changed = True
        """Anything but appended pages changed since the last full reconcile (forces a full one)."""
        self.appended: list[tuple[_Request, np.ndarray]] = []
        """Pages appended to known requests (or a new request's) since the last pass (int64)."""
        self.maybe_orphan: set[int] = set()
        """Pages that may no longer have a tracked user (released, dropped, re-observed requests'
        pages): where :class:`LivePages` looks for cached orphans when space is needed."""
        self.full_reconciles = 0
        """Full reconciliations run; the rest took the append-only fast path."""
        self.staging_lent = 0
        """Device pages :class:`StagingRoom` has lent out and not got back: in the allocator's
        count, in no map entry (:class:`LivePages` counts resident layer-pages with it)."""
        self.counts = WantCounts(store)
        """Want counts per (layer, page), users per page, live resident count, dirty pages: a
        change costs O(the changed request's pages x L); a full reconciliation looks at the
        dirty pages only (:class:`WantCounts`)."""
        self.journal = DecodeJournal(self)
        """Decode steps recorded, not yet applied: settled by every public method reading the state."""
        self.ended = EndedRequests(self)
        """Releases and frees recorded, not yet applied (after the journal, in :meth:`settle`)."""

    def settle(self) -> None:
        """Apply the journalled decode steps (:class:`DecodeJournal`), then the recorded releases
        and frees (:class:`EndedRequests`); cheap when there are none."""
        if self.journal.entries:
            self.journal.apply()
        if self.ended.pending:
            self.ended.apply()

    def journal_batch(self, rids: Sequence[str]) -> list[_Request] | None:
        """The records of ``rids`` when a steady decode step of theirs may be journalled (identity
        layout, every live layer-page resident, nothing observed but not reconciled, no end
        pending, every request tracked, named and in the batch once), else None. No settling:
        the journal's step-time check (C-level set and map calls, no Python loop per request)."""
        requests, named = self.requests, set(rids)
        if (not self.store.identity or self.appended or self.ended.pending or not self.all_live_resident()
                or len(named) != len(rids) or not requests.keys() >= named):
            return None
        reqs = list(map(requests.__getitem__, rids))
        if self._anonymous and any(req.anonymous for req in reqs):
            return None
        return reqs

    def force_full_reconcile(self) -> None:
        """The next reconciliation is a full one (something changed beyond appends)."""
        self.changed = True

    # ----- request state ----------------------------------------------------------

    def update_residency(self, wants: Mapping[str, RequestResidency]) -> None:
        """Record the plan's wants (rids not in ``wants`` keep their previous state).

        Only a real change (new request, other layers, pause state, pages not just appended)
        forces the next reconciliation to be a full one; a steady plan stays on the fast path.
        """
        self.settle()
        logical = self.store.config.logical_pages
        for rid, want in wants.items():  # every want checked before any is applied
            if len(want.gpu_layers) != self.layers:
                raise ValueError(f"wants[{rid!r}].gpu_layers has {len(want.gpu_layers)} entries; the pool has "
                                 f"{self.layers} layers")
            if want.pages and max(want.pages) >= logical:
                bad = [p for p in want.pages if p >= logical]
                raise ValueError(f"wants[{rid!r}].pages {bad[:4]} out of range [0, {logical})")
        arrived: list[_Request] = []
        for rid, want in wants.items():
            req = self.requests.get(rid)
            pages = torch.from_numpy(np.fromiter(want.pages, dtype=np.int64, count=len(want.pages)))
            if req is None:
                layers = want.gpu_layers if want.planned else (True,) * self.layers
                req = self.requests[rid] = _Request(pages, gpu_layers=list(layers), planned=want.planned,
                                                     uncached=want.uncached_pages)
                if want.uncached_pages:
                    self.changed = True  # its prefix may be resident already (observed earlier)
                if want.paused:
                    req.pause_seq = next(self._pause_seq)
                    req.paused = True
                    self.changed = True
                elif not self.changed and pages.numel():
                    self.appended.append((req, pages.numpy()))  # a new request only adds wants
                arrived.append(req)
                continue
            elif len(want.pages) >= req.pages.numel():
                self.observe(rid, pages)
            new_layers = want.planned and list(want.gpu_layers) != req.gpu_layers
            new_prefix = want.uncached_pages != req.uncached
            if new_layers or new_prefix or want.paused != req.paused:
                self.counts.track(req, -1)
                if new_layers:
                    req.gpu_layers = list(want.gpu_layers)
                    self.changed = True
                if new_prefix:
                    req.uncached = want.uncached_pages
                    self.changed = True
                if want.paused != req.paused:
                    if want.paused:
                        req.pause_seq = next(self._pause_seq)
                    req.paused = want.paused
                    self.changed = True
                self.counts.track(req, 1)
            if want.planned != req.planned:
                req.planned = want.planned
                self.changed = True
        self.counts.track_many(arrived, 1)  # the new requests join in one pass per distinct want

    def observe(self, rid: str, pages: torch.Tensor, *, anonymous: bool = False) -> None:
        """The request's pages in position order as of this step (new requests: local fallback).

        A running request's pages only grow at the end (SGLang appends to its ``req_to_token``
        row), which is what the append-only fast path of :meth:`reconcile` relies on; anything
        else forces a full pass.
        """
        self.settle()
        req = self.requests.get(rid)
        if req is None:
            # a new request only adds wants (nothing becomes droppable): all its pages count as appended
            req = self.requests[rid] = _Request(pages, gpu_layers=[True] * self.layers, anonymous=anonymous)
            if anonymous:
                self._anonymous.add(rid)
            if not self.changed and pages.numel():
                self.appended.append((req, pages.numpy()))
            self.counts.track(req, 1)
            return
        old, now = req.pages.numpy(), pages.numpy()  # NumPy views: a decode step's compare, ~3x cheaper
        if old.size <= now.size and (now[:old.size] == old).all():
            if now.size > old.size:
                added = now[old.size:]
                if not self.changed:
                    self.appended.append((req, added))
                self.counts.track_added(req, added)
            req.pages = pages
        else:
            self.changed = True
            gone = self.counts.track_replaced(req, pages.numpy())
            if gone is None:  # repeats or an uncached prefix: leave and rejoin
                self.maybe_orphan.update(req.pages.tolist())
                self.counts.track(req, -1)
                req.pages = pages
                self.counts.track(req, 1)
            else:
                self.maybe_orphan.update(gone.tolist())
                req.pages = pages

    def holds_wants(self, rid: str) -> bool:
        """Whether wants of ``rid`` given by :meth:`update_residency` are held (not released since;
        a request known only from :meth:`observe` holds none)."""
        req = self.requests.get(rid)
        return req is not None and req.planned and rid not in self.ended.released

    def release_request(self, rid: str) -> None:
        """Forget ``rid`` (unknown ids are ignored: release is idempotent). Recorded, applied by
        the next reader with the other releases and frees (:class:`EndedRequests`)."""
        self.ended.release(rid)

    @property
    def reclaimable_pages(self) -> int:
        """Device layer-pages only the prefix cache holds (free capacity), now: resident less live
        (neither counts journalled pages; a last full pass's figure went stale on fast paths)."""
        return self.counts.orphan_resident(self.store.allocator.used_count - self.staging_lent)

    @property
    def has_anonymous(self) -> bool:
        """Requests observed without an id are tracked (dropped at the next full boundary)."""
        return bool(self._anonymous)

    def drop_anonymous(self) -> None:
        """Forget requests observed without an id (dummy / warm-up batches)."""
        self.settle()
        if not self._anonymous:
            return
        for rid in self._anonymous:
            req = self.requests.pop(rid, None)
            if req is not None:
                self.changed = True
                self.maybe_orphan.update(req.pages.tolist())
                self.counts.track(req, -1)
        self._anonymous.clear()

    def gpu_layers(self, rid: str) -> tuple[bool, ...] | None:
        """Current wanted residency of ``rid`` (None if unknown)."""
        self.settle()
        req = self.requests.get(rid)
        return None if req is None else tuple(req.gpu_layers)

    def live_rids(self) -> list[str]:
        """Tracked request ids (running or paused)."""
        self.settle()
        return list(self.requests)

    def page_freed(self, pages: Sequence[int]) -> None:
        """The allocator took ``pages`` back: their device copies are dead. Recorded, applied by
        the next reader with the other releases and frees (:class:`EndedRequests`), where they
        are cut from any request still holding them."""
        self.ended.free(pages)

    def mark_written(self, pages: torch.Tensor) -> None:
        """``pages`` receive KV in the coming forward (later onloads must copy them)."""
        self.settle()
        if pages.numel():
            self.has_kv[pages] = True

    # ----- reconciliation -----------------------------------------------------------

    def live_pages(self) -> LivePages:
        """The view of the dirty and paused pages (wants, residency, removable) for giving up."""
        self.settle()
        paused = [r for r in self.requests.values() if r.paused] if self.counts.paused_requests else []
        return LivePages(self.store, self.counts, paused, self.maybe_orphan, self.staging_lent)

    def reconcile(self) -> ResidencyDelta:
        """Make the device hold the wanted layer-pages (within the budget); see module doc.

        Fast path: when the only change since the last full pass is pages appended to known requests
        (decode) and they fit with the staging reserve, they are placed directly (paused requests'
        layers are given up only by the full pass, when they do not). The full one looks at the
        pages whose wants changed since the last one (:class:`WantCounts`: the others are settled)
        and, when space is short, at paused requests' pages too (:class:`LivePages`); never at the
        other live pages or the pool."""
        self.settle()
        self.last_moves = LayerPageMoves({}, {})  # this pass's, even one that raises (its drops)
        fast = self._reconcile_appended()
        if fast is not None:
            self.counts.forget_settled()
            return fast
        self.full_reconciles += 1
        self.appended = []
        store = self.store
        d2h_before, h2d_before = store.d2h_bytes, store.h2d_bytes
        reserve = self.staging_reserve()
        plan = self.counts.settle_plan(store.allocator.free_count - reserve)
        given_up = local_flips = 0
        if plan is None:  # space is short: the pass over every live page decides
            drop_flat, need_flat, reserve, given_up, local_flips = self._short_plan()
        else:
            drop_flat, need_flat = plan
        offloaded = self._apply_drops(drop_flat)
        self.counts.clear_dirty()  # every live page settled, but for the wants left short
        loaded, placed, shortfall = self._apply_needs(need_flat, reserve)
        self.shortfall_total += shortfall
        self.changed = shortfall > 0 or given_up > 0
        self.last_moves = LayerPageMoves(offloaded=offloaded, loaded=loaded)
        return ResidencyDelta(
            loaded_layer_pages=sum(len(v) for v in loaded.values()),
            offloaded_layer_pages=int(drop_flat.size),
            removable_dropped_layer_pages=given_up,
            placed_new_layer_pages=placed,
            shortfall_layer_pages=shortfall,
            local_offloaded_layers=local_flips,
            h2d_bytes=store.h2d_bytes - h2d_before,
            d2h_bytes=store.d2h_bytes - d2h_before,
        )

    def _short_plan(self) -> tuple[np.ndarray, np.ndarray, int, int, int]:
        """The pass when the wants do not fit (on the dirty and paused pages): local fallback
        flips, removable layer-pages given up in order. Returns (sorted flat ids to drop, to load,
        the staging reserve, removable given up, local flips)."""
        store = self.store
        local_flips = 0
        while True:
            live = self.live_pages()  # a flip dirties the victim's pages: a new view
            resident, lazy = live.resident, live.paused[None, :]
            target = live.target()
            removable = resident & ~target
            drop = removable & ~lazy
            removable &= lazy
            need = target & ~resident
            removable_count = int(removable.sum()) + live.orphan_resident
            reserve = self.staging_reserve()
            short = int(need.sum()) + reserve - store.allocator.free_count - int(drop.sum())
            if short <= removable_count or not self._flip_local_layer():
                break
            local_flips += 1
        if short > removable_count:
            # wants stay short: every active request may need its staging slot this step
            reserve = self.staging_reserve(every_active=True)
            short = int(need.sum()) + reserve - store.allocator.free_count - int(drop.sum())
        drop_ids = [live.flat(*np.nonzero(drop))]
        given_up = 0
        if short > 0:
            for layer, pages in live.removable_order(removable):
                take = pages[: short - given_up]
                drop_ids.append(layer * store.config.logical_pages + take)
                given_up += int(take.size)
                if given_up >= short:
                    break
        drop_flat = np.sort(np.concatenate(drop_ids))  # row-major: layer, then page
        return drop_flat, live.flat(*np.nonzero(need)), reserve, given_up, local_flips

    def _reconcile_appended(self) -> ResidencyDelta | None:
        """Pages appended since the last pass get device pages at their wanted layers (NumPy: torch ops on tiny tensors cost ~0.5 ms a batch-32 step on the 2-core host)."""
        if self.changed:
            return None
        appended, self.appended = self.appended, []
        cols, masks, every_layer = [], [], []  # every_layer: the pages of requests wanting all layers
        for req, added in appended:
            if not added.size:
                continue
            a = added.astype(np.int64, copy=False)
            if all(req.gpu_layers):
                every_layer.append(a)
                continue
            layer_mask = np.asarray(req.gpu_layers, dtype=bool)
            if not self.counts.check_appended and (np.take(self.store.map_np, a, axis=1)[~layer_mask] >= 0).any():
                self.counts.check_appended = True  # a layer it does not want is resident: maybe one to drop
            if layer_mask.any():
                cols.append(a)
                masks.append(layer_mask)
        if every_layer:
            a = np.concatenate(every_layer) if len(every_layer) > 1 else every_layer[0]
            if not cols and self.store.identity:
                fast = self._place_new_identity(a)
                if fast is not None:
                    return fast
            cols.append(a)
            masks.append(None)
        if not cols:  # nothing to place, but an offloading request's grown staging slot must fit too
            if self.store.allocator.free_count < self.staging_reserve():
                self.changed = True  # the full pass makes the room (as it would have without this path)
                return None
            return ResidencyDelta(0, 0, 0, 0, 0, 0, 0, 0)
        layers, pages = missing_pairs(self.store.map_np, cols, masks)
        if layers.size > self.store.allocator.free_count - self.staging_reserve():
            self.changed = True
            return None
        h2d_before = self.store.h2d_bytes
        copy = self._load(layers, pages)
        n_copy = int(np.count_nonzero(copy))
        self.last_moves = LayerPageMoves(offloaded={}, loaded=_by_layer(layers[copy], pages[copy]) if n_copy else {})
        return ResidencyDelta(loaded_layer_pages=n_copy, offloaded_layer_pages=0, removable_dropped_layer_pages=0,
                              placed_new_layer_pages=int(copy.size) - n_copy, shortfall_layer_pages=0,
                              local_offloaded_layers=0, h2d_bytes=self.store.h2d_bytes - h2d_before, d2h_bytes=0)

    def _place_new_identity(self, pages: np.ndarray) -> ResidencyDelta | None:
        """Identity layout, every layer wanted (the usual decode step): new pages without KV, on host
        at every layer, go to their device pages ``l * P + p`` in one indexed write; anything else
        (prefix pages already placed, pages holding KV) returns None for the general append path."""
        if self.place_fresh_identity(pages) is None:
            return None
        return ResidencyDelta(0, 0, 0, self.layers * int(pages.size), 0, 0, 0, 0)

    def place_fresh_identity(self, pages: np.ndarray, *, distinct: bool = False) -> np.ndarray | None:
        """Place every layer of these distinct new pages (no KV yet, on host at every layer) at their
        identity device pages and return those ids (``[L, n]``); None, changing nothing, if any
        condition fails (``distinct``: the caller knows). The map is read flat at the ids."""
        store = self.store
        n = int(pages.size)
        if self.layers * n > store.allocator.free_count or (not distinct and has_repeats(pages)):
            return None
        ids = store.identity_ids(pages)
        if self.has_kv_np[pages].any() or store.map_flat_np[ids].max() >= 0:
            return None
        store.place_identity(pages, ids)
        self.counts.moved(pages, 1, self.layers)
        return ids

    def staging_reserve(self, *, every_active: bool = False) -> int:
        """Device pages kept free for this step's staging slots: one per distinct page of the
        active requests that offload something (``every_active``: of every active request) -- the
        placement model's ``sum_r b_r [r offloads]`` (``controlplane.model.memory_blocks``) when no
        page is shared (a shared page is staged once).
        Zero in the identity layout (a staged layer-page uses its own identity page)."""
        if self.store.identity:
            return 0
        return self.counts.active_pages if every_active else self.counts.offloading_pages

    def all_live_resident(self) -> bool:
        """Cheap sufficient test that every layer of every live request's pages is on the device:
        the last reconciliation left no shortfall, nobody is paused, everybody wants all layers."""
        return not self.changed and self.counts.paused_requests == 0 and self.counts.partial_requests == 0

    def _flip_local_layer(self) -> bool:
        """Local fallback: move the highest wanted layer of the largest unplanned request to host."""
        candidates = [
            r for r in self.requests.values() if not r.planned and not r.paused and any(r.gpu_layers)
        ]
        if not candidates:
            return False
        victim = max(candidates, key=lambda r: (r.pages.numel(), sum(r.gpu_layers)))
        top = max(i for i, on in enumerate(victim.gpu_layers) if on)
        self.counts.track(victim, -1)
        victim.gpu_layers[top] = False
        self.counts.track(victim, 1)
        return True

    def _apply_drops(self, flat: np.ndarray) -> dict[int, list[int]]:
        """Offload the layer-pages of sorted flat ids ``l * P + p``; per layer, the pages."""
        layers, pages = np.divmod(flat, self.store.config.logical_pages)
        self.store.offload(layers, pages)
        self.counts.moved(pages, -1)
        self.last_moves = LayerPageMoves(offloaded=_by_layer(layers, pages), loaded={})  # if loads raise
        return self.last_moves.offloaded

    def _load(self, layers: np.ndarray, pages: np.ndarray) -> np.ndarray:
        """Onload, copying the pages holding KV (returned). A launch that raises moves nothing: the
        wants are marked again, the next pass is a full one, no step reads them as resident."""
        copy = self.has_kv_np[pages]
        try:
            self.store.onload(layers, pages, copy)
        except BaseException:
            self.counts.mark_dirty(pages)
            self.changed = True
            raise
        self.counts.moved(pages, 1)
        return copy

    def _apply_needs(self, flat: np.ndarray, reserve: int) -> tuple[dict[int, list[int]], int, int]:
        """Onload the sorted flat ids (lower layers first) that fit beside ``reserve``."""
        layers, pages = np.divmod(flat, self.store.config.logical_pages)
        room = max(0, self.store.allocator.free_count - reserve)
        shortfall = max(0, int(layers.size) - room)
        self.counts.mark_dirty(pages[room:])  # wants left short: the next pass retries them
        layers, pages = layers[:room], pages[:room]
        copy = self._load(layers, pages)
        return _by_layer(layers[copy], pages[copy]), int((~copy).sum()), shortfall

    # ----- stats ----------------------------------------------------------------------

    def stats(self) -> ResidencyStats:
        """Snapshot (see :class:`ResidencyStats`)."""
        self.settle()
        store = self.store
        live, host = self.counts.live_stats()
        return ResidencyStats(
            device_pages_used=store.allocator.used_count,
            device_pages_total=store.allocator.capacity,
            staging_pages=store.staging_pages,
            host_pages=store.config.logical_pages if store.host_tier else 0,
            live_requests=len(self.requests),
            live_layer_pages=live,
            host_layer_pages=host,
            host_fraction=host / live if live else 0.0,
            h2d_bytes_total=store.h2d_bytes,
            d2h_bytes_total=store.d2h_bytes,
            host_write_bytes_total=store.host_write_bytes,
            shortfall_layer_pages_total=self.shortfall_total,
            journalled_decode_steps_total=self.journal.steps,
            ended_batches_total=self.ended.applications,
        )
