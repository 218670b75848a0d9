"""LayerPipeline: runs one forward's transfers over :class:`StepTables`, overlapped with compute.

Per step (OrbitFlow §3.3.1; SuperInfer §4.3 DuplexKV):

- ``begin_step(tables)``: the compute and H2D streams wait for the copies of the boundary
  (one stream wait each); the fetches whose trigger is the step start are launched (one
  batched H2D per target layer) on the H2D stream -- or, with :attr:`LayerPipeline.defer_start`
  (staged steps may replay in a CUDA graph, which is decided after the boundary), at the
  forward's first layer call, so that a replayed step has launched nothing eagerly.
- ``begin_layer(l)``: the compute stream waits on the events of the launches that fetch layer
  ``l``, and on layer ``l - 1``'s page write-back if it had one (layer ``l`` writes its new
  tokens into the same staging pages; a page with no KV yet is not fetched to order that) --
  stream waits, never a host wait. This is the only kvplane work before the layer's
  KV write and attention, besides the table row the attention reads.
- ``end_layer(l)``: the staged pages that received new tokens at ``l`` go back to host (one
  batched D2H, after the layer's compute); then the fetches triggered by ``l`` (requests whose
  staging slot ``l`` just released) are launched, ordered after that write-back. A decode
  step's tables park their new tokens instead (:class:`TokenWriteback`): nothing goes back per
  layer, the fetches wait on nothing but the compute stream, and after the last layer with
  parked tokens ONE D2H writes their rows to the host pool.
- ``in_graph()`` (after the boundary, before the forward): the step's layers replay in a CUDA
  graph whose launches are the step's fetches and parked write-back
  (:class:`~sglang_ext.dataplane.graph_staging.GraphStaging`); the pipeline launches nothing,
  counts what the graph moves, and ends the step at the last layer as before.
- ``end_step()`` (after the last layer, or when the next step begins): a forward that ended
  before its last parked layer writes back the tokens parked at the layers it reached; the
  staging pages go back to the allocator; the next boundary's ``begin_step`` fences their reuse.

No call reads device memory from the host; the number of torch operations per layer does not
depend on the batch or the pool (``tests/dataplane/test_gpu_discipline.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sglang_ext.dataplane.slot_kv_store import SlotKVStore
from sglang_ext.dataplane.step_tables import StepTables


class LayerPipeline:
    """Per-layer fetch / write-back schedule of the current step."""

    def __init__(self, store: SlotKVStore, release_staging: Callable[[StepTables], None]) -> None:
        self.store = store
        self.engine = store.engine
        self._release = release_staging
        self.tables: StepTables | None = None
        self._events: list[list[Any]] = [[] for _ in range(store.config.layers)]
        self._evented = False
        """Some layer's list holds events (a step replayed in a graph adds none: nothing to clear)."""
        self._by_trigger: dict[int, list] | None = {}
        self._reached = -1
        """The last layer the current forward ended."""
        self._written_back: Any = None
        """The event of the page write-back launched at the end of the last layer (None: none)."""
        self._parked_out = False
        """The current forward's parked tokens were written back."""
        self._started = True
        """The step-start fetches were launched (or belong to a graph)."""
        self._graphed = False
        """The current step's transfers run inside a graph (:meth:`in_graph`)."""
        self.defer_start = False
        """Launch a decode step's step-start fetches at the forward's first layer call instead of
        at :meth:`begin_step` (other steps never replay): set where a CUDA graph may take a staged
        step's transfers after the boundary (:class:`~sglang_ext.dataplane.decode_graphs.DecodeGraphs` and the SGLang adapter
        with staging); off, the fetches also overlap the host work between boundary and layer 0."""
        self.graphed_steps = 0
        """Steps whose transfers ran inside a CUDA graph (:meth:`in_graph`)."""
        self.late_fences = 0
        """Graphed steps admitted with copies launched since the boundary's fence (waited for then)."""
        self.steps = 0
        self.fetched_layer_pages = 0
        """Layer-pages fetched into staging since construction."""
        self.layer_waits = 0
        """Layers whose compute waited on a fetch or the last layer's write-back (a test reads it)."""
        self.idle = False
        """The current step's layers launch and wait on nothing: no fetch, no page write-back, no
        parked token (an all-resident step). Then :meth:`begin_layer` and :meth:`end_layer` do
        nothing but the last layer's end of the step, and callers may skip them
        (:attr:`~sglang_ext.dataplane.layered_kv_core.LayeredKVCore.layers_idle`)."""

    @property
    def active(self) -> bool:
        """A step is running (begun, not ended)."""
        return self.tables is not None

    def begin_step(self, tables: StepTables) -> None:
        """Start a forward over ``tables`` (ends a forward that never reached its last layer)."""
        if self.tables is not None:
            self.end_step()
        self.tables = tables
        self.engine.wait_fence()
        self._clear_events()
        self._by_trigger = None  # grouped when a layer first asks (a step replayed in a graph never does)
        self._reached = -1
        self._parked_out = False
        self.idle = not tables.n_fetches and tables.token_writeback is None and not tables.writes_back_pages
        self._started = self._graphed = False
        self.steps += 1
        if not (self.defer_start and getattr(tables, "_one_each", False)):  # only a decode step may replay
            self._start()

    def _triggers(self) -> dict[int, list]:
        """The current step's fetch launches by trigger layer (-1: step start)."""
        if self._by_trigger is None:
            by_trigger: dict[int, list] = {}
            if self.tables is not None:
                for launch in self.tables.fetches:
                    by_trigger.setdefault(launch.trigger, []).append(launch)
            self._by_trigger = by_trigger
        return self._by_trigger

    def _start(self) -> None:
        """The step-start fetches (at the step's begin, or its first layer call: :attr:`defer_start`)."""
        if not self._started and self.tables is not None:
            self._started = True
            self._launch_fetches(-1, ())

    def in_graph(self) -> None:
        """The current step's layers replay in a CUDA graph holding its fetches and parked
        write-back (:class:`~sglang_ext.dataplane.graph_staging.GraphStaging`, loaded with these
        tables): nothing is launched here; the moved bytes are counted as the launches would."""
        tables = self.tables
        if tables is None or self._started and -1 in self._triggers():
            raise RuntimeError("LayerPipeline.in_graph: no step, or its fetches were launched eagerly already "
                               "(a graph that stages needs LayerPipeline.defer_start)")
        self._started = True
        if self.engine.fence_pending:
            # a copy launched after the boundary's fence (none is today): a graph's forks follow
            # the compute stream only, so the replay must wait for it here (session 86's review)
            self.engine.wait_fence()
            self.late_fences += 1
        self._graphed = bool(tables.n_fetches) or tables.token_writeback is not None
        self._by_trigger = {}
        self._count_fetched(tables.fetch_layer_pages)
        parked = tables.token_writeback
        if parked is not None:
            self._count_parked(parked.launch.segments)
            self._parked_out = True
        self.graphed_steps += 1

    def _count_fetch(self, launch: Any) -> None:
        self._count_fetched(launch.segments // 2)

    def _count_fetched(self, layer_pages: int) -> None:
        self.store.h2d_bytes += 2 * layer_pages * self.engine.segment_bytes
        self.fetched_layer_pages += layer_pages

    def _count_parked(self, rows: int) -> None:
        """``rows`` parked token rows written back to host."""
        nbytes = rows * self.store.host_row_bytes
        self.store.d2h_bytes += nbytes
        self.store.host_write_bytes += nbytes

    def _launch_fetches(self, trigger: int, wait: tuple) -> None:
        tables = self.tables
        assert tables is not None
        for launch in self._triggers().get(trigger, ()):
            event = tables.fetch(self.engine, launch, wait)
            self._events[launch.layer].append(event)
            self._evented = True
            self._count_fetch(launch)

    def begin_layer(self, layer: int) -> None:
        """The compute stream waits until layer ``layer``'s staged pages have arrived, and until
        the last layer's page write-back has read its staging pages: this layer writes its new
        tokens into the same pages (a request's staging slot serves every layer), and a page
        holding no KV yet (a prefill's chunk, the page a decode token opens) is written without
        a fetch to order it after the write-back."""
        self._start()
        events = self._events[layer]
        written_back, self._written_back = self._written_back, None
        if written_back is not None:
            events = [*events, written_back]
        if events:
            self.engine.stream_wait(events)
            self.layer_waits += 1

    def end_layer(self, layer: int) -> None:
        """Write back the layer's staged new tokens; launch the fetches this layer released."""
        tables = self.tables
        if tables is None:
            return
        self._start()
        wait: tuple = ()
        launch = tables.writebacks[layer]
        parked = tables.token_writeback
        if parked is not None and (parked.launch.layer != layer or self._parked_out):
            parked = None
        fetches = layer in self._triggers()
        if (launch is not None or parked is not None) and fetches:
            self.engine.mark_compute()  # the write-back and the fetches follow one compute event
        if launch is not None:
            src, dst, host = tables.launch_indices(launch)
            wait = (self.engine.d2h(src, dst, host_idx=host),)
            self._written_back = wait[0]
            nbytes = launch.segments * self.engine.segment_bytes
            self.store.d2h_bytes += nbytes
            self.store.host_write_bytes += nbytes
        self._reached = layer
        if parked is not None:  # the step's parked tokens: no fetch reads what this writes
            src, dst, host = tables.launch_indices(parked.launch)
            self._write_back_parked(parked, src, dst, host)
        if fetches:
            if launch is None and len(self._triggers()[layer]) > 1:
                self.engine.mark_compute()
            self._launch_fetches(layer, wait)
        self.engine.clear_compute_mark()
        if layer == self.store.config.layers - 1:
            self.end_step()

    def _write_back_parked(self, parked: Any, src: Any, dst: Any, host: tuple) -> None:
        self.engine.d2h_rows(parked.src_rows(), self.store.host_rows, src, dst, host_idx=host, keep=(parked.buf,))
        self._count_parked(int(host[0].size))
        self._parked_out = True

    def _write_back_reached(self, tables: StepTables) -> None:
        """A forward that ended before its last parked layer: write back the tokens parked at the
        layers it reached (as the per-layer page write-back had, layer by layer)."""
        parked = tables.token_writeback
        if parked is None or self._parked_out or self._reached < 0:
            return
        src, dst = parked.through(self._reached, *tables.launch_indices(parked.launch)[2])
        if src.size:
            self._write_back_parked(parked, self.engine.index_tensor(src), self.engine.index_tensor(dst), (src, dst))

    def end_step(self) -> None:
        """The forward is over: staging goes back (its reuse is fenced by the next step). The
        step is held until its copies are launched: a launch that raises (the parked tokens'
        write-back of a forward that stopped early, the graph's join) leaves it held, and the
        next ``end_step`` -- the next boundary's, or the next step's begin -- tries again (the
        parked tokens go once: ``_parked_out``). Forgotten first, it lost those tokens and
        never gave its staging back (data-plane review, session 77)."""
        tables = self.tables
        if tables is not None and self._graphed:  # the graph's copies, joined into the compute stream
            self.engine.after_graph()
            self._graphed = False
        elif tables is not None:
            self._write_back_reached(tables)
        self.tables = None
        self._started = True  # nothing to start until the next step begins
        self._written_back = None  # the next step's fence (or at-rest sync) orders it
        self.engine.end_compute()
        if tables is not None:
            self._clear_events()
            self._release(tables)

    def _clear_events(self) -> None:
        """Every layer's fetch events forgotten (none added since the last clear: nothing done)."""
        if self._evented:
            self._evented = False
            for events in self._events:
                events.clear()
