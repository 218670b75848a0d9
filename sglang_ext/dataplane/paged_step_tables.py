"""PagedStepTables: a paged-layout step's tables with the ``L x`` work on the pool's device.

The same tables and launch plan as :class:`~sglang_ext.dataplane.step_tables.StepTables`
(whose docstring defines them) for the paged layout without recompute -- the layout of every
offloading server -- built so that the host's work is proportional to the batch's pages
(``n``), its new tokens times ``L``, and the layer-pages actually fetched, never to ``L x n``:

- ``tab [L, n]`` is gathered on the device from the store's :class:`MapMirror`
  (``mirror.dev[:, pages]``, then ``where(tab < 0, stage_col, tab)``): the host uploads the
  batch's pages and staging columns (``2n`` int32), not ``L x n`` entries.
- Which requests have host-only pages at which layer (staging, triggers) comes from the
  mirror's per-page host-layer bits (``L / 8`` bytes per page).
- Fetches are enumerated only inside the (layer, request) pairs that have host pages; new
  tokens' dirty ids and write-backs from the map at the new tokens' pages (``L x`` those pages);
  their rows from the map too in a decode step (``L x`` the batch), on the device from ``tab`` in
  a multi-token step (prefill, extend: ``tab[:, col] * page_size + off``, the upload carrying
  ``col`` and ``off`` instead of ``L x m`` rows).

Launches, rows and tables equal StepTables' (``tests/dataplane/test_paged_step_tables.py``
builds both on the same store; at Llama-3-8B shapes the boundary drops from ~10 ms to ~1 ms
of host time, ``kvplane gpu-check``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from sglang_ext.dataplane.deferred_device import DeferredDevice
from sglang_ext.dataplane.page_launches import PageLaunches
from sglang_ext.dataplane.paged_fetch_plan import PagedFetchPlan
from sglang_ext.dataplane.slot_kv_store import SlotKVStore
from sglang_ext.dataplane.sorted_ids import distinct_sorted, inserted, run_bounds
from sglang_ext.dataplane.staging_columns import (
    decoded,
    fetch_entries,
    restaged,
    staged_columns,
    sync_mirror,
)
from sglang_ext.dataplane.step_tables import Launch, StepTables
from sglang_ext.dataplane.token_writeback import TokenWriteback

PARK_MAX_BYTES = 64 << 20
"""Largest step buffer of parked new tokens (:class:`TokenWriteback`): a decode batch whose
offloaded layers' tokens need more (about 100 layers x 256 requests x 2 KiB rows x K and V) writes
back its staged pages per layer instead, as multi-token steps do."""

if TYPE_CHECKING:
    from sglang_ext.dataplane.staging_room import StagingRoom


class PagedStepTables(PagedFetchPlan, DeferredDevice, StepTables):
    """StepTables for the paged layout without recompute (module docstring)."""

    def __init__(self, store: SlotKVStore, pages: Sequence[np.ndarray], seq_lens: np.ndarray,
                 new_counts: np.ndarray, new_slots: np.ndarray | None,
                 stage: Callable[[int], np.ndarray | None], *, token_tables: bool = True,
                 resident: bool = False, defer: bool = False) -> None:
        """``resident``: the caller knows no page of the batch is host-only at any layer (the
        host-bit pass over the batch's pages is skipped: nothing stages, fetches or writes back).
        ``defer``: a decode step's device half waits for a reader (:class:`DeferredDevice`)."""
        mirror = store.mirror
        if mirror is None:
            raise ValueError("PagedStepTables needs the paged layout (the store has no map mirror)")
        c = store.config
        layers, ps = c.layers, c.page_size
        self.identity = False
        self.recompute = None
        self._store = store
        self._fetch_views: tuple[torch.Tensor, ...] | None = None
        """The fetches' views of the upload common to every launch (set at the first fetch)."""
        self.staging_ids = np.zeros(0, dtype=np.int64)
        counts, flat, starts, col, off = self._columns(pages, seq_lens, new_counts, new_slots, ps)
        b, n = self.batch, int(flat.size)
        self._one_each = bool((new_counts == 1).all())
        """Every request writes one new token (a decode step): the tables may be :meth:`advanced`."""
        self._mirror_syncs = sync_mirror(store, mirror)
        nonempty = counts > 0
        host_req = np.zeros((layers, b), dtype=bool)
        if n and not resident:
            host_req[:, nonempty] = mirror.host_layers(flat, starts[nonempty])
        staged_req = host_req.any(axis=0)
        self._host_req = host_req
        stage_col = stage_up = readers = None
        if staged_req.any():
            need_at = np.flatnonzero(np.repeat(staged_req, counts))
            rank, owners, readers = staged_columns(flat, need_at, col)  # one staging page a distinct page
            ids = stage(int(owners.size))
            if ids is None:
                self.staging_ids = None  # type: ignore[assignment]
                return
            self.staging_ids = ids
            self._stage_pos = owners
            """The column of each of ``staging_ids``, in that order (ascending after a build, not
            after an advance: the opened pages' staging comes last): its owner column
            (:mod:`~sglang_ext.dataplane.staging_columns`)."""
            stage_col = np.full(n, -1, dtype=np.int64)
            stage_col[need_at] = ids if rank is None else ids[rank]
            stage_up = stage_col if readers is None else fetch_entries(stage_col, readers)
        self._shared_staging = readers is not None
        """Staged columns share staging pages (fetched once, by owners; readers' entries encoded)."""
        self._stage_np, self._starts_np, self._counts_np = stage_up, starts, counts
        # a multi-token step (prefill, extend) fetches only the pages that held KV before it: its
        # new pages are written by the layers, not read from host (a decode step's opened page is
        # fetched with the others, so its tables advance as they are)
        fetch_counts = counts if self._one_each else np.minimum(counts, -(-(seq_lens - new_counts) // ps))
        self._fetch_counts_np = None if self._one_each else fetch_counts
        last = np.maximum.accumulate(np.where(host_req, np.arange(layers)[:, None], -1), axis=0)
        trigger = np.vstack([np.full((1, b), -1, dtype=np.int64), last[:-1]])
        # the new tokens' pages at every layer: dirty ids, write-backs (L x their pages) and rows:
        # a decode step's (L x batch) from the map here; a multi-token step's (prefill, extend:
        # L x its new tokens, 4 MB of int64 for a 16K-token chunk at 32 layers) on the device from
        # ``tab`` below -- the upload carries each new token's column and in-page offset
        ucol = distinct_sorted(col)
        new_host = rows = None
        if self._one_each:
            new_map = np.take(store.map_np, flat[col], axis=1).astype(np.int64)
            new_host = new_map < 0
            if stage_col is not None:
                new_map = np.where(new_host, stage_col[col][None, :], new_map)
            rows = new_map * ps + off[None, :]
        u_host = np.take(store.map_np, flat[ucol], axis=1) < 0
        self.dirty_ids = store.identity_ids(flat[ucol])[~u_host]
        self.new_pages = flat[ucol]
        int64_parts: list[np.ndarray] = [off if rows is None else rows.reshape(-1)]
        offset = int(int64_parts[0].size)
        self.page_launches = PageLaunches()
        self._fetch_list: list[Launch] | None = None
        self.writebacks: list[Launch | None] = [None] * layers
        parked = None if stage_col is None or not self._one_each else self._park_parts(  # a decode step parks
            store, new_host, flat[col], off, offset, int64_parts)
        if parked is not None:
            offset = parked
        elif stage_col is not None:
            offset = self._writeback_parts(store, u_host, stage_col[ucol], flat[ucol], offset, int64_parts)
        elif u_host.any():
            raise RuntimeError("a new token's page is host-only at some layer but its request is not staged")
        self._token_parts(token_tables, seq_lens, starts, ps, offset, int64_parts)
        head = [flat] if stage_col is None else [flat, stage_up, starts, fetch_counts, self._fetch_launches(
            mirror, flat, fetch_counts, starts, staged_req, host_req, trigger, 2 * n + 2 * b, readers)]
        self._col_at = sum(int(h.size) for h in head)
        if rows is None:
            head.append(col)
        self._count_launched()
        self._b, self._rows_np, self._new_host = b, rows, new_host
        """``_rows_np``: the new tokens' rows on the host (a decode step's, else None): a graph's
        block is sent them. ``_new_host``: ``[L, b]``, where they are host-only (a decode step's)."""
        self._pack(int64_parts, head, counts, seq_lens, ps, lazy=defer and rows is not None)
        self._finish(defer and rows is not None)

    def _materialize_now(self) -> None:
        """The device half (:class:`DeferredDevice`) from the packed upload: ``tab [L, n]``, int32
        device pages per layer (FlashInfer ``kv_indices`` rows) gathered from the mirror, staged
        columns at their staging pages; ``rows [L, m]``, the new tokens' int64 device rows (a
        multi-token step's from ``tab``: three device ops); the CSR."""
        store, n, ps = self._store, self._n, self._store.config.page_size
        assert store.mirror is not None
        parked = self.token_writeback
        if parked is not None:  # the parked tokens' transient buffer (a replayed step parks in the graph's)
            parked.allocate()
            if parked.writer is not None:
                parked.rows_index = store.row_ids(parked.tokens)
        self._send_packed(store)
        tab = store.mirror.dev.index_select(1, self.i32[:n])
        if self._stage_np is not None and self.staging_ids.size:
            entries = self.i32[n: 2 * n]
            tab = torch.where(tab < 0, (decoded(entries) if self._shared_staging else entries)[None, :], tab)
        self.tab = tab
        if self._rows_np is None:  # rows[l, j] = tab[l, col[j]] * page_size + off[j]
            m, at = self._m, self._col_at
            self.rows = torch.add(self.i64[:m], tab.index_select(1, self.i32[at: at + m]).long(), alpha=ps)
        else:
            self.rows = self.i64[: self._rows_np.size].view(store.config.layers, self._m)
        self._bind_csr(self._csr_at, self._b)

    def _writeback_parts(self, store: SlotKVStore, u_host: np.ndarray, dev_pages: np.ndarray, pages: np.ndarray,
                         offset: int, int64_parts: list[np.ndarray]) -> int:
        """Each layer's write-back of the new tokens' host-only pages (``u_host[l, j]``: page
        ``pages[j]``, staged in device page ``dev_pages[j]``): one :class:`Launch` per layer with
        any, its segments appended to ``int64_parts`` as ``store.dev_segs`` of the staged pages
        then ``store.host_segs`` of the layer-pages (K then V each), layer after layer, built for
        all layers at once. Returns the offset after them."""
        w_layer, w_j = np.nonzero(u_host)  # layer-major
        n = int(w_layer.size)
        if not n:
            return offset
        src, dst = dev_pages[w_j], (pages[w_j] * store.config.layers + w_layer) * 2
        starts, sizes = run_bounds(w_layer)  # each layer's pairs
        group = np.repeat(np.arange(starts.size), sizes)
        c = sizes[group]
        at = 4 * starts[group] + np.arange(n) - starts[group]  # a layer's block: src K, src V, dst K, dst V
        out = np.empty(4 * n, dtype=np.int64)
        out[at], out[at + c], out[at + 2 * c], out[at + 3 * c] = src, src + store.pages_total, dst, dst + 1
        for s, k, layer in zip(starts.tolist(), sizes.tolist(), w_layer[starts].tolist(), strict=True):
            self.writebacks[layer] = Launch(layer, layer, offset + 4 * s, 2 * k)
        int64_parts.append(out)
        return offset + 4 * n

    def _park_parts(self, store: SlotKVStore, new_host: np.ndarray, pages: np.ndarray, offsets: np.ndarray,
                    offset: int, int64_parts: list[np.ndarray], like: TokenWriteback | None = None) -> int | None:
        """A decode step's write-back of its new tokens host-only at some layer (``new_host [L, m]``,
        token ``j`` at ``offsets[j]`` of page ``pages[j]``): parked in a step buffer and written
        back in one launch (:class:`TokenWriteback`), its indices appended to ``int64_parts``.
        Returns the offset after them; None (nothing appended) when the buffer would pass
        :data:`PARK_MAX_BYTES`: the caller writes back pages per layer."""
        c, rows = store.config, store.host_rows
        planned = TokenWriteback.plan(
            new_host, pages, offsets, c.page_size, offset,
            lambda s, m: torch.empty((s, 2, m, c.kv_heads, c.head_dim), dtype=c.dtype, device=store.device), like)
        if planned is None:
            return offset
        parked, indices = planned  # planned only (nothing allocated): dropped if it is too large
        if parked.layers * 2 * parked.tokens * rows.shape[1] * rows.element_size() > PARK_MAX_BYTES:
            return None
        self.token_writeback = parked
        self.token_writeback.writer = store.row_writer  # parks go through it (rows 0..m-1, the store's)
        int64_parts.append(indices)
        return offset + int(indices.size)

    def _count_launched(self) -> None:
        """The layer-pages the fetch and write-back launches move (for the pipeline's accounts;
        a parked token counts as its layer-page, as the page write-back moved it)."""
        self.fetch_layer_pages = self.page_launches.layer_pages
        pages = sum(w.segments for w in self.writebacks if w is not None) // 2 if self.writes_back_pages else 0
        self.writeback_layer_pages = pages + (self.token_writeback.pairs if self.token_writeback is not None else 0)

    def _opened_columns(self, opens: np.ndarray, opened: np.ndarray) -> tuple[np.ndarray, ...]:
        """The page lists with batch rows ``opens`` (ascending) one page longer (``opened``, each
        after its request's last): ``(counts, ends, flat, starts, lastcol)`` -- pages per request,
        where each opened page goes in the old columns, every page, each request's first column
        and the column of its new token."""
        counts = self._counts_np.copy()
        counts[opens] += 1
        ends = self._starts_np[opens] + self._counts_np[opens]
        flat = inserted(self.pages, ends, opened)
        starts = np.cumsum(counts) - counts
        return counts, ends, flat, starts, starts + counts - 1

    def _opened_successor(self, flat: np.ndarray, starts: np.ndarray, counts: np.ndarray, last: np.ndarray,
                          seq_lens: np.ndarray, syncs: int | None = None,
                          known: tuple[np.ndarray, np.ndarray, int] | None = None) -> PagedStepTables:
        """:meth:`_successor` over the new page lists, ``last`` the new pages, the mirror synced
        (here, with the caller's ``known`` columns if they serve: :meth:`MapMirror.sync`; or by
        the caller: ``syncs``, its count after)."""
        store, mirror = self._store, self._store.mirror
        assert mirror is not None
        nxt = self._successor()
        nxt.pages, nxt._n, nxt._starts_np, nxt._counts_np = flat, int(flat.size), starts, counts
        nxt._mirror_syncs = sync_mirror(store, mirror, known) if syncs is None else syncs
        nxt._width = int(seq_lens.max())
        nxt.new_pages = last
        return nxt

    @property
    def _advances(self) -> bool:
        """These tables may be advanced: no token tables, one new token per request."""
        return self._tok_at < 0 and self._one_each

    def _successor(self) -> PagedStepTables:
        """A copy of these tables (shared arrays and device tensors) for an advance to update."""
        nxt = object.__new__(PagedStepTables)
        nxt.__dict__.update(self.__dict__)
        nxt.token_writeback = None  # these tables' parked tokens are theirs
        nxt._new_host = None  # set by an advance that knows it (advanced_staged)
        nxt._fetch_views, nxt._pending = None, False  # views of these tables' upload; set again by the advance
        return nxt

    def advanced(self, defer: bool = False) -> PagedStepTables | None:
        """The next steady decode step's tables, derived on the device from these, or None when
        that step needs a build. The caller knows the step is the same batch with one token more
        each, no page opened, these staged nothing (so fetched and wrote back nothing) and the
        map unchanged since they were built (:meth:`PagedDecodeStep.still_resident`). Tables
        with token tables, or of a step that was not one token per request, do not advance.
        Otherwise the page tables and CSR pages are these, and each new token's row and each
        request's ``kv_lens`` / ``last_page_len`` are one more (two device ops, no upload, no
        host work per page). Dirty ids and new pages are these (the caller marks them again)."""
        if not self._advances:
            return None
        b, lens = self.batch, self._csr_np[1] + 1
        if defer:  # the host half only: the rows and lengths one more, the same pages
            nxt = self._successor()
            nxt._rows_np = self._rows_np + 1
            nxt._pack([nxt._rows_np.reshape(-1)], [self.pages], self._counts_np, lens[:b].astype(np.int64),
                      self._store.config.page_size, lazy=True)
            nxt._finish(True)
            return nxt
        self.materialize()
        nxt = self._successor()
        nxt.rows = self.rows + 1
        nxt._rows_np, nxt._csr_np = self._rows_np + 1, (self._csr_np[0], lens)
        nxt._lens_pair = self._lens_pair + 1
        nxt.kv_lens, nxt.last_page_len = nxt._lens_pair[:b], nxt._lens_pair[b:]
        if self._store.staged_uploads:
            # a new pinned host copy in the ring's next slot (the last one may still feed a plan's
            # copy), with the indptr beside it: every host view of a step lives in its own take
            host = self._store.uploads.stage(np.concatenate([self.host_indptr.numpy(), self._host_lens_pair.numpy() + 1]))
            nxt.host_indptr, nxt._host_lens_pair = host[: b + 1], host[b + 1:]
        else:
            nxt._host_lens_pair = self._host_lens_pair + 1
        nxt.host_last_page_len = nxt._host_lens_pair[b:]
        return nxt

    def advanced_opening(self, opens: np.ndarray, opened: np.ndarray, seq_lens: np.ndarray,
                         defer: bool = False) -> PagedStepTables | None:
        """The next steady decode step's tables when batch rows ``opens`` (ascending) open pages
        ``opened`` with their new token, or None when these tables do not advance (as
        :meth:`advanced`). The caller knows the rest is :meth:`advanced`'s case and the opened
        pages resident at every layer, the map changed since these were built in their columns
        only (:meth:`PagedDecodeStep.still_resident`). The page lists gain one column each: one
        insert on the host, the page tables spliced on the device from these and the mirror's
        columns of the opened pages; the new tokens' rows, dirty ids and CSR are rebuilt from the
        map at the batch's last pages (``L x batch``). One upload, no host work per batch page
        beyond the insert: a batch-32 step at page 16 opens a page most steps, so this, not
        :meth:`advanced`, is the usual resident step."""
        if not self._advances or not opened.size:
            return None
        store, mirror = self._store, self._store.mirror
        assert mirror is not None
        layers, ps, b = store.config.layers, store.config.page_size, self._b
        counts, ends, flat, starts, lastcol = self._opened_columns(opens, opened)
        last = flat[lastcol]  # the page of each request's new token
        # a request that opened no page writes one row further on its page (the map unmoved there),
        # an opening one row 0 of its new page
        rows = self._rows_np + 1
        seen, taken = mirror.changes, np.take(store.map_np, opened, axis=1)  # the opened pages' columns
        rows[:, opens] = np.multiply(taken, ps, dtype=np.int64)
        if defer:  # the host half only (the mirror synced on its own: the tables' upload may never go)
            nxt = self._opened_successor(flat, starts, counts, last, seq_lens, known=(opened, taken, seen))
            nxt.dirty_ids, nxt._rows_np = store.identity_ids(last).reshape(-1), rows
            nxt._pack([rows.reshape(-1)], [flat], counts, seq_lens, ps, lazy=True)
            nxt._finish(True)
            return nxt
        self.materialize()
        if mirror.pending:  # the scatter below must not overtake an earlier step's fetches reading the mirror
            store.engine.wait_fence()
        # the opened pages' columns ride with the tables' upload: the mirror's sync and the
        # splice read them there (one upload, where a separate sync made two)
        synced = mirror.sync_within(opened, known=(opened, taken, seen))  # the columns read above
        k = int(opened.size)
        head = [opened] if synced is None else [opened, synced.reshape(-1)]
        try:
            nxt = self._opened_successor(flat, starts, counts, last, seq_lens, mirror.syncs)
            nxt.dirty_ids = store.identity_ids(last).reshape(-1)
            nxt._upload(store, [rows.reshape(-1)], head, counts, seq_lens, ps)
            if synced is None:
                cols = mirror.dev.index_select(1, nxt.i32[:k])
            else:
                cols = nxt.i32[k: k + layers * k].view(layers, k)
                mirror.scatter(nxt.i32[:k].long(), cols)
        except BaseException:
            if synced is not None:  # the columns never reached the device: still due
                mirror.changed(opened)
            raise
        pieces, at = [], 0
        for j, end in enumerate(ends.tolist()):
            pieces += [self.tab[:, at:end], cols[:, j: j + 1]]
            at = end
        pieces.append(self.tab[:, at:])
        nxt.tab = torch.cat(pieces, dim=1)
        nxt.rows = nxt.i64[: layers * b].view(layers, b)
        nxt._rows_np = rows
        nxt._bind_csr(k if synced is None else k + layers * k, b)
        return nxt

    def advanced_staged(self, opens: np.ndarray, opened: np.ndarray, seq_lens: np.ndarray,
                        room: StagingRoom, defer: bool = False) -> PagedStepTables | None:
        """The next steady decode step's tables when these staged (the placed steady step), or
        None (nothing taken) when that step needs a build. Batch rows ``opens`` (ascending, maybe
        none) open pages ``opened``. The caller knows the step is :meth:`advanced_opening`'s but
        for staging: the map changed since these were built in the opened pages' columns only.
        Then the host-only (layer, request) pairs, the fetch groups and their triggers are these
        -- provided each opened page is host-only only at layers where its request already was
        (else None) -- and the staging pages are these again (``room.renew``: as
        :meth:`LayerPipeline.end_step` gave them back, but for those the boundary's placement of
        the opened pages took meanwhile, replaced), plus one per opened page of a staged request.
        Rebuilt: the page lists (one insert), the fetches' sizes, the new tokens' rows,
        write-backs and dirty ids (``L x batch``), one upload and the page tables' gather on the
        device; not the pass over every page's host bits a build makes."""
        if not self._advances or not self.staging_ids.size:
            return None
        store, mirror = self._store, self._store.mirror
        assert mirror is not None
        layers, ps, b = store.config.layers, store.config.page_size, self._b
        # the opened pages' map columns [L, k] and the mirror's count of changes when read: the
        # mirror's sync takes them if nothing moves meanwhile
        seen, taken = mirror.changes, np.take(store.map_np, opened, axis=1)
        host_new = taken < 0
        host_req = self._host_req[:, opens]
        if opened.size and (host_new & ~host_req).any():
            return None  # a new host-only (layer, request): new fetch groups
        stage_new = host_req.any(axis=0)  # opened pages of staged requests
        old = self.staging_ids
        # those the boundary's placements did not take meanwhile, then new ones for the others and
        # the opened pages of staged requests
        kept, joined = room.renew(old, int(stage_new.sum()))
        if joined is None:
            return None
        try:  # a raise from here on (the mirror's sync, the upload) gives the staging back: else leaked
            more = joined[kept:]
            stage_col = self._stage_np  # the uploaded entries: shared pages' readers encoded
            if kept < old.size and self._shared_staging:  # every column reading a taken page gets its new one
                stage_col = restaged(stage_col, old[kept:], more[: old.size - kept])
            elif kept < old.size:  # the columns whose staging page was taken get new ones
                stage_col = stage_col.copy()
                stage_col[self._stage_pos[kept:]] = more[: old.size - kept]
            counts, ends, flat, starts, lastcol = self._opened_columns(opens, opened)
            values = np.full(opened.size, -1, dtype=np.int64)
            values[stage_new] = more[old.size - kept:]
            stage_col = inserted(stage_col, ends, values)
            last, last_stage = flat[lastcol], stage_col[lastcol]
            off = (seq_lens - 1) % ps
            if kept == old.size and self._new_host is not None:
                # every staging page kept: a request that opened no page writes one row further on the
                # same page, placed and staged as it was; an opening one at offset 0 of its new page
                u_host, rows = self._new_host.copy(), self._rows_np + 1
                if opened.size:
                    u_host[:, opens] = host_new
                    rows[:, opens] = np.where(host_new, values[None, :], taken) * ps
            else:
                new_map = np.take(store.map_np, last, axis=1).astype(np.int64)
                u_host = new_map < 0
                rows = np.where(u_host, last_stage[None, :], new_map) * ps + off[None, :]
            nxt = self._opened_successor(flat, starts, counts, last, seq_lens, known=(opened, taken, seen))
            nxt._new_host = u_host
            n = int(flat.size)
            nxt._stage_np = stage_col
            nxt.staging_ids = joined
            nxt._stage_pos = np.concatenate([self._stage_pos + np.searchsorted(ends, self._stage_pos, side="right"),
                                             (ends + np.arange(ends.size))[stage_new]])
            nxt.dirty_ids = store.identity_ids(last)[~u_host]
            nxt.writebacks = [None] * layers
            int64_parts: list[np.ndarray] = [rows.reshape(-1)]
            if nxt._park_parts(store, u_host, last, off, rows.size, int64_parts,
                               self.token_writeback) is None:
                nxt._writeback_parts(store, u_host, last_stage, last, rows.size, int64_parts)
            pages = self._group_pages
            if opened.size:  # each opened host-only layer-page joins its request's group at that layer
                add = np.zeros((layers, b), dtype=np.int64)
                add[:, opens] = host_new
                a, _, pair_l = self._groups
                pages = pages + np.add.reduceat(add[pair_l, self._reqs_np], a)
            nxt._emit_fetches(pages, counts, self._reqs_np, 2 * n + 2 * b, like=self.page_launches)
            nxt._count_launched()
            nxt._rows_np = rows
            nxt._pack(int64_parts, [flat, stage_col, starts, counts, self._reqs_np], counts, seq_lens, ps, lazy=defer)
            nxt._finish(defer)  # the device half: one upload, the page tables' gather
            return nxt
        except BaseException:
            room.give_back(joined)
            raise

    @property
    def host_layer_pages(self) -> int:  # type: ignore[override]
        """Host-only layer-pages among the batch's (from the mirror's bits; read it during the
        step: nobody needs it per step, so it is not counted per step)."""
        mirror = self._store.mirror
        assert mirror is not None
        return mirror.host_count(self.pages) if self.pages.size else 0
