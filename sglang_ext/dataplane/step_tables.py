"""StepTables: everything a forward needs from the layered store, built once per step on the host.

Built at the step boundary from the store's ``[L, P]`` map and the batch (each request's pages in
position order, sequence lengths, how many new tokens each writes), in NumPy, proportional to the
batch (``L x`` its pages), never to the pool:

- ``tab [L, n]``: device page of every (layer, batch page). Resident pages point at their device
  copy; host-only pages at the request's *staging slot* (OrbitFlow §3.3.1: one layer of the
  request's pages, ``b_r`` device pages, reserved by the caller inside the budget) -- or, in the
  identity layout, at the layer-page's own identity page, which nobody else may use.
- ``rows [L, m]``: device row of each new token at each layer (K rows of the flat K view; the
  same ids index the flat V view): where ``set_kv_buffer`` writes, resident or staged.
- fetch launches: per (trigger layer, target layer), the host-only layer-pages holding KV are
  copied into their staging pages. A request's first offloaded layer is fetched at step start
  (trigger -1); each later one when the request's previous offloaded layer has ended -- the
  placement model's timeline (``controlplane/model/timeline.py``). In the identity layout every
  staged page is distinct, so all fetches start at step start.
- write-back launches: per layer, the staged pages that receive new tokens go back to host after
  the layer (new KV of offloaded layers reaches host memory without a host sync).
- torch-native token tables (non-identity only): ``tok_col [B, W]``, ``tok_off [B, W]`` so that a
  layer's token rows are ``tab[l][tok_col] * page_size + tok_off`` (three device ops per layer).
- FlashInfer CSR: ``indptr [B+1]``, ``kv_lens [B]``, ``last_page_len [B]`` (same for every layer).

All integers go to the device in ONE non-blocking upload from pinned memory (an int64 buffer whose
tail packs the int32 tables two to a word); per-layer tensors are views of it. The pinned source
is a slot of the store's :class:`~sglang_ext.dataplane.pinned_upload_ring.PinnedUploadRing`
(no ``pin_memory()`` per step); the CSR's host views live in it for the step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from sglang_ext.dataplane.recompute_rows import RecomputeRows
from sglang_ext.dataplane.results import LayerView
from sglang_ext.dataplane.slot_kv_store import SlotKVStore
from sglang_ext.dataplane.sorted_ids import distinct_sorted
from sglang_ext.dataplane.staging_columns import staged_columns
from sglang_ext.dataplane.transfer_engine import TransferEngine

if TYPE_CHECKING:
    from sglang_ext.dataplane.token_writeback import TokenWriteback


@dataclass(frozen=True)
class Launch:
    """One batched copy of the step: ``2 * pages`` segments (K then V)."""

    trigger: int
    """Issued when this layer ends (-1: at step start)."""
    layer: int
    """Layer whose pages it moves."""
    offset: int
    """Start of its source indices in the int64 buffer (destination indices follow)."""
    segments: int
    """Segments moved (2 per layer-page)."""


LAZY_PACKED = ("_packed", "_int64_np", "_csr_at")
"""What :meth:`StepTables._pack` sets beside the host CSR (made at first read when ``lazy``)."""


def _write_csr(out: np.ndarray, counts: np.ndarray, seq_lens: np.ndarray, ps: int) -> tuple[np.ndarray, np.ndarray]:
    """The host CSR of ``b`` requests into ``out`` (int32, ``3b + 1``): ``indptr``, then ``kv_lens``
    and ``last_page_len``; returns ``(indptr, lens)`` views of it."""
    b = int(counts.size)
    out[0] = 0
    np.cumsum(counts, out=out[1: b + 1], dtype=np.int32)
    out[b + 1: 2 * b + 1] = seq_lens
    out[2 * b + 1:] = seq_lens - (counts - 1) * ps
    return out[: b + 1], out[b + 1:]


class StepTables:
    """The step's tables and launch plan (see module docstring)."""

    token_writeback: TokenWriteback | None = None
    """A paged decode step's parked new tokens and their one write-back (its
    :class:`~sglang_ext.dataplane.token_writeback.TokenWriteback`); None here: these tables write
    back staged pages per layer (:attr:`writebacks`)."""
    _rows_np: np.ndarray | None = None
    """A paged decode step's new-token rows on the host (``PagedStepTables``), what a CUDA graph's
    block is sent; None for other tables (a graph copies their device tables)."""
    pending = False
    """The device half is not made yet (``DeferredDevice``); these tables make theirs at once."""

    def __init__(self, store: SlotKVStore, pages: Sequence[np.ndarray], seq_lens: np.ndarray,
                 new_counts: np.ndarray, new_slots: np.ndarray | None,
                 stage: Callable[[int], np.ndarray | None], *, token_tables: bool = True,
                 recompute: np.ndarray | None = None, recompute_ids: list | None = None) -> None:
        """``stage(n)`` returns ``n`` reserved device pages (None: not enough room; the caller
        makes room and builds again). Raises ValueError when ``new_slots`` disagree with the
        batch's pages (a caller bug; nothing is reserved then). ``recompute[i] = (u, k)``: request
        ``i``'s first ``u`` pages are recomputed at layers ``< k`` (:class:`RecomputeRows`)."""
        c = store.config
        layers, ps = c.layers, c.page_size
        self.identity = store.identity
        self.staging_ids = np.zeros(0, dtype=np.int64)
        counts, flat, starts, col, off = self._columns(pages, seq_lens, new_counts, new_slots, ps)
        b, n, m = self.batch, int(flat.size), int(col.size)
        tab = np.take(store.map_np, flat, axis=1).astype(np.int64)
        host = tab < 0
        self.host_layer_pages = int(host.sum())
        req_of_col = np.repeat(np.arange(b), counts)
        prefix = RecomputeRows.mask(recompute, starts, req_of_col, layers) if recompute is not None and n else None
        pre, rec = (None, None) if prefix is None else prefix
        if rec is not None and self.identity:
            rec &= host  # a resident (shared) prefix page is read in place, never overwritten
        fetched = host if rec is None else host & ~rec  # host-only layer-pages this step fetches
        readers = None  # staged columns that read a page another column fetches (staging_columns.py)
        if self.identity:
            tab = np.where(host, store.identity_ids(flat), tab)
            trigger = np.full((layers, max(b, 1)), -1, dtype=np.int64)
        else:
            host_req = np.zeros((layers, b), dtype=bool)
            nonempty = counts > 0
            if n:
                host_req[:, nonempty] = np.logical_or.reduceat(fetched, starts[nonempty], axis=1)
            rank = None
            if pre is None or rec is None:
                need_cols = host_req.any(axis=0)[req_of_col]
                trans_cols = np.zeros(n, dtype=bool)
                # one staging page a distinct page (a recompute step stages per column)
                rank, owners, readers = staged_columns(flat, np.flatnonzero(need_cols), col)
                n_stage = int(owners.size)
            else:
                need_cols, trans_cols = RecomputeRows.slots(pre, rec, fetched, req_of_col, b)
                n_stage = int(need_cols.sum())
            want = n_stage + int(trans_cols.sum())
            if want:
                ids = stage(want)
                if ids is None:
                    self.staging_ids = None  # type: ignore[assignment]
                    return
                self.staging_ids = ids
                stage_col = np.full(n, -1, dtype=np.int64)
                stage_col[need_cols] = ids[:n_stage] if rank is None else ids[rank]
                tab = np.where(fetched, stage_col[None, :], tab)
                if rec is not None and trans_cols.any():
                    stage_col[trans_cols] = ids[n_stage:]  # transient: one layer of the prefix
                    tab = np.where(rec, stage_col[None, :], tab)
            last = np.maximum.accumulate(np.where(host_req, np.arange(layers)[:, None], -1), axis=0)
            trigger = np.vstack([np.full((1, b), -1, dtype=np.int64), last[:-1]])
        rows = tab[:, col] * ps + off[None, :]
        ucol = distinct_sorted(col)
        new_host = host[:, ucol]
        self.dirty_ids = (store.identity_ids(flat[ucol]))[~new_host]
        """Flat ids ``l * P + p`` of resident layer-pages that receive new tokens."""
        self.new_pages = flat[ucol]
        """Pages that receive new tokens (they hold KV after this step)."""
        # launches: fetch host-only pages that hold KV; write back staged pages that get tokens
        fetch = fetched & store.has_kv_np[flat][None, :]
        if readers is not None:  # a shared page is fetched by its owner column only
            fetch[:, readers] = False
        int64_parts: list[np.ndarray] = [rows.reshape(-1)]
        offset = rows.size
        self.recompute: RecomputeRows | None = None
        if rec is not None and recompute is not None and rec.any():
            dump = (store.identity_ids(np.zeros(1, dtype=np.int64)).reshape(-1) * ps if self.identity
                    else np.zeros(layers, dtype=np.int64))  # identity: page 0 (SGLang's padding page)
            self.recompute = RecomputeRows(recompute, rec, tab, starts, ps, dump, offset, recompute_ids)
            int64_parts += self.recompute.int64_parts
            offset += self.recompute.int64_size
        self.fetches: list[Launch] = []
        self.writebacks: list[Launch | None] = [None] * layers
        for layer in range(layers):
            cols = np.flatnonzero(fetch[layer])
            if cols.size:
                trig = trigger[layer, req_of_col[cols]]
                for t in np.unique(trig):
                    sel = cols[trig == t]
                    src = store.host_segs(np.full(sel.size, layer), flat[sel])
                    dst = store.dev_segs(tab[layer, sel])
                    int64_parts += [src, dst]
                    self.fetches.append(Launch(int(t), layer, offset, int(src.size)))
                    offset += 2 * src.size
            wcols = ucol[new_host[layer]]
            if wcols.size:
                src = store.dev_segs(tab[layer, wcols])
                dst = store.host_segs(np.full(wcols.size, layer), flat[wcols])
                int64_parts += [src, dst]
                self.writebacks[layer] = Launch(layer, layer, offset, int(src.size))
                offset += 2 * src.size
        self.fetch_layer_pages = sum(f.segments for f in self.fetches) // 2
        self.writeback_layer_pages = sum(w.segments for w in self.writebacks if w is not None) // 2
        offset = self._token_parts(token_tables and not self.identity, seq_lens, starts, ps, offset, int64_parts)
        self._upload(store, int64_parts, [tab.reshape(-1)], counts, seq_lens, ps)
        if self.recompute is not None:
            self.recompute.bind(self.i64)
        self.tab = self.i32[: layers * n].view(layers, n)
        """``[L, n]`` int32 device pages per layer (FlashInfer ``kv_indices`` rows)."""
        self.rows = self.i64[: layers * m].view(layers, m)
        """``[L, m]`` int64 device rows of the new tokens per layer."""
        self._bind_csr(layers * n, b)

    # ----- shared with PagedStepTables ---------------------------------------------------

    def _columns(self, pages: Sequence[np.ndarray], seq_lens: np.ndarray, new_counts: np.ndarray,
                 new_slots: np.ndarray | None, ps: int) -> tuple[np.ndarray, ...]:
        """The batch's columns: ``(counts, flat, starts, col, off)`` -- pages per request, every
        page, each request's first column, and the column and in-page offset of each new token
        (request ``r`` writes positions ``[len_r - e_r, len_r)``). Sets ``batch`` and ``pages``;
        raises ValueError when ``new_slots`` disagree with the pages."""
        counts = np.fromiter((p.size for p in pages), dtype=np.int64, count=len(pages))
        self.batch = b = int(counts.size)
        flat = np.concatenate(pages) if b else np.zeros(0, dtype=np.int64)
        self.pages = flat
        starts = np.cumsum(counts) - counts
        m = int(new_counts.sum())
        tok_req = np.repeat(np.arange(b), new_counts)
        pos = np.arange(m) - np.repeat(np.cumsum(new_counts) - new_counts, new_counts) + np.repeat(
            seq_lens - new_counts, new_counts)
        col = starts[tok_req] + pos // ps
        off = pos % ps
        if m and int(col.max()) >= flat.size:
            raise ValueError("new tokens fall past the batch's pages (seq_lens vs req_to_token)")
        if new_slots is not None and (new_slots.size != m or not np.array_equal(new_slots // ps, flat[col])):
            raise ValueError("new token slots do not match the batch's pages (positions vs req_to_token)")
        self._n, self._m = int(flat.size), m
        return counts, flat, starts, col, off

    def _token_parts(self, wanted: bool, seq_lens: np.ndarray, starts: np.ndarray, ps: int, offset: int,
                     int64_parts: list[np.ndarray]) -> int:
        """Append the torch-native token tables (``wanted`` and a non-empty batch); new offset."""
        b = self.batch
        width = int(seq_lens.max()) if b else 0
        self._tok_at = -1
        self._width = width
        if wanted and b:
            t = np.arange(width)
            valid = t[None, :] < seq_lens[:, None]
            tok_col = np.where(valid, starts[:, None] + t[None, :] // ps, 0)
            tok_off = np.where(valid, t[None, :] % ps, 0)
            self._tok_at = offset
            int64_parts += [tok_col.reshape(-1), tok_off.reshape(-1)]
            offset += 2 * b * width
        return offset

    def _upload(self, store: SlotKVStore, int64_parts: list[np.ndarray], int32_head: list[np.ndarray],
                counts: np.ndarray, seq_lens: np.ndarray, ps: int) -> None:
        """ONE upload: the int64 parts, then ``int32_head`` and the CSR (``indptr``, ``kv_lens``,
        ``last_page_len``) as int32 packed two to a word (viewed back on the device). Sets
        ``i64`` / ``i32`` (the CSR follows the head in ``i32``: :meth:`_bind_csr`)."""
        self._pack(int64_parts, int32_head, counts, seq_lens, ps)
        self._send_packed(store)

    def _pack(self, int64_parts: list[np.ndarray], int32_head: list[np.ndarray], counts: np.ndarray,
              seq_lens: np.ndarray, ps: int, lazy: bool = False) -> None:
        """:meth:`_upload`'s host half: the one buffer it sends (``_packed``), the int64 parts
        (``_int64_np``), the CSR on the host (``_csr_np``: ``indptr``, then ``kv_lens`` and
        ``last_page_len``) and where it starts in ``i32`` (``_csr_at``). ``lazy`` (a step whose
        device half is deferred, :class:`~sglang_ext.dataplane.deferred_device.DeferredDevice`):
        only the host CSR now; the buffer when first read (:meth:`__getattr__`: a replayed step
        never sends it, and its int64 parts alone are joined if a write-back reads them)."""
        b = int(counts.size)
        if lazy:
            self._csr_np = _write_csr(np.empty(3 * b + 1, dtype=np.int32), counts, seq_lens, ps)
            for name in LAZY_PACKED:  # a predecessor's (copied by an advance) are not this step's
                self.__dict__.pop(name, None)
            self._lazy_pack = (int64_parts, int32_head, counts, seq_lens, ps)
            return
        self._lazy_pack = None
        n64 = sum(int(p.size) for p in int64_parts)
        self._csr_at = at = sum(int(h.size) for h in int32_head)
        n32 = at + 3 * b + 1
        packed = np.empty(n64 + (n32 + 1) // 2, dtype=np.int64)  # written in place: no concatenation
        o = 0
        for part in int64_parts:
            packed[o: o + part.size] = part.reshape(-1)
            o += part.size
        int32 = packed[n64:].view(np.int32)
        o = 0
        for part in int32_head:
            int32[o: o + part.size] = part
            o += part.size
        self._csr_np = _write_csr(int32[at: n32], counts, seq_lens, ps)
        int32[n32:] = 0
        self._int64_np = packed[:n64]
        self._packed = packed

    def __getattr__(self, name: str) -> Any:
        """A lazily packed step's buffer (:meth:`_pack`) made at its first read: the int64 parts
        alone for ``_int64_np`` (a write-back's host indices), the whole buffer otherwise."""
        lazy = self.__dict__.get("_lazy_pack")
        if name in LAZY_PACKED and lazy is not None:
            if name == "_int64_np":
                parts = lazy[0]
                self._int64_np = parts[0].reshape(-1) if len(parts) == 1 else np.concatenate(
                    [p.reshape(-1) for p in parts])
            else:
                self._pack(*lazy)
            return self.__dict__[name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def _send_packed(self, store: SlotKVStore) -> None:
        """:meth:`_upload`'s device half: ``_packed`` in one upload; ``i64`` / ``i32`` its views."""
        both, host = store.uploads.upload(self._packed)
        n64 = self._int64_np.size
        self.i64 = both[:n64]
        self.i32 = both[n64:].view(torch.int32)
        self._i32_host = host[n64:].view(torch.int32)

    def _bind_csr(self, base: int, b: int) -> None:
        """FlashInfer's CSR views at ``i32[base:]``."""
        self.kv_indptr = self.i32[base: base + b + 1]
        self.kv_lens = self.i32[base + b + 1: base + 2 * b + 1]
        self.last_page_len = self.i32[base + 2 * b + 1: base + 3 * b + 1]
        self._lens_pair = self.i32[base + b + 1: base + 3 * b + 1]
        """``kv_lens`` then ``last_page_len`` (adjacent: a steady step advances both in one op)."""
        host = self._i32_host
        self.host_indptr = host[base: base + b + 1]
        """``kv_indptr`` on the host (the upload's pinned source on CUDA; never written again)."""
        self._host_lens_pair = host[base + b + 1: base + 3 * b + 1]
        self.host_last_page_len = self._host_lens_pair[b:]
        """``last_page_len`` on the host, like :attr:`host_indptr`."""

    def materialize(self) -> None:
        """Make the device half if it waits (``DeferredDevice``); these tables' is made."""

    @property
    def n_fetches(self) -> int:
        """Fetch launches of the step."""
        return len(self.fetches)

    @property
    def writes_back_pages(self) -> bool:
        """Some layer writes staged pages back (a launch in :attr:`writebacks`; a decode step's
        are all None: counted in C, no loop per layer)."""
        return self.writebacks.count(None) != len(self.writebacks)

    @property
    def has_token_tables(self) -> bool:
        """The torch-native token tables were built (:meth:`token_rows` reads them)."""
        return self._tok_at >= 0

    def plan_view(self, view: LayerView) -> LayerView:
        """``view`` with the CSR FlashInfer's plan reads on the host (``kv_indptr``,
        ``last_page_len``) as host tensors: planned from device ones, the plan would copy them
        back and the host would wait for the GPU (inside layer 0, where SGLang's decode plans)."""
        return dataclasses.replace(view, kv_indptr=self.host_indptr, last_page_len=self.host_last_page_len)

    @property
    def reserved(self) -> bool:
        """The staging pages were reserved (False: the caller must make room and rebuild)."""
        return self.staging_ids is not None

    def fetch(self, engine: TransferEngine, launch: Launch, wait: tuple) -> Any:
        """Issue fetch ``launch`` on ``engine`` after ``wait``; its event."""
        src, dst, host = self.launch_indices(launch)
        return engine.h2d(src, dst, wait=wait, host_idx=host)

    def launch_host_indices(self, launch: Launch) -> tuple[np.ndarray, np.ndarray]:
        """Source and destination segment indices of ``launch`` on the host (no device half read;
        a lazily packed step's from the int64 part holding them, when one does: nothing joined)."""
        o, s = launch.offset, launch.segments
        lazy = self.__dict__.get("_lazy_pack")
        if lazy is not None and "_int64_np" not in self.__dict__:
            start = 0
            for part in lazy[0]:
                if start <= o and o + 2 * s <= start + part.size:
                    flat, at = part.reshape(-1), o - start
                    return flat[at: at + s], flat[at + s: at + 2 * s]
                start += part.size
        return self._int64_np[o: o + s], self._int64_np[o + s: o + 2 * s]

    def launch_indices(self, launch: Launch) -> tuple[torch.Tensor, torch.Tensor, tuple[np.ndarray, np.ndarray]]:
        """Source and destination segment indices of ``launch`` (device views; and NumPy)."""
        o, s = launch.offset, launch.segments
        return self.i64[o: o + s], self.i64[o + s: o + 2 * s], self.launch_host_indices(launch)

    def token_rows(self, layer: int, page_size: int) -> torch.Tensor:
        """``[B, W]`` device rows of every token of the batch at ``layer`` (non-identity only)."""
        if self._tok_at < 0:
            raise RuntimeError("token tables were not built for this step")
        size = self.batch * self._width
        tok_col = self.i64[self._tok_at: self._tok_at + size].view(self.batch, self._width)
        tok_off = self.i64[self._tok_at + size: self._tok_at + 2 * size].view(self.batch, self._width)
        return self.tab[layer][tok_col] * page_size + tok_off

