"""DecodeGraphs: a decode step's CUDA graphs by batch size, over one set of step buffers.

What SGLang's decode graph runner asks of an attention backend, on the core, SGLang-free
(``docs/cuda-graphs.md``, "What SGLang 0.5.23 requires"):

- **Capture at start-up, before any request**, one graph per batch size, largest first. The
  buffers then hold a step of padded rows only (:meth:`GraphStepBuffers.load_padding`: every row
  one token on the store's sink page), so the capture's warm-ups and the captured run touch
  nothing a request owns.
- **Before each decode forward, decide: replay or eager.** kvplane's boundary runs first (the
  core's ``prepare_decode_step``, as every step's); then :meth:`DecodeGraphs.admit` picks the
  smallest captured size that holds the batch and asks the buffers whether the step can be
  served from them (:meth:`GraphStepBuffers.why_not`: nothing staged, fetched, written back or
  parked -- or, with ``staged=True``, a staged step whose fetches and parked write-back the
  graph's launches take (:class:`GraphStaging`); within their capacity). If so it loads them, padded to that size (SGLang pads the
  batch's inputs the same way), and the graph of that size replays; if not, the step runs
  eagerly on its own tables and the reason is counted (:attr:`DecodeGraphs.eager_reasons`).
  Deciding after the boundary is exact: no prediction of what the boundary will stage.
- Graph objects come from a factory (``torch.cuda.CUDAGraph`` behind
  :class:`~sglang_ext.tools.gpu_check_graph.CudaGraph` on a GPU; the tests'
  :class:`~sglang_ext.testing.tape_graph.TapeGraph` on the CPU): this class keeps which size
  replays, not how a graph is made.

The SGLang adapter (``--kv-cuda-graphs on``: ``sglang_ext/layered_decode_graph.py``,
``sglang_ext/graph_runner_hooks.py``) lets SGLang's runner own the capture loop and the graphs, so it
uses :class:`GraphStepBuffers` and the same admission directly; this class is what ``kvplane
gpu-check`` and the core's tests drive, as that runner would.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from sglang_ext.dataplane.graph_staging import GraphStaging
from sglang_ext.dataplane.graph_step_buffers import GraphStepBuffers


class DecodeGraphs:
    """Graphs of a decode step's layers, one per batch size in ``sizes``, over the step buffers of
    ``core`` (whose store must keep a sink page: ``SlotStoreConfig(graph_sink=True)``);
    ``max_pages``: the most pages a step served from the buffers may list per layer (padding
    included); ``staged``: staged decode steps are replayed too (their fetches and parked
    write-back captured: :class:`~sglang_ext.dataplane.graph_staging.GraphStaging`; the paged
    layout only; the layers call the buffers' ``enter`` / ``exit``, which in the paged layout they
    must in any case: layer 0's ``enter`` gathers the page tables). In the paged layout the core's
    ``defer_tables`` is set for good: its decode steps' tables get their device half at a declined
    admission, or at an eager reader's first read (gpu-check's eager steps over the same core)."""

    def __init__(self, core: Any, sizes: Sequence[int], max_pages: int, staged: bool = False) -> None:
        store = core.store
        if store.sink_page is None:
            raise ValueError("DecodeGraphs needs a store with a sink page (SlotStoreConfig(graph_sink=True))")
        if not sizes or any(int(n) < 1 for n in sizes):
            raise ValueError(f"DecodeGraphs: batch sizes must be ints >= 1, got {list(sizes)}")
        self.core = core
        self.sizes = tuple(sorted({int(n) for n in sizes}))
        staging = GraphStaging.for_core(core, self.sizes[-1], max_pages)[0] if staged else None
        self.buffers = GraphStepBuffers(store.config.layers, self.sizes[-1], max_pages, store.device,
                                        store.sink_page, store.config.page_size, staging, store.mirror)
        if self.buffers.block is not None:  # steps the graphs take never need their tables' device half
            core.defer_tables = True
        self.graphs: dict[int, tuple[Any, Any]] = {}
        """Captured size -> (graph, its static outputs)."""
        self.replays = 0
        self.eager_reasons: Counter[str] = Counter()
        """Steps admitted eagerly, by reason."""

    def capture(self, layers: Callable[[int], Any], graph: Callable[[], Any],
                prepare: Callable[[int], None] | None = None) -> None:
        """One graph per size, largest first (as SGLang captures): ``layers(bs)`` runs the step's
        layers over the buffers' views at ``bs`` rows and returns their outputs; ``graph()`` makes
        a graph object (``capture(fn)`` -> static outputs, ``replay()``); ``prepare(bs)`` runs
        after the padding-only step is loaded, before the capture (an attention's plan: SGLang's
        ``init_forward_metadata_out_graph(in_capture=True)``)."""
        for bs in reversed(self.sizes):
            self.buffers.load_padding(bs, self.core.store.identity)
            if prepare is not None:
                prepare(bs)
            g = graph()
            static = g.capture(lambda bs=bs: layers(bs))
            self.graphs[bs] = (g, static)

    def size_for(self, batch: int) -> int | None:
        """The smallest captured size that holds ``batch`` requests, or None."""
        return next((n for n in self.sizes if n >= batch), None)

    def admit(self, slots: Any = None) -> int | None:
        """After the step's boundary: the captured size to replay it at (the buffers loaded,
        padded to it), or None -- the step runs eagerly on its own tables (the reason counted).
        ``slots``: the step's new slots (the identity layout's tables write in place by them)."""
        tables = None if self.core.overflow else self.core.tables
        if tables is None:  # served at rest: the buffers' reason
            self.eager_reasons[str(self.buffers.why_not(None))] += 1
            return None
        b = self.buffers.step_shape(tables)[0]
        size = self.size_for(b)
        why = f"no graph holds a batch of {b}" if size is None or size not in self.graphs else None
        why = why or self.buffers.why_not(tables, size)
        if why is not None:
            self.eager_reasons[why.split(";")[0]] += 1
            tables.materialize()  # the eager forward reads the device half: made here (if it waits)
            return None
        self.buffers.load(tables, padded_to=size, slots=slots, checked=True)
        if self.core.pipeline.tables is not None:  # the graph moves what the pipeline would have
            self.core.pipeline.in_graph()
        return size

    def replay(self, size: int) -> Any:
        """Replay the graph of ``size`` (admitted): its static outputs."""
        graph, static = self.graphs[size]
        graph.replay()
        self.replays += 1
        return static
