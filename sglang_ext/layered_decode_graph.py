"""``LayeredDecodeGraph``: the layered decode under SGLang's decode graph runner (``--kv-cuda-graphs
on``; ``docs/cuda-graphs.md``, "What is served").

SGLang 0.5.23's ``DecodeCudaGraphRunner`` captures the model's decode forward once per batch size at
start-up and, for every later decode step it can serve, fills its static inputs and replays: no
Python runs in the layers. A layered decode step reads per-step tables, so a replay may only serve
a step through tables that stay put, and only a step whose per-layer host work the graph holds as
launches. The data plane has both (SGLang-free):
:class:`~sglang_ext.dataplane.graph_step_buffers.GraphStepBuffers` (persistent tables, a sink page
for padded rows) with, in the paged layout, :class:`~sglang_ext.dataplane.graph_staging.GraphStaging`
(a staged decode step's fetches and parked write-back as fixed launches over device lists), and
their ``why_not`` (no recompute, no per-layer page write-back, within capacity). This class is
the adapter's state between SGLang's hooks:

- **Capture** (``init_forward_metadata_out_graph(in_capture=True)``, before any request): the
  buffers hold a padding-only step of the captured size (:meth:`capture`); the forward then runs
  in graph mode (:attr:`forward`): each layer enters (:meth:`enter`: its staged fetches), writes
  its new K/V through the buffers' rows (:meth:`write`, padded rows onto the sink; parked for the
  write-back), attends over their page table (:meth:`view`) and exits (:meth:`exit`: the fetches
  it frees; after the last layer the parked rows' write-back).
- **Replay or eager** (the runner's ``can_run_graph``, wrapped by
  :mod:`sglang_ext.graph_runner_hooks`): kvplane's boundary runs first, as for every step, then
  :meth:`admit` loads the step's tables into the buffers, padded to the captured size SGLang will
  replay, or counts why the step runs eagerly (:attr:`eager_reasons`). The eager forward that
  follows gets SGLang's copy of the batch (its ``out_cache_loc`` another tensor of the same
  values): :meth:`declined` recognises it by its requests and lengths, and the backend skips a
  second boundary, only pointing the core's step at the copy's slots. Deciding after the boundary
  is exact: no prediction of what it will stage. A recompute step is declined before its boundary
  (its rows join the batch's inputs there, ahead of SGLang's copy).
- **TP** (``--tp-size > 1``): each rank admits its own shard's step; their answers are reduced
  (:class:`~sglang_ext.graph_tp_agreement.GraphTpAgreement`) before anything loads, so either
  every rank replays or every rank runs the step eagerly.
- **Before a replay** (``init_forward_metadata_out_graph``): :meth:`replaying` checks that this
  step was admitted -- a replay kvplane did not admit would read the last step's tables.
- **After a replay**: the step ends as an eager one does (the last layer's exit), run by the hook.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import TYPE_CHECKING, Any

import structlog
import torch

from sglang_ext.dataplane.graph_staging import GraphStaging
from sglang_ext.dataplane.graph_step_buffers import GraphStepBuffers
from sglang_ext.dataplane.results import LayerView

if TYPE_CHECKING:
    from sglang_ext.graph_tp_agreement import GraphTpAgreement

log = structlog.get_logger(__name__)

SEQ_LEN_FILL = 1
"""``seq_len`` of SGLang's padded rows (``get_cuda_graph_seq_len_fill_value``): one token, the one
the buffers' padding puts on the sink page."""


