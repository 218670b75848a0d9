"""``LayeredDecodeGraph``: the layered decode under SGLang's decode graph runner (``--kv-cuda-graphs
on``; ``docs/cuda-graphs.md``, "The way there" steps 2-3).

SGLang 0.5.23's ``DecodeCudaGraphRunner`` captures the model's decode forward once per batch size at
start-up and, for every later decode step it can serve, fills its static inputs and replays: no
Python runs in the layers. A layered decode step reads per-step tables, so a replay may only serve
a step whose layers need no host work, and only through tables that stay put. The data plane has
both (SGLang-free): :class:`~sglang_ext.dataplane.graph_step_buffers.GraphStepBuffers` (persistent
tables, a sink page for padded rows) and its ``why_not`` (nothing staged, fetched, written back,
parked or recomputed). This class is the adapter's state between SGLang's hooks:

- **Capture** (``init_forward_metadata_out_graph(in_capture=True)``, before any request): the
  buffers hold a padding-only step of the captured size (:meth:`capture`); the forward then runs
  in graph mode (:attr:`forward`): each layer writes its new K/V through the buffers' rows
  (:meth:`write`, padded rows onto the sink) and attends over their page table (:meth:`view`).
- **Replay or eager** (the runner's ``can_run_graph``, wrapped by
  :mod:`sglang_ext.graph_runner_hooks`): kvplane's boundary runs first, as for every step, then
  :meth:`admit` loads the step's tables into the buffers, padded to the captured size SGLang will
  replay, or counts why the step runs eagerly (:attr:`eager_reasons`). The eager forward that
  follows reuses that boundary (:attr:`prepared`). Deciding after the boundary is exact: no
  prediction of what it will stage.
- **After a replay**: the step ends as an eager one does (the last layer's exit), run by the hook.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import structlog
import torch

from sglang_ext.dataplane.graph_step_buffers import GraphStepBuffers
from sglang_ext.dataplane.results import LayerView

log = structlog.get_logger(__name__)

SEQ_LEN_FILL = 1
"""``seq_len`` of SGLang's padded rows (``get_cuda_graph_seq_len_fill_value``): one token, the one
the buffers' padding puts on the sink page."""


class LayeredDecodeGraph:
    """Graph state of one layered attention backend over ``core`` (a ``LayeredKVCore`` whose store
    keeps a sink page), for batches of at most ``max_bs`` requests."""

    def __init__(self, core: Any, max_bs: int) -> None:
        store = core.store
        if store.sink_page is None:
            raise RuntimeError("kvplane: SGLang is capturing decode graphs but the layered pool keeps no sink page "
                               "for padded rows; launch with --kv-cuda-graphs on (or leave decode graphs off)")
        c = store.config
        self.core = core
        self.buffers = GraphStepBuffers(c.layers, max_bs, c.logical_pages + max_bs, store.device,
                                        store.sink_page, c.page_size)
        """The steps' tables where the captured kernels read them. A step listing more pages than
        the pool has logical pages (prefixes shared by many requests) runs eagerly."""
        self.forward = False
        """The forward running now reads the buffers (a capture's; a replay runs no Python)."""
        self.prepared: Any = None
        """The ``ForwardBatch`` whose boundary ran in ``can_run_graph``: its eager forward's
        ``init_forward_metadata`` reuses it instead of running a second boundary."""
        self.captured: list[int] = []
        self.replays = 0
        self.eager_reasons: Counter[str] = Counter()
        """Decode steps the runner could have replayed that ran eagerly, by reason."""

    def capture(self, rows: int) -> None:
        """A capture of ``rows`` rows starts: a padding-only step, every row on the sink."""
        self.buffers.load_padding(rows, self.core.store.identity)
        self.forward = True
        self.captured.append(rows)

    def admit(self, padded_to: int, slots: torch.Tensor) -> bool:
        """After the step's boundary: load its tables padded to ``padded_to`` rows (the size SGLang
        replays it at; ``slots``: its new tokens' slots, ``out_cache_loc``), or count why it runs
        eagerly and return False."""
        core = self.core
        tables = None if core.overflow else core.tables
        why = self.buffers.why_not(tables, padded_to)
        if why is not None:
            reason = why.split(";")[0]
            if not self.eager_reasons[reason]:  # once per reason: an operator sees why steps run eagerly
                log.info("layered_decode_graph_eager", reason=reason, replays_so_far=self.replays)
            self.eager_reasons[reason] += 1
            return False
        self.buffers.load(tables, padded_to=padded_to, slots=slots)
        self.forward = False
        return True

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """The new K/V ``[rows, H, D]`` (pool dtype) of every row at ``layer`` into the buffers' rows."""
        self.buffers.write(self.core.store, layer, k, v)

    def view(self, layer: int) -> LayerView:
        """Layer ``layer``'s page table and CSR, from the buffers."""
        return self.buffers.layer_view(self.core.store, layer, ())

    def stats(self) -> dict[str, Any]:
        """What the graphs served (for logs and tests)."""
        return {"captured": sorted(set(self.captured)), "replays": self.replays,
                "eager": dict(self.eager_reasons)}
