"""GraphStaging: a staged decode step's fetches and parked write-back, in a form a CUDA graph replays.

An eager staged step (:class:`~sglang_ext.dataplane.layer_pipeline.LayerPipeline`) decides on the
host, layer by layer, which fetch launches to issue and which events to wait for: a request's first
host-only layer is fetched at step start, each later one when its previous one has ended, and
after the last layer with parked new tokens one D2H writes them to the host pool
(:class:`~sglang_ext.dataplane.token_writeback.TokenWriteback`). Those host calls -- Triton
launches, event records and waits, index views -- are most of kvplane's host time on a GPU
(``benchmarks/results/gpu/session67-h200-runs.md``: 0.64-0.70 of the all-resident step, where
the target is 0.05), and a graph holds kernels only.

So the launches take a fixed shape, the same every step, and the step's choices travel as data:

- **Fetch lists.** Per target layer ``t`` two lists of the batch's request rows: ``start[t]``,
  the requests whose first host-only layer this step is ``t`` (fetched at step start), and
  ``trig[t]``, those host-only at ``t`` and at an earlier layer (fetched once layer ``t - 1`` has
  ended; the eager pipeline may start such a fetch earlier, after the request's previous host-only
  layer, when the request skips layers -- the graph waits a little longer there, never less).
  Each list's length and its widest request's page count are two int32 on the device
  (``listed``); the fetch kernel reads them (:func:`kernels.block_copy.fetch_pages_triton`'s
  ``listed``), so an empty list launches and copies nothing.
- **The batch's page lists** (pages, staging entries, first columns, page counts: what every
  fetch reads) in fixed buffers sized for ``max_pages`` columns and ``max_batch`` requests.
- **Parked tokens.** Every layer parks every row's new K/V into ``park [L, 2, max_batch, H, D]``
  (one launch a layer with the store's row writer, else two copies, unconditionally: a graph cannot
  skip the layers that park nothing);
  after the last layer one counted copy (:func:`kernels.block_copy.copy_segments_triton`'s
  ``count``) writes the step's host-only ones to their rows of the host pool.

Captured order (:meth:`begin_step`, :meth:`begin_layer`, :meth:`park`, :meth:`end_layer`; on
CUDA the fetches on the engine's H2D stream and the write-back on its D2H stream, joined back
after the last layer's attention -- before its MLP, so the write-back is on the step's critical
path: ``docs/cuda-graphs.md``):

- before layer 0, the ``L`` start launches, an event after each;
- before layer ``t``: the compute stream waits for ``start[t]``'s event and, for ``t > 0``,
  ``trig[t]``'s;
- after layer ``t``'s attention (the last reader of the staging pages at ``t``): the H2D stream
  waits for the compute stream, launches ``trig[t + 1]``, records its event;
- after the last layer: the write-back, then the joins.

Why this is safe is the eager pipeline's argument (:mod:`~sglang_ext.dataplane.staging_columns`):
a staging page is read only at the layers where its page is host-only and its owner request is
staged at each of them; ``trig[t]`` overwrites it only after layer ``t - 1`` ended, and a start
fetch writes a page no earlier layer of the step reads. A step that is not staged loads empty
lists and an empty write-back, so one graph serves both.

What :meth:`load` takes: :class:`~sglang_ext.dataplane.paged_step_tables.PagedStepTables` of a
decode step that parks (one token per request; no per-layer page write-back, no recompute, no
token tables: :meth:`why_not`). It regroups the tables' launches on the host (``O(L + fetched
requests)``) into the host twin of the graph buffers' block, which the buffers send in their one
copy (:class:`~sglang_ext.dataplane.step_block.StepBlock`: the page lists are the buffers' regions,
the lists and write-back rows these, bound by :meth:`GraphStaging.attach`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kernels.block_copy import copy_segments_triton, fetch_pages_triton, triton_usable
from sglang_ext.dataplane.graph_layer_marks import GraphLayerMarks

START, TRIG = 0, 1
"""Rows of :attr:`GraphStaging.lists`: fetched at step start, fetched after the layer before."""


class GraphStaging:
    """Fixed buffers and captured launches of staged decode steps over ``store`` (a paged
    :class:`~sglang_ext.dataplane.slot_kv_store.SlotKVStore`), for ``max_batch`` requests over
    ``max_pages`` page columns (module docstring)."""

    def __init__(self, store: Any, max_batch: int, max_pages: int) -> None:
        if store.mirror is None:
            raise ValueError("GraphStaging needs the paged layout (the store has no map mirror)")
        c = store.config
        self.store, self.layers, self.max_batch, self.max_pages = store, c.layers, max_batch, max_pages
        dev = store.device
        lists = 2 * c.layers * max_batch
        self._zero_from = lists
        self._ctl_size = lists + 2 * c.layers * 2 + 2
        """``lists``, ``listed``, the write-back's count (and one word of padding), one region."""
        self._pairs = 2 * c.layers * max_batch
        self.flat = self.stage = self.starts = self.counts = self._ctl = self.wb_src = self.wb_dst = None  # type: ignore[assignment]
        """Views of the graph buffers' block, bound by :meth:`attach`: the batch's page lists (pages,
        staging entries, first columns, page counts), the fetch lists' region, the write-back's rows."""
        self.park_buf = torch.zeros((c.layers, 2, max_batch, c.kv_heads, c.head_dim), dtype=c.dtype, device=dev)
        self._park_rows = self.park_buf.view(-1, c.kv_heads * c.head_dim)
        self._park_ids = torch.arange(max_batch, device=dev)
        """Rows ``0..max_batch-1`` the park writes to: the staging's own, for the graph's lifetime
        (the store's ``row_ids`` replaces its tensor when a bigger eager step asks: a captured
        park reading it would read freed memory; graph review, session 69)."""
        self.copy_marks = GraphLayerMarks.for_device(2, dev)
        """Timing events a capture records around the start lists' launches (slot 0, on the H2D
        stream) and the write-back (slot 1, D2H), by captured size: booked with the engine's clock
        at each admission (:meth:`load`), so replayed steps keep feeding the link's bandwidth
        samples (CUDA only, else None)."""
        self.loaded_pairs = 0
        """(layer, request) pairs the loaded step writes back."""
        self.loaded_fetches = 0
        """Fetch launches of the loaded step's eager tables (regrouped into the lists)."""
        self._programs: int | None = getattr(store.engine, "copy_programs", None)
        """Persistent programs of each copy launch (the engine's, ``--kv-copy-programs``)."""
        self._streams = getattr(store.engine, "h2d_stream", None) is not None
        """The engine copies on side streams (CUDA): the fetches and the write-back fork to them."""
        self._events: list[Any] = []
        if self._streams:
            self._events = [torch.cuda.Event() for _ in range(2 * c.layers)]

    def regions(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        """The block regions these lists need besides the buffers' own (``staging_ctl``: fetch
        lists, their lengths and widest pages, the write-back's count; the write-back's rows)."""
        return [("wb_src", torch.int64, (self._pairs,)), ("wb_dst", torch.int64, (self._pairs,)),
                ("staging_ctl", torch.int32, (self._ctl_size,))]

    def attach(self, views: dict[str, torch.Tensor], buffers: Any) -> None:
        """Bind the block's views (:class:`~sglang_ext.dataplane.graph_step_buffers.GraphStepBuffers`
        made it with :meth:`regions`; the page lists are the buffers')."""
        layers, cap, lists = self.layers, self.max_batch, self._zero_from
        self.flat, self.stage, self.starts, self.counts = buffers.flat, buffers.stage, buffers.starts, buffers.counts
        self.wb_src, self.wb_dst, self._ctl = views["wb_src"], views["wb_dst"], views["staging_ctl"]
        self.lists = self._ctl[:lists].view(2, layers, cap)
        self.listed = self._ctl[lists: lists + 4 * layers].view(2, layers, 2)
        self.wb_count = self._ctl[lists + 4 * layers: lists + 4 * layers + 1]

    @classmethod
    def for_core(cls, core: Any, max_batch: int, max_pages: int) -> tuple[GraphStaging | None, str | None]:
        """Staging for graphs over ``core``'s store, with the core's pipeline told to hold a decode
        step's step-start fetches for the graph (``LayerPipeline.defer_start``); or None and why
        (the identity layout, or a park buffer past the parked write-back's limit,
        ``PARK_MAX_BYTES``: staged steps then run eagerly)."""
        from sglang_ext.dataplane.paged_step_tables import PARK_MAX_BYTES

        store = core.store
        if store.mirror is None:
            return None, "the identity layout stages nothing"
        if getattr(store.engine, "_kernel_impl", "triton") != "triton":
            return None, ("the copy engine cannot run Triton kernels on the host pool (its copies fell back to "
                          "memcpy); staged decode steps run eagerly")
        park = cls.park_bytes(store.config, max_batch)
        if park > PARK_MAX_BYTES:
            return None, (f"the park buffer for every layer's new tokens at {max_batch} rows ({park} bytes) would "
                          f"pass the parked write-back's limit ({PARK_MAX_BYTES}); staged decode steps run eagerly")
        core.pipeline.defer_start = True  # a replay launches a staged step's fetches itself
        return cls(store, max_batch, max_pages), None

    @staticmethod
    def park_bytes(config: Any, max_batch: int) -> int:
        """Device bytes of the park buffer for ``max_batch`` rows (every layer's K and V rows)."""
        itemsize = torch.empty(0, dtype=config.dtype).element_size()
        return config.layers * 2 * max_batch * config.kv_heads * config.head_dim * itemsize

    # ----- at the boundary (host) -----------------------------------------------------

    @staticmethod
    def why_not(tables: Any) -> str | None:
        """Why a staged step of ``tables`` cannot be replayed through these buffers, or None."""
        from sglang_ext.dataplane.paged_step_tables import PagedStepTables

        if not isinstance(tables, PagedStepTables):
            return "the step stages through general tables (recompute or the identity layout)"
        if tables.writes_back_pages:
            return "the step writes staged pages back per layer (a multi-token step, or too many parked tokens)"
        if not tables._one_each:
            return "the step writes more than one token per request"
        return None

    def clear(self) -> None:
        """An unstaged step: every list empty, nothing written back (one device fill)."""
        self._ctl[self._zero_from:].zero_()
        self.loaded_pairs = self.loaded_fetches = 0

    def load(self, tables: Any, size: int, host: dict[str, np.ndarray]) -> None:
        """The staged step of ``tables`` (:meth:`why_not` None; its page count within the
        buffers) into ``host``, the block's host twin the buffers send next (its page lists are
        the buffers' part): its fetch launches regrouped by target layer into start and trigger
        lists, its parked tokens' write-back rows. A step that stages nothing: empty lists."""
        ctl = host["staging_ctl"]
        ctl[self._zero_from:] = 0
        if tables.staging_ids is None or not tables.staging_ids.size:
            self.loaded_pairs = self.loaded_fetches = 0
            self._book(size, 0, 0)  # the replay stamps the graph's copy events all the same
            return
        layers, cap = self.layers, self.max_batch
        n, b = tables._n, tables._b
        if n > self.max_pages or b > cap:
            raise ValueError(f"GraphStaging.load: {b} requests over {n} pages; the buffers hold {cap} over "
                             f"{self.max_pages}")
        lists = ctl[: self._zero_from].reshape(2, layers, cap)
        listed = ctl[self._zero_from: self._zero_from + 4 * layers].reshape(2, layers, 2)
        launches = tables.page_launches
        launches.regroup(tables._reqs_np, lists, listed)  # rows START and TRIG
        start_segments = launches.start_segments
        parked = tables.token_writeback
        if parked is not None:
            src, dst = tables.launch_host_indices(parked.launch)
            host["wb_src"][: src.size] = self._park_sources(parked, src)
            host["wb_dst"][: dst.size] = dst
            ctl[self._zero_from + 4 * layers] = src.size
        self.loaded_pairs = 0 if parked is None else parked.pairs
        self.loaded_fetches = len(launches)
        self._book(size, start_segments, 0 if parked is None else parked.launch.segments)

    def _book(self, size: int, start_segments: int, parked_rows: int) -> None:
        """The graph of ``size`` rows times its start lists and its write-back (:attr:`copy_marks`):
        booked with the engine's clock for the step being admitted, with the bytes they move --
        the start-list launches' ``start_segments`` and ``parked_rows`` (what the pipeline counts)."""
        marks = self.copy_marks.of(size) if self.copy_marks is not None else None
        engine = self.store.engine
        book = getattr(engine.clock, "book", None)
        if marks is None or book is None:
            return
        moved = (("h2d", 0, start_segments * engine.segment_bytes), ("d2h", 1, parked_rows * self.store.host_row_bytes))
        for kind, slot, nbytes in moved:  # every replay: an earlier booking it would stamp is dropped
            book(kind, (marks[0][slot], marks[1][slot]), nbytes)

    def _park_sources(self, parked: Any, src: np.ndarray) -> np.ndarray:
        """The write-back's source rows (``src``: rows of the tables' compact park buffer, K then
        V) as rows of :attr:`park_buf`: slot ``s`` of the compact buffer is the ``s``-th parked
        layer, its token ``j`` row ``j`` of the step."""
        key = ("graph_park_sources", self.max_batch)
        rows = parked.memo.get(key)  # the sources depend on the slots alone: kept for steps planned alike
        if rows is None:
            m = parked.tokens
            used = np.flatnonzero(np.asarray(parked.slots) >= 0)
            slot, rest = np.divmod(src, 2 * m)
            kv, j = np.divmod(rest, m)
            rows = parked.memo[key] = (used[slot] * 2 + kv) * self.max_batch + j
        return rows

    # ----- captured (inside the layers) ------------------------------------------------

    def _fetch(self, kind: int, layer: int) -> None:
        store = self.store
        engine = store.engine
        fetch_pages_triton(engine.host, engine.dev, self.flat, self.stage, store.mirror.rows[layer],
                           self.lists[kind, layer], self.starts, self.counts, self.max_pages, 2 * layer,
                           2 * self.layers, store.pages_total, self._programs, listed=self.listed[kind, layer])

    def begin_step(self, size: int = 0) -> None:
        """Before layer 0 of a step of ``size`` rows: every start list's launch (on the H2D
        stream, with side streams), timed by :attr:`copy_marks` in a capture."""
        store = self.store
        if not triton_usable(store.engine.dev):
            raise RuntimeError("GraphStaging: the graph's copies are Triton launches (CUDA, or TRITON_INTERPRET=1)")
        marks = self.copy_marks

        def starts() -> None:
            if marks is not None:
                marks.mark(0, size)
            for layer in range(self.layers):
                self._fetch(START, layer)
                if self._streams:
                    self._events[layer].record(store.engine.h2d_stream)
            if marks is not None:
                marks.ready(0, size)

        if self._streams:
            self._on(store.engine.h2d_stream, starts)
        else:
            starts()

    def begin_layer(self, layer: int) -> None:
        """Before layer ``layer``'s KV write: the compute stream waits for its fetches."""
        if not self._streams:
            return
        current = torch.cuda.current_stream(self.store.device)
        current.wait_event(self._events[layer])
        if layer:
            current.wait_event(self._events[self.layers + layer])

    def park(self, layer: int, rows: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Layer ``layer``'s new K/V of the step's ``rows`` rows into :attr:`park_buf` (the
        store's one-launch writer, or two copies)."""
        writer = self.store.row_writer
        if writer is None:
            self.park_buf[layer, 0, :rows].copy_(k)
            self.park_buf[layer, 1, :rows].copy_(v)
            return
        writer(self.park_buf[layer, 0], self.park_buf[layer, 1], self._park_ids[:rows], k, v)

    def end_layer(self, layer: int, size: int = 0) -> None:
        """After layer ``layer``'s attention: the next layer's trigger list (after this layer's
        compute); after the last, the parked rows' write-back (timed by :attr:`copy_marks` in a
        capture of ``size`` rows) and the joins."""
        engine = self.store.engine
        last = layer == self.layers - 1
        if not self._streams:
            if last:
                self._write_back(size)
            else:
                self._fetch(TRIG, layer + 1)
            return
        if last:
            self._on(engine.d2h_stream, lambda: self._write_back(size))
            current = torch.cuda.current_stream(self.store.device)
            for side in (engine.d2h_stream, engine.h2d_stream):  # a capture ends with its forks joined
                current.wait_event(side.record_event())
            return

        def trig() -> None:
            self._fetch(TRIG, layer + 1)
            self._events[self.layers + layer + 1].record(engine.h2d_stream)

        self._on(engine.h2d_stream, trig)

    def _on(self, stream: Any, launch: Any) -> None:
        """``launch()`` on ``stream`` after the compute stream's work so far (a fork in a capture)."""
        current = torch.cuda.current_stream(self.store.device)
        stream.wait_event(current.record_event())
        torch.cuda.set_stream(stream)
        try:
            launch()
        finally:
            torch.cuda.set_stream(current)

    def _write_back(self, size: int) -> None:
        marks = self.copy_marks
        if marks is not None:
            marks.mark(1, size)
        copy_segments_triton(self._park_rows, self.store.host_rows, self.wb_src, self.wb_dst, self._programs,
                             count=self.wb_count)
        if marks is not None:
            marks.ready(1, size)