class LayeredDecodeGraph:
    """Graph state of one layered attention backend over ``core`` (a ``LayeredKVCore`` whose store
    keeps a sink page), for batches of at most ``max_bs`` requests."""

    def __init__(self, core: Any, max_bs: int, agreement: GraphTpAgreement | None = None) -> None:
        store = core.store
        if store.sink_page is None:
            raise RuntimeError("kvplane: SGLang is capturing decode graphs but the layered pool keeps no sink page "
                               "for padded rows; launch with --kv-cuda-graphs on (or leave decode graphs off)")
        c = store.config
        self.core = core
        staging, why = GraphStaging.for_core(core, max_bs, c.logical_pages + max_bs)
        if staging is None and store.mirror is not None:
            log.info("layered_decode_graph_staging_off", why=why)
        self.buffers = GraphStepBuffers(c.layers, max_bs, c.logical_pages + max_bs, store.device,
                                        store.sink_page, c.page_size, staging, store.mirror)
        """The steps' tables where the captured kernels read them. A step listing more pages than
        the pool has logical pages (prefixes shared by many requests) runs eagerly."""
        self.forward = False
        """The forward running now reads the buffers (a capture's; a replay runs no Python)."""
        self.admitted = False
        """This step's tables are in the buffers (set by :meth:`admit`, taken by :meth:`replaying`)."""
        self._declined: tuple | None = None
        """``(rids, seq_lens)`` of the step whose boundary ran in ``can_run_graph`` and which runs eagerly."""
        self.agreement = agreement
        """With ``--tp-size > 1``: every TP rank replays a step or none does (after the boundary)."""
        self.replays = 0
        self.eager_reasons: Counter[str] = Counter()
        """Decode steps the runner could have replayed that ran eagerly, by reason."""

    def recapture(self) -> None:
        """SGLang captures every size again over these buffers (its runner rebuilt after a weight
        update): the older graphs never replay again, so the timing events they recorded (the
        layers' and the staged copies') are forgotten (each size's new capture records its own),
        and no step is admitted."""
        self.buffers.recapture()
        self.admitted = self.forward = False
        self._declined = None

    def capture(self, rows: int) -> None:
        """A capture of ``rows`` rows starts: a padding-only step, every row on the sink."""
        self.buffers.load_padding(rows, self.core.store.identity)
        self.forward = True

    def admit(self, padded_to: int, slots: torch.Tensor, key: tuple, refuse: str | None = None) -> bool:
        """After the step's boundary: load its tables padded to ``padded_to`` rows (the size SGLang
        replays it at; ``slots``: its new tokens' slots, ``out_cache_loc``), or count why it runs
        eagerly, remember the step (``key``: :meth:`step_key`) and return False. ``refuse``: a
        reason this rank has to run it eagerly whatever the buffers say (under TP it still votes)."""
        core = self.core
        tables = None if core.overflow else core.tables
        why = refuse or self.buffers.why_not(tables, padded_to)
        self.forward = False
        if self.agreement is not None and not self.agreement.all_admit(why is None) and why is None:
            why = "another TP rank runs this step eagerly"
        if why is not None:
            self.decline(re.sub(r"\d+", "N", why.split(";")[0]), key)
            if tables is not None:  # the eager forward reads the device half: made now (if it waits)
                tables.materialize()
            return False
        self.buffers.load(tables, padded_to=padded_to, slots=slots)
        if core.pipeline.tables is not None:  # a staged step's copies are the graph's launches
            core.pipeline.in_graph()
        self.admitted = True
        return True

    def decline(self, reason: str, key: tuple) -> None:
        """The step runs eagerly (``reason``, counted; logged the first time); its boundary ran
        if ``key`` is set (the eager forward's metadata must not run it again)."""
        if not self.eager_reasons[reason]:  # once per reason: an operator sees why steps run eagerly
            log.info("layered_decode_graph_eager", reason=reason, replays_so_far=self.replays)
        self.eager_reasons[reason] += 1
        self._declined = key or None

    @staticmethod
    def step_key(forward_batch: Any) -> tuple:
        """What identifies a decode step across SGLang's copy of its batch: requests and lengths."""
        lens = forward_batch.seq_lens_cpu
        return tuple(forward_batch.rids or ()), None if lens is None else tuple(lens.tolist())

    def declined(self, forward_batch: Any) -> bool:
        """``forward_batch`` is (SGLang's eager copy of) the step declined after its boundary; taken once."""
        key, self._declined = self._declined, None
        return key is not None and key == self.step_key(forward_batch)

    def replaying(self, rows: int | None = None) -> None:
        """A replay is about to run: it must be of the step :meth:`admit` loaded, at the size it
        was loaded for (``rows``: the replayed graph's, when known)."""
        if not self.admitted:
            raise RuntimeError("kvplane: SGLang is replaying a decode graph for a step kvplane did not admit (its "
                               "tables are not in the graph buffers); --kv-cuda-graphs on serves only through "
                               "the layered paged backends' own hooks")
        if rows is not None and rows != self.buffers.batch:
            raise RuntimeError(f"kvplane: SGLang is replaying its decode graph of {rows} rows for a step kvplane "
                               f"loaded padded to {self.buffers.batch}")
        self.admitted = False
        self.forward = False  # a capture's flag ends here too (no decode reads the buffers unasked)

    def layer_marks(self) -> tuple[dict[int, Any], dict[int, Any]] | None:
        """The per-layer timing events the graph of the loaded size records (CUDA), or None."""
        marks = self.buffers.marks
        return None if marks is None else marks.of(self.buffers.batch)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """The new K/V ``[rows, H, D]`` (pool dtype) of every row at ``layer`` into the buffers' rows."""
        self.buffers.write(self.core.store, layer, k, v)

    def enter(self, layer: int) -> None:
        """Before layer ``layer``'s KV write (captured): its staged fetches start or are waited for."""
        self.buffers.enter(layer)

    def exit(self, layer: int) -> None:
        """After layer ``layer``'s attention (captured): the fetches it frees, or the write-back."""
        self.buffers.exit(layer)

    def view(self, layer: int) -> LayerView:
        """Layer ``layer``'s page table and CSR, from the buffers."""
        return self.buffers.layer_view(self.core.store, layer, ())
