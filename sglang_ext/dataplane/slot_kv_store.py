"""SlotKVStore: layered KV storage keyed by SGLang's logical slot/page space.

Primitives (pure mechanism; :class:`~sglang_ext.dataplane.slot_residency.SlotResidency`
decides what goes where, :class:`~sglang_ext.dataplane.step_tables.StepTables` and
:class:`~sglang_ext.dataplane.layer_pipeline.LayerPipeline` run a forward over it):

- ``write_rows(rows, k, v)`` -- a layer's new KV into device rows (resident pages or
  staging pages; the step's tables chose them). Never touches host memory.
- ``onload(layers, pages, copy=)`` / ``offload(layers, pages)`` -- boundary moves of layer-pages
  (one batched H2D / D2H launch each, through the transfer engine; dirty pages are written back
  before their device copy is dropped).
- ``sync_dirty()`` -- eager write-back of every dirty device layer-page (SuperInfer §4.3.2
  "eager block rotation"), one batched D2H launch, in the background.
- ``release_pages(pages)`` -- SGLang's allocator took these pages back.
- ``read_kv(layer, slots)`` -- K/V of any slots, at rest (tests and ``move_kv_cache``; waits for
  the copies, so never inside a forward).

Layout (docs/sglang-integration.md, "layered pool contract"):

- host ``[P, L, 2, page_size, H, D]``: block-first home of every layer of every logical page
  (pinned on CUDA: the DMA source and target of every copy, no pageable intermediates); none
  without a host tier (:attr:`SlotStoreConfig.host_tier`: a served identity layout);
- device ``[2, N, page_size, H, D]``: ONE page pool shared by all layers (a page holds one
  layer's K and V of ``page_size`` tokens; FlashInfer's NHD paged layout), N = the budget;
  when the budget holds all ``L * P`` layer-pages the layout is the *identity* one
  (``(l, p)`` at page ``l * P + p``), so a layer is one slice read in place;
- map ``[L, P]`` int32 (host memory): device page of each (layer, page), -1 = only on host.
  Kernels never read it. In the paged layout a :class:`MapMirror` keeps a copy on the pool's
  device, updated with the columns that changed (one upload per step), from which the step's
  page tables are gathered on the device.
- dirty ``[L, P]`` bool (host memory only) plus a log of marked ids, so write-back enumerates
  what changed, never the whole map.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from sglang_ext.dataplane.block_allocator import BlockAllocator
from sglang_ext.dataplane.host_pool import allocate_host_pool
from sglang_ext.dataplane.identity_pages import IdentityPages
from sglang_ext.dataplane.map_mirror import MapMirror
from sglang_ext.dataplane.pinned_upload_ring import PinnedUploadRing
from sglang_ext.dataplane.slot_store_config import SlotStoreConfig
from sglang_ext.dataplane.sorted_ids import ascending, distinct_sorted
from sglang_ext.dataplane.transfer_engine import TransferEngine, make_transfer_engine

RowWriter = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]
"""``writer(k_dst, v_dst, rows, k, v)``: ``k_dst[rows] = k`` and ``v_dst[rows] = v`` (``[R, H, D]``
destinations, ``[n]`` int64 device rows, ``[n, H, D]`` sources) in one launch
(:attr:`SlotKVStore.row_writer`)."""

DIRTY_LOG_COMPACT = 1 << 16
"""Entries in the dirty log above which it is compacted (amortised O(marks))."""


def as_np(values) -> np.ndarray:  # noqa: ANN001 - tensor, array or list
    """int64 NumPy array of ``values`` (a CPU tensor is viewed, not copied)."""
    if isinstance(values, torch.Tensor):
        values = values.numpy()
    return np.asarray(values, dtype=np.int64)


class SlotKVStore:
    """Device page pool + block-first host pool + the (layer, page) -> device page map."""

    def __init__(self, config: SlotStoreConfig) -> None:
        self.config = c = config
        self.device = torch.device(c.device)
        self.identity = c.identity
        """The budget holds every layer-page: ``(l, p)`` lives at device page ``l * P + p``, so
        each layer is one contiguous slice readable in place with SGLang's slot ids, and a
        host-only layer-page is staged at its own identity page."""
        self.pages_total = c.layers * c.logical_pages if self.identity else c.device_pages
        self.host_tier = c.host_tier
        """Host pages exist (:attr:`SlotStoreConfig.host_tier`; else :attr:`host` is a scratch page)."""
        self.host = allocate_host_pool(  # pinned at exactly its size on CUDA (host_pool.py)
            (c.host_pages, c.layers, 2, c.page_size, c.kv_heads, c.head_dim), c.dtype,
            pin=self.device.type == "cuda",
        )
        self.dev = torch.zeros((2, self.pages_total, c.page_size, c.kv_heads, c.head_dim), dtype=c.dtype,
                               device=self.device)
        self.sink_page: int | None = None
        """``graph_sink``: the device page padded rows go to, which no layer-page maps to (paged:
        the last, kept from the allocator; identity: 0, SGLang's padding page at layer 0)."""
        if c.graph_sink:
            if not self.identity and self.pages_total < 2:
                raise ValueError("SlotStoreConfig.graph_sink needs device_pages >= 2 (one is the sink)")
            self.sink_page = 0 if self.identity else self.pages_total - 1
        self.map_np = np.full((c.layers, c.logical_pages), -1, dtype=np.int32)
        self.map_cpu = torch.from_numpy(self.map_np)
        """Torch view of ``map_np`` (same memory)."""
        self.map_flat_np = self.map_np.reshape(-1)
        """``map_np`` flat (same memory): ``(l, p)`` is element ``l * P + p``."""
        self.mirror = None if self.identity else MapMirror(self.map_np, self.device)
        """Paged layout: the map on the pool's device plus per-page host-layer bits, for the
        step's tables (:class:`~sglang_ext.dataplane.map_mirror.MapMirror`); every writer of
        ``map_np`` reports its pages through :meth:`map_changed`."""
        self.staged_uploads = self.device.type == "cuda"
        """Host views a step keeps (beside its uploads) are staged in :attr:`uploads` (a device
        pool: the upload's source must not change under the copy); on the CPU they are plain
        arrays (a test may set it to run the device path on the CPU)."""
        self.uploads = PinnedUploadRing(self.device)
        """Pinned buffers of the step tables' uploads (:class:`PinnedUploadRing`; the mirror has
        its own)."""
        self._layer_base = np.arange(c.layers, dtype=np.int64)[:, None] * c.logical_pages
        self.dirty_np = np.zeros((c.layers, c.logical_pages), dtype=bool)
        self.dirty = torch.from_numpy(self.dirty_np)
        """``[L, P]`` bool (host memory): the device copy is newer than the host copy."""
        self.has_kv_np = np.zeros(c.logical_pages, dtype=bool)
        self.has_kv = torch.from_numpy(self.has_kv_np)
        """``[P]`` bool: pages holding KV (written since SGLang allocated them); only these are
        copied on onload and fetched into staging."""
        self._dirty_log: list[np.ndarray] = []
        self._dirty_logged = 0
        self._dirty_compact_at = DIRTY_LOG_COMPACT
        self.dirty_compactions = 0
        """Times the dirty log was compacted (amortised: see :meth:`mark_dirty`)."""
        self.allocator: BlockAllocator | IdentityPages = (
            IdentityPages(self.pages_total, "device KV pages") if self.identity
            else BlockAllocator(self.pages_total - (self.sink_page is not None), "device KV pages")
        )
        self.host_rows = self.host.view(-1, c.kv_heads * c.head_dim)
        self.host_row_bytes = self.host_rows.shape[1] * self.host_rows.element_size()
        """Bytes of one token row of :attr:`host_rows` (a parked token's K or V as written back)."""
        """The host pool as token rows ``[P * L * 2 * page_size, H * D]`` (a view): row
        ``((p * L + l) * 2 + kv) * page_size + offset`` holds token ``offset`` of page ``p``'s K
        (``kv = 0``) or V at layer ``l``."""
        seg = c.page_size * c.kv_heads * c.head_dim
        self.engine: TransferEngine = make_transfer_engine(self.host.view(-1, seg), self.dev.view(-1, seg),
                                                               copy_programs=c.copy_programs,
                                                               copy_engine=c.copy_engine,
                                                               timing_interval=c.timing_interval)
        self.engine.host_page_rows = 2 * c.layers  # block-first: a page's K and V of every layer, then the next page
        # the copies' kernels compiled now, not on a request's path: the pools' segments, a paged
        # step's fetch, and a decode step's parked tokens (token rows)
        self.engine.warm_pool_copies(None if self.mirror is None else self.mirror.rows[0])
        if not self.identity:
            self.engine.warm_rows(self.host_rows)
        self.h2d_bytes = 0
        self.d2h_bytes = 0
        self.host_write_bytes = 0
        """Bytes of new KV that reached host memory by write-back of staged pages."""
        self.staging_pages = 0
        """Device pages lent to staging this step (counted in ``used``)."""
        self.deferred_tables = self.materialized_tables = 0
        """Decode steps' tables built without their device half, and those of them made later
        (``DeferredDevice``: a step a graph declined, or read eagerly)."""
        self._flat = (self.dev[0].view(-1, c.kv_heads, c.head_dim), self.dev[1].view(-1, c.kv_heads, c.head_dim))
        self._row_ids = torch.zeros(0, dtype=torch.int64, device=self.device)
        """:meth:`row_ids`' kept tensor."""
        self.row_writer: RowWriter | None = None
        """Writes a layer's new K and V rows in ONE launch (:data:`RowWriter`); None: two
        ``index_copy_`` launches. The SGLang adapter sets SGLang's own KV store kernel on CUDA
        (:class:`sglang_ext.store_cache_writer.StoreCacheWriter`): the launches vanilla SGLang's
        pool makes, one per layer."""
        self._in_place: list[tuple[torch.Tensor, torch.Tensor]] = []
        """Identity layout: per-layer K/V views (built once; ``dev`` is never reallocated)."""
        if self.identity:
            shape = (c.layers, c.logical_pages * c.page_size, c.kv_heads, c.head_dim)
            k_all, v_all = self.dev[0].view(shape), self.dev[1].view(shape)
            self._in_place = [(k_all[layer], v_all[layer]) for layer in range(c.layers)]

    # ----- segment addressing -------------------------------------------------

    def host_segs(self, layers: np.ndarray, pages: np.ndarray) -> np.ndarray:
        """Host segments of these layer-pages: K segments then V segments (``[2n]`` int64)."""
        k = (pages * self.config.layers + layers) * 2
        return np.concatenate([k, k + 1])

    def dev_segs(self, dev_pages: np.ndarray) -> np.ndarray:
        """Device segments of these device pages: K segments then V segments (``[2n]`` int64)."""
        return np.concatenate([dev_pages, dev_pages + self.pages_total])

    # ----- map bookkeeping ---------------------------------------------------

    def map_changed(self, pages: np.ndarray) -> None:
        """The map's columns of ``pages`` were written (the mirror uploads them at the next step)."""
        if self.mirror is not None:
            self.mirror.changed(pages)

    def resident_mask(self) -> torch.Tensor:
        """``[L, P]`` bool: which layer-pages have a device copy (CPU tensor)."""
        return self.map_cpu >= 0

    def identity_ids(self, pages: np.ndarray) -> np.ndarray:
        """The identity device pages ``l * P + p`` of every layer of ``pages`` (``[L, n]`` int64;
        also the flat indices of those entries in ``map_np``)."""
        return self._layer_base + pages[None, :]

    def layer_in_place(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Identity layout only: K and V of ``layer`` as ``[P * page_size, H, D]`` views indexed
        by SGLang's slot ids (host-only pages hold what the step staged there)."""
        if not self.identity:
            raise RuntimeError("layer_in_place needs the identity layout")
        return self._in_place[layer]

    def all_resident(self, pages: np.ndarray) -> bool:
        """Whether every layer of these pages has a device copy."""
        return bool((np.take(self.map_np, pages, axis=1) >= 0).all()) if pages.size else True

    def device_views(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The device pool as flat K and V rows ``[N * page_size, H, D]`` (views, no copy)."""
        return self._flat

    # ----- data path -----------------------------------------------------------

    def write_rows(self, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """New K/V ``[n, H, D]`` into device rows ``rows`` (of ``device_views()[0]`` and ``[1]``):
        :meth:`write_into` the flat pool, no host work."""
        self.write_into(self._flat[0], self._flat[1], rows, k, v)

    def row_ids(self, m: int) -> torch.Tensor:
        """``0..m-1`` (int64, on the pool's device): a view of one kept tensor, grown by doubling
        (no device op per step once it holds the largest batch)."""
        if self._row_ids.numel() < m:
            self._row_ids = torch.arange(max(m, 2 * self._row_ids.numel()), device=self.device)
        return self._row_ids[:m]

    def write_into(self, k_dst: torch.Tensor, v_dst: torch.Tensor, rows: torch.Tensor, k: torch.Tensor,
                   v: torch.Tensor) -> None:
        """``k_dst[rows] = k``, ``v_dst[rows] = v`` (views of the device pool: the flat rows, or an
        identity layer in place): :attr:`row_writer`'s one launch, else two ``index_copy_``."""
        writer = self.row_writer
        if writer is not None:
            writer(k_dst, v_dst, rows, k, v)
            return
        k_dst.index_copy_(0, rows, k)
        v_dst.index_copy_(0, rows, v)

    def mark_dirty(self, flat_ids: np.ndarray) -> None:
        """Layer-pages ``l * P + p`` (int64 NumPy) got new KV on their device copy."""
        if not flat_ids.size:
            return
        self.dirty_np.reshape(-1)[flat_ids] = True
        self._dirty_log.append(flat_ids)
        self._dirty_logged += int(flat_ids.size)
        if self._dirty_logged > self._dirty_compact_at:
            ids = self._dirty_ids()
            self._dirty_log, self._dirty_logged = [ids], int(ids.size)
            # the next compaction waits for as many new marks as survived this one (amortised
            # O(marks) even when everything stays dirty, as in the identity layout)
            self._dirty_compact_at = max(DIRTY_LOG_COMPACT, 2 * int(ids.size))
            self.dirty_compactions += 1

    def mark_dirty_pages(self, pages: np.ndarray) -> None:
        """:meth:`mark_dirty` of every layer of ``pages``."""
        if pages.size:
            self.mark_dirty(self.identity_ids(pages).reshape(-1))

    def _dirty_ids(self) -> np.ndarray:
        """Flat ids that are dirty now (from the log: proportional to marks, not to the map)."""
        if not self._dirty_log:
            return np.zeros(0, dtype=np.int64)
        ids = distinct_sorted(np.concatenate(self._dirty_log))
        return ids[self.dirty_np.reshape(-1)[ids]]

    def _write_back(self, layers: np.ndarray, pages: np.ndarray) -> None:
        """D2H of these resident layer-pages (one launch); their dirty marks are cleared."""
        if not layers.size:
            return
        self._host_tier_for("a write-back")
        dev_pages = self.map_np[layers, pages].astype(np.int64)
        src, dst = self.dev_segs(dev_pages), self.host_segs(layers, pages)
        self.engine.d2h(self.engine.index_tensor(src), self.engine.index_tensor(dst), host_idx=(src, dst))
        self.dirty_np[layers, pages] = False
        self.d2h_bytes += int(src.size) * self.engine.segment_bytes

    def sync_dirty(self) -> int:
        """Write every dirty device layer-page back to host (background); return how many."""
        ids = self._dirty_ids()
        if ids.size:  # a launch that raises clears no mark and keeps the log (retried next time)
            self._write_back(*np.divmod(ids, self.config.logical_pages))
        self._dirty_log, self._dirty_logged, self._dirty_compact_at = [], 0, DIRTY_LOG_COMPACT
        return int(ids.size)

    # ----- movement at step boundaries ------------------------------------------

    def offload(self, layers, pages) -> None:  # noqa: ANN001 - tensors or arrays
        """Drop the device copies of these resident layer-pages (dirty ones written back first)."""
        layers, pages = as_np(layers), as_np(pages)
        if not layers.size:
            return
        self._host_tier_for("an offload")  # nothing changed: the KV stays where it is
        dev_pages = self.map_np[layers, pages].astype(np.int64)
        if (dev_pages < 0).any():
            raise ValueError("offload of a layer-page that is not on device")
        dirty = self.dirty_np[layers, pages]
        self._write_back(layers[dirty], pages[dirty])
        self.map_np[layers, pages] = -1
        self.map_changed(pages)
        self.allocator.free(dev_pages)

    def onload(self, layers, pages, copy) -> None:  # noqa: ANN001 - tensors or arrays
        """Give these host-only layer-pages device pages; copy host KV where ``copy`` is True.

        The caller checked the free count; raises ValueError (nothing changed) otherwise. A copy
        launch that raises changes nothing either: the pages stay host-only (their KV is there)
        and the device pages taken for them are freed again, then the error propagates.
        """
        layers, pages = as_np(layers), as_np(pages)
        copy = np.asarray(copy.numpy() if isinstance(copy, torch.Tensor) else copy, dtype=bool)
        n = int(layers.size)
        if n == 0:
            return
        if n > self.allocator.free_count:
            raise ValueError(f"onload of {n} layer-pages with {self.allocator.free_count} free device pages")
        if not self.host_tier:  # identity pages only: a page's KV written at rest is there already
            copy = np.zeros_like(copy)
        if isinstance(self.allocator, IdentityPages):
            dev_pages = layers * self.config.logical_pages + pages
            self.allocator.take_distinct(dev_pages)
        else:
            ids = self.allocator.alloc(n)
            assert ids is not None
            # ascending: consecutive pages of one layer land on consecutive device pages where the
            # free ones are, so the copy (and a later write-back) is a few strided runs (dma)
            dev_pages = ascending(np.asarray(ids, dtype=np.int64))
        if copy.any():
            src, dst = self.host_segs(layers[copy], pages[copy]), self.dev_segs(dev_pages[copy])
            try:
                self.engine.h2d(self.engine.index_tensor(src), self.engine.index_tensor(dst),
                                wait=(self.engine.fence(),), host_idx=(src, dst))
            except BaseException:  # a failed launch: the pages stay host-only, their device pages free
                self.allocator.free(dev_pages)
                raise
            self.h2d_bytes += int(src.size) * self.engine.segment_bytes
        self.map_np[layers, pages] = dev_pages.astype(np.int32)
        self.map_changed(pages)

    def place_identity(self, pages: np.ndarray, ids: np.ndarray | None = None) -> None:
        """Identity layout: give every layer of these distinct host-only pages (no KV yet) its
        fixed device page ``l * P + p``; nothing is copied."""
        if ids is None:
            ids = self.identity_ids(pages)
        self.allocator.take_distinct(ids.reshape(-1))  # type: ignore[union-attr]
        self.map_flat_np[ids] = ids
        self.map_changed(pages)

    def release_pages(self, pages: list[int] | np.ndarray) -> None:
        """SGLang's allocator got these pages back: free their device copies (KV is dead)."""
        if not len(pages):
            return
        p = np.asarray(pages, dtype=np.int64)
        sub = np.take(self.map_np, p, axis=1)
        layers, cols = np.nonzero(sub >= 0)
        if layers.size:
            dev_pages = sub[layers, cols].astype(np.int64)
            self.map_np[layers, p[cols]] = -1
            self.map_changed(p[cols])
            self.allocator.free(dev_pages)
        self.dirty_np[:, p] = False

    def _host_tier_for(self, what: str) -> None:
        """Refuse ``what`` (a copy to or from host pages) on a store without a host tier, before any change."""
        if not self.host_tier:
            raise RuntimeError(f"{what} needs host pages; this store has none (SlotStoreConfig.host_tier=False)")

    # ----- reads at rest (tests, move_kv_cache) ------------------------------------

    def _at_rest(self, layer: int, slots: torch.Tensor) -> tuple[np.ndarray, ...]:
        """Wait for copies in flight; slots, their pages and offsets, device page at ``layer``
        (-1: host only; without a host tier an unplaced page's own identity page) and whether it
        is on the device."""
        self.engine.quiesce()
        ps = self.config.page_size
        s = as_np(slots.cpu())
        pages, offs = s // ps, s % ps
        dev_page = self.map_np[layer, pages].astype(np.int64)
        if not self.host_tier:
            dev_page = np.where(dev_page >= 0, dev_page, layer * self.config.logical_pages + pages)
        return s, pages, offs, dev_page, dev_page >= 0

    def read_kv(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ``[n, H, D]`` of ``slots`` at ``layer``, from the device copy where resident and
        the host copy otherwise. Waits for in-flight copies: call between forwards only."""
        s, pages, offs, dev_page, on_dev = self._at_rest(layer, slots)
        ps, h, d = self.config.page_size, self.config.kv_heads, self.config.head_dim
        k = torch.empty((s.size, h, d), dtype=self.dev.dtype)
        v = torch.empty_like(k)
        if on_dev.any():
            rows = torch.from_numpy(dev_page[on_dev] * ps + offs[on_dev]).to(self.device)
            idx = torch.from_numpy(np.flatnonzero(on_dev))
            k[idx] = self._flat[0].index_select(0, rows).cpu()
            v[idx] = self._flat[1].index_select(0, rows).cpu()
        if (~on_dev).any():
            idx = torch.from_numpy(np.flatnonzero(~on_dev))
            hp, ho = torch.from_numpy(pages[~on_dev]), torch.from_numpy(offs[~on_dev])
            k[idx] = self.host[hp, layer, 0, ho]
            v[idx] = self.host[hp, layer, 1, ho]
        return k.to(self.device), v.to(self.device)

    def write_at_rest(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K/V of ``slots`` at ``layer`` between forwards: the device copy where resident
        (marked dirty), else the host home."""
        _, pages, offs, dev_page, on_dev = self._at_rest(layer, slots)
        ps = self.config.page_size
        if on_dev.any():
            rows = torch.from_numpy(dev_page[on_dev] * ps + offs[on_dev]).to(self.device)
            idx = torch.from_numpy(np.flatnonzero(on_dev)).to(k.device)
            self.write_rows(rows, k[idx], v[idx])
            placed = pages[self.map_np[layer, pages] >= 0]  # (a store without a host tier: unplaced ones too)
            self.mark_dirty(layer * self.config.logical_pages + distinct_sorted(placed))
        if (~on_dev).any():
            idx = torch.from_numpy(np.flatnonzero(~on_dev)).to(k.device)
            hp, ho = torch.from_numpy(pages[~on_dev]), torch.from_numpy(offs[~on_dev])
            self.host[hp, layer, 0, ho] = k[idx].cpu()
            self.host[hp, layer, 1, ho] = v[idx].cpu()
