"""GraphStepBuffers: a step's tables where a captured decode finds them, step after step.

A CUDA graph replays kernels at the addresses they had when captured. The data plane builds each
step's tables fresh (:class:`~sglang_ext.dataplane.step_tables.StepTables`: one upload, device
tensors of the step's size), so a decode captured over one step's tables would read that step's
forever. These buffers stay put: sized once for a batch and a page count, they take each step's
tables at the boundary (:meth:`load`: in the paged layout one copy of a
:class:`~sglang_ext.dataplane.step_block.StepBlock` filled from the tables' host arrays, the page
tables gathered in the graph from the map mirror, :meth:`gather_tables`; in the identity layout
five device copies), and what a layer reads -- its
new tokens' rows (:meth:`write`) and its page table and CSR (:meth:`layer_view`) -- are views of
them, the same views every step. The capacities bound what a captured graph serves: a batch of
``max_batch`` requests (exactly the captured one's: the views are sliced to it) over at most
``max_pages`` pages.

SGLang captures a graph per batch size and replays a batch on the smallest captured size that
holds it, padding the rest (``decode_cuda_graph_runner.py``). :meth:`load` with ``padded_to``
does the same to the tables: each padded row is one token on the store's sink page
(:attr:`~sglang_ext.dataplane.slot_kv_store.SlotKVStore.sink_page`, where no layer-page maps), so
the captured kernels write the padded rows' K/V there and read one row of it back -- never a
request's KV. The views are sized to the padded batch (the captured one's).

A graph holds kernels only: no host work runs in a replay. So the steps it may serve are those
whose layers need none: nothing staged, fetched, written back or parked, no recompute, no token
tables, and tables in the layout the graphs were captured in (:meth:`why_not`) -- the
all-resident step, which in the paged layout is the usual one until something is offloaded.
With ``staging`` (:class:`~sglang_ext.dataplane.graph_staging.GraphStaging`, the paged layout)
a staged decode step that parks its new tokens is served too: the layers' fetches and the
parked write-back are launches of the graph, their lists loaded with the tables; the layers
then call :meth:`enter` and :meth:`exit` around their work. In the paged layout every captured
layer must call :meth:`enter` (layer 0's gathers the page tables: a capture without it replays
a stale table), staged or not; ``exit`` does nothing without ``staging``. Other
staged steps run eagerly as before. SGLang's decode graph runner serves through these buffers
under ``--kv-cuda-graphs on``
(:mod:`sglang_ext.layered_decode_graph`); ``kvplane gpu-check``'s graph probe
(:mod:`sglang_ext.tools.gpu_check_graph`) captures and replays through them on a GPU.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch

from kernels.block_copy import triton_usable
from kernels.table_gather import gather_tables_ref, gather_tables_triton
from sglang_ext.dataplane.graph_layer_marks import GraphLayerMarks
from sglang_ext.dataplane.results import LayerView
from sglang_ext.dataplane.step_block import StepBlock

SPLIT_BYTES = 256 * 1024
"""The page-list region's unused tail above which a step's block goes in two copies, skipping it
(~5 us of PCIe at ~50 GB/s, about what a second copy's launch costs the host)."""


class GraphStepBuffers:
    """Persistent per-step tables for ``layers`` layers, ``max_batch`` requests, ``max_pages``
    pages per layer (module docstring)."""

    def __init__(self, layers: int, max_batch: int, max_pages: int, device: Any, sink_page: int | None = None,
                 page_size: int = 1, staging: Any = None, mirror: Any = None) -> None:
        self.layers, self.max_batch, self.max_pages = layers, max_batch, max_pages
        self.staging = staging
        """Staged steps' lists and launches (a :class:`~sglang_ext.dataplane.graph_staging.GraphStaging`
        sized as these buffers), or None: staged steps run eagerly."""
        self.sink_page = sink_page
        """Device page of the padded rows (the store's ``sink_page``); None: no padding."""
        self.page_size = page_size
        self.mirror = mirror if mirror is not None or staging is None else staging.store.mirror
        """The paged store's :class:`~sglang_ext.dataplane.map_mirror.MapMirror` (given, or the
        staging's store's): the step's inputs are sent as one block and the page tables gathered
        in the graph (:class:`~sglang_ext.dataplane.step_block.StepBlock`, :meth:`gather_tables`).
        None (the identity layout): the step's device tables are copied in (:meth:`load`)."""
        self.marks = GraphLayerMarks.for_device(layers, device)
        """Per-layer timing events the captured graphs record (:meth:`enter`; CUDA only, else None)."""
        self._ramp = torch.arange(1, max_batch + 1, dtype=torch.int32, device=device)
        self.tab = torch.zeros((layers, max_pages), dtype=torch.int32, device=device)
        """Page table per layer; past the loaded step's pages, stale entries nobody reads."""
        self.block: StepBlock | None = None
        if self.mirror is None:
            self.rows = torch.zeros((layers, max_batch), dtype=torch.int64, device=device)
            self.kv_indptr = torch.zeros(max_batch + 1, dtype=torch.int32, device=device)
            self.kv_lens = torch.zeros(max_batch, dtype=torch.int32, device=device)
            self.last_page_len = torch.zeros(max_batch, dtype=torch.int32, device=device)
        else:
            i32, i64 = torch.int32, torch.int64
            regions = [("rows", i64, (layers, max_batch)), *(staging.regions() if staging is not None else ()),
                       ("kv_indptr", i32, (max_batch + 1,)), ("kv_lens", i32, (max_batch,)),
                       ("last_page_len", i32, (max_batch,)), ("starts", i32, (max_batch,)),
                       ("counts", i32, (max_batch,)), ("flat", i32, (max_pages,)), ("stage", i32, (max_pages,))]
            self.block = StepBlock(regions, device)
            views = self.block.views
            self.rows, self.kv_indptr, self.kv_lens = views["rows"], views["kv_indptr"], views["kv_lens"]
            self.last_page_len, self.flat, self.stage = views["last_page_len"], views["flat"], views["stage"]
            """``flat``: the step's pages, a column each (-1: a padded row's); ``stage``: each column's
            staging entry (-1: none; a padded row's: the sink page)."""
            self.starts, self.counts = views["starts"], views["counts"]
            if staging is not None:
                staging.attach(views, self)
        """Device rows (of the flat pool) of each request's new token, per layer; CSR."""
        self.batch = 0
        """Rows of the loaded step, padding included (the views' size)."""
        self.real = 0
        """Requests of the loaded step (rows ``real:batch`` are padding)."""
        self.pages = 0
        """Pages per layer of the loaded step, the padded rows' included."""
        self.loads = 0
        self.in_place = False
        """The loaded step's rows are slot ids in each layer's in-place view (identity layout)."""
        self.captured_in_place: bool | None = None
        """The layout graphs were captured in (:meth:`mark_captured`), None before a capture: a
        graph captured writing by slot id within a layer would write a step's whole-pool rows
        into another layer's memory, and the other way round."""

    def why_not(self, tables: Any, padded_to: int | None = None) -> str | None:
        """Why the step of ``tables`` cannot be served from these buffers (padded to
        ``padded_to`` rows), or None."""
        if tables is None:
            return "no tables (an overflowing or in-place step)"
        staged = tables.staging_ids is None or bool(tables.staging_ids.size)
        copies = bool(tables.n_fetches or any(w is not None for w in tables.writebacks)
                      or tables.token_writeback is not None)
        if staged or copies:  # host work in the layers: served only as launches of the staging graph
            if self.staging is None or tables.staging_ids is None:
                return ("the step stages pages (fetches into staging need host work inside the layers)" if staged
                        else "the step copies between host and device inside its layers")
            why = self.staging.why_not(tables)
            if why is not None:
                return why
        if tables.recompute is not None or tables.has_token_tables:
            return "the step recomputes or reads token tables"
        if self.mirror is not None:
            if tables._rows_np is None:  # the block is filled from the tables' host arrays
                return "the step's tables are general ones (the paged graph gathers a paged decode step's)"
            if self.mirror.pending or self.mirror.syncs != tables._mirror_syncs:
                return "the map moved since the step's tables were built (the graph gathers the tables from it)"
        in_place = tables._rows_np is None and tables.rows is None  # a paged step's: never
        if self.captured_in_place is not None and in_place != self.captured_in_place:
            # the identity layout builds general tables (rows of the whole pool) while a live
            # request is paused or partly on host
            return ("the step's tables are not in the layout the graphs were captured in; captured "
                    f"{'in place (slot ids)' if self.captured_in_place else 'over whole-pool rows'}")
        b, n = self.step_shape(tables)
        bs = b if padded_to is None else padded_to
        if bs < b:
            return f"the step has {b} requests, more than the {bs} rows it would be padded to"
        if bs > b and self.sink_page is None:
            return "padding needs a sink page (SlotStoreConfig.graph_sink)"
        if bs > self.max_batch or n + bs - b > self.max_pages:
            padding = f" padded to {bs} rows" if bs > b else ""
            return (f"the step has {b} requests{padding} over {n + bs - b} pages; the buffers hold {self.max_batch} "
                    f"over {self.max_pages}")
        return None

    def load(self, tables: Any, padded_to: int | None = None, slots: torch.Tensor | None = None,
             checked: bool = False) -> None:
        """The step's tables into the buffers, padded to ``padded_to`` rows (default: none): the
        block's one copy (paged), or five device copies and five fills more with padding (``ValueError`` with :meth:`why_not`'s
        reason where the step cannot be served from them). Tables without rows (the identity
        layout's, whose layers write in place by slot id) need the step's new ``slots``: they
        become every layer's rows, read in the layer's in-place view (:meth:`write`). ``checked``:
        the caller's :meth:`why_not` of these tables and ``padded_to`` was None just now."""
        why = None if checked else self.why_not(tables, padded_to)
        if why is not None:
            raise ValueError(f"GraphStepBuffers.load: {why}")
        b, n = self.step_shape(tables)
        bs = b if padded_to is None else padded_to
        if self.block is not None:
            self._send(tables, b, n, bs)
            self.loads += 1
            return
        self.in_place = tables.rows is None
        if self.in_place:
            if slots is None or slots.numel() != b:
                raise ValueError("GraphStepBuffers.load: in-place tables need the step's new slots, one a request")
            self.rows[:, :b].copy_(slots.to(self.rows.device, torch.int64, non_blocking=True).expand(self.layers, b))
        else:
            self.rows[:, :b].copy_(tables.rows, non_blocking=True)
        self.tab[:, :n].copy_(tables.tab, non_blocking=True)
        self.kv_indptr[: b + 1].copy_(tables.kv_indptr, non_blocking=True)
        self.kv_lens[:b].copy_(tables.kv_lens, non_blocking=True)
        self.last_page_len[:b].copy_(tables.last_page_len, non_blocking=True)
        if bs > b:  # one token each on the sink page: written there, read back from there
            pad, sink = bs - b, int(self.sink_page)  # type: ignore[arg-type]
            self.rows[:, b:bs].fill_(sink * self.page_size)
            self.tab[:, n: n + pad].fill_(sink)
            torch.add(self._ramp[:pad], n, out=self.kv_indptr[b + 1: bs + 1])
            self.kv_lens[b:bs].fill_(1)
            self.last_page_len[b:bs].fill_(1)
        self.batch, self.real, self.pages = bs, b, n + bs - b
        self.loads += 1

    @staticmethod
    def step_shape(tables: Any) -> tuple[int, int]:
        """Requests and page columns of ``tables`` (a paged decode step's from its host half)."""
        if tables._rows_np is not None:
            return int(tables.batch), int(tables.pages.size)
        return int(tables.kv_lens.numel()), int(tables.tab.shape[1])

    def _send(self, tables: Any, b: int, n: int, bs: int) -> None:
        """A paged decode step into the block (:attr:`mirror` set): its host arrays written into
        the block's next host twin, padded to ``bs`` rows, and sent in one copy; the page tables
        are gathered in the graph (:meth:`gather_tables`)."""
        block = self.block
        assert block is not None
        h = block.host()
        pad, ps = bs - b, self.page_size
        rows = h["rows"]
        rows[:, :b] = tables._rows_np
        indptr, lens = tables._csr_np  # the host CSR (its device half may never be made)
        h["kv_indptr"][: b + 1] = indptr
        h["kv_lens"][:b] = lens[:b]
        h["last_page_len"][:b] = lens[b:]
        h["starts"][:b] = tables._starts_np
        h["counts"][:b] = tables._counts_np
        h["flat"][:n] = tables.pages
        staged = tables._stage_np is not None and tables.staging_ids.size
        h["stage"][:n] = tables._stage_np if staged else -1
        if pad:  # one token each on the sink page: its column's page -1, its staging entry the sink
            sink = int(self.sink_page)  # type: ignore[arg-type]
            rows[:, b:bs] = sink * ps
            h["flat"][n: n + pad] = -1
            h["stage"][n: n + pad] = sink
            h["kv_indptr"][b + 1: bs + 1] = n + np.arange(1, pad + 1)
            h["kv_lens"][b:bs] = 1
            h["last_page_len"][b:bs] = 1
        self.batch, self.real, self.pages, self.in_place = bs, b, n + pad, False
        if self.staging is not None:
            self.staging.load(tables, bs, h)
        used, stage = block.end("flat", n + pad), block.start("stage")
        if stage - used > SPLIT_BYTES:  # flat's unused tail: two copies, not the tail (session 86)
            block.send(used, also=(stage, block.end("stage", n + pad)))
        else:
            block.send(block.end("stage", n + pad))

    def gather_tables(self) -> None:
        """The loaded step's page tables, gathered from the map mirror into :attr:`tab` (the
        paged block's mode; first thing in a captured step: :meth:`enter` at layer 0). One
        Triton launch bounded by the step's columns on CUDA (``kv_indptr[batch]``), torch ops over
        the buffers' width elsewhere (:mod:`kernels.table_gather`)."""
        mirror = self.mirror
        if mirror is None:
            return
        if triton_usable(self.tab):
            gather_tables_triton(mirror.dev, self.flat, self.stage, self.tab,
                                 self.kv_indptr[self.batch: self.batch + 1])
        else:
            gather_tables_ref(mirror.dev, self.flat, self.stage, self.tab)

    def recapture(self) -> None:
        """Every size is about to be captured again over these buffers (SGLang's recapture after
        a weight update; the older graphs never replay): the timing events the older graphs
        recorded -- the layers' and the staging's copies' -- are forgotten."""
        for marks in (self.marks, None if self.staging is None else self.staging.copy_marks):
            if marks is not None:
                marks.recapture()

    def load_padding(self, rows: int, in_place: bool) -> None:
        """A step of ``rows`` padded rows and no request (``in_place``: the identity layout's
        rows): what a graph is captured over before any request exists (SGLang captures at
        start-up) -- every row one token on the sink page, so the capture's warm-ups and the
        captured run touch nothing but the sink."""
        if self.sink_page is None:
            raise ValueError("GraphStepBuffers.load_padding: padding needs a sink page (SlotStoreConfig.graph_sink)")
        if not 0 < rows <= min(self.max_batch, self.max_pages):
            raise ValueError(f"GraphStepBuffers.load_padding: {rows} rows; the buffers hold {self.max_batch} over "
                             f"{self.max_pages} pages")
        sink = self.sink_page
        self.rows[:, :rows].fill_(sink * self.page_size)
        self.tab[:, :rows].fill_(sink)
        if self.block is not None:  # the gather's inputs: every column a padded row's
            self.flat[:rows].fill_(-1)
            self.stage[:rows].fill_(sink)
        self.kv_indptr[0] = 0
        self.kv_indptr[1: rows + 1].copy_(self._ramp[:rows])
        self.kv_lens[:rows].fill_(1)
        self.last_page_len[:rows].fill_(1)
        self.batch, self.real, self.pages, self.in_place = rows, 0, rows, in_place
        if self.staging is not None:
            self.staging.clear()
        self.mark_captured()
        self.loads += 1

    def mark_captured(self) -> None:
        """Graphs are captured over the loaded step (a padding-only one, or a real one): a later
        step is served from these buffers only in its layout (:meth:`why_not`)."""
        self.captured_in_place = self.in_place

    def write(self, store: Any, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """The step's new K/V ``[batch, H, D]`` (padded rows included) at ``layer`` into their
        device rows (the store's one-launch writer or two ``index_copy_``), as the core's
        ``write`` does from the tables."""
        rows = self.rows[layer, : self.batch]
        if self.in_place:  # slot ids in the layer's own view (padded rows: SGLang's padding slot 0)
            store.write_into(*store.layer_in_place(layer), rows, k, v)
        else:
            store.write_rows(rows, k, v)
        if self.staging is not None:  # kept for the parked write-back (what a host-only layer-page gets)
            self.staging.park(layer, self.batch, k, v)

    def enter(self, layer: int) -> None:
        """Before layer ``layer``'s KV write (captured): with :attr:`staging`, the step's fetches
        start (layer 0) and the layer waits for its own; a capture records the layer's timing
        events around that wait (:attr:`marks`)."""
        if layer == 0:
            self.gather_tables()
        marks = self.marks
        if marks is not None:
            marks.mark(layer, self.batch)
        if self.staging is not None:
            if layer == 0:
                self.staging.begin_step(self.batch)
            self.staging.begin_layer(layer)
        if marks is not None:
            marks.ready(layer, self.batch)

    def exit(self, layer: int) -> None:
        """After layer ``layer``'s attention (captured): with :attr:`staging`, the next layer's
        triggered fetches, or after the last the parked write-back; else nothing."""
        if self.staging is not None:
            self.staging.end_layer(layer, self.batch)

    def layer_view(self, store: Any, layer: int, rids: tuple[str, ...]) -> LayerView:
        """Layer ``layer`` as paged kernels take it, from the buffers (the page table's full row:
        the kernels read only what ``kv_indptr`` spans)."""
        b = self.batch
        return LayerView(layer=layer, k_cache=store.dev[0], v_cache=store.dev[1],
                         kv_indptr=self.kv_indptr[: b + 1], kv_indices=self.tab[layer],
                         kv_lens=self.kv_lens[:b], last_page_len=self.last_page_len[:b], rids=rids)

    def plan_view(self, tables: Any, view: LayerView) -> LayerView:
        """``view`` with the host CSR a FlashInfer plan reads (``tables.plan_view``'s), padded as
        :meth:`load` padded the device one: the plan's batch is the view's."""
        pad = self.batch - self.real
        csr = getattr(tables, "_csr_np", None)
        if self.block is not None and csr is not None:  # the host half's CSR: a replayed step's device half is never made
            b = self.real
            planned = dataclasses.replace(view, kv_indptr=torch.from_numpy(csr[0]),
                                          last_page_len=torch.from_numpy(csr[1][b:]))
        else:
            planned = tables.plan_view(view)
        if not pad:
            return planned
        indptr, last = planned.kv_indptr, planned.last_page_len
        n = self.pages - pad
        return dataclasses.replace(
            planned, kv_indptr=torch.cat([indptr, torch.arange(n + 1, n + pad + 1, dtype=indptr.dtype)]),
            last_page_len=torch.cat([last, torch.ones(pad, dtype=last.dtype)]))
