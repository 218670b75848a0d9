"""``LayeredGraphDecode``: SGLang's decode graph runner hooks (``--kv-cuda-graphs on``) shared by
the layered paged backends that serve it -- the Triton decode (``LayeredTritonDecode``) and
FlashInfer's (``LayeredFlashInferDecode``).

The hooks capture each layer's decode over
:class:`~sglang_ext.layered_decode_graph.LayeredDecodeGraph`'s persistent tables
(``docs/cuda-graphs.md``): at capture a padding-only step of the captured size; before each
replay the check that kvplane admitted the step (the runner's ``can_run_graph`` ran the boundary
and loaded the buffers: :mod:`sglang_ext.graph_runner_hooks`); in a capture's forward each
layer enters (its staged fetches), writes its new K/V through the buffers' rows, attends over
their page table (:meth:`graph_attention`, the subclass's kernel) and exits; after a replay the
step ends as an eager one does. A subclass whose kernel needs per-replay host work (FlashInfer's
plan) does it in ``init_forward_metadata_out_graph`` after this class's part.
"""

from __future__ import annotations

from typing import Any

import structlog
import torch

from sglang_ext.dataplane.results import LayerView
from sglang_ext.graph_tp_agreement import GraphTpAgreement
from sglang_ext.layered_attention import refuse_attention_kwargs
from sglang_ext.layered_decode_graph import LayeredDecodeGraph
from sglang_ext.layered_paged_decode import LayeredPagedDecode

log = structlog.get_logger(__name__)


class LayeredGraphDecode(LayeredPagedDecode):
    """A layered paged decode that SGLang's decode graph runner may capture (module docstring)."""

    graph: LayeredDecodeGraph | None = None
    """Decode graph state (SGLang's runner built it: ``--kv-cuda-graphs on``); None: eager only."""

    def graph_attention(self, q: torch.Tensor, layer: Any, index: int, view: LayerView) -> torch.Tensor:
        """Decode attention ``[B, Hq, D]`` of q ``[B, Hq, D]`` at this rank's layer ``index`` over
        the graph buffers' ``view``: launches only, nothing read on the host (it is captured)."""
        raise NotImplementedError

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        if self.paged_blocker is not None:  # the graph path has the kernel only (no torch fallback)
            raise RuntimeError(f"kvplane: --kv-cuda-graphs on: this model has {self.paged_blocker}, which the "
                               "layered graph decode does not compute; use --kv-cuda-graphs off")
        graph = self.graph
        if graph is not None and graph.buffers.max_batch == max_bs:  # SGLang captures every size again (a
            graph.recapture()  # weight update's recapture): the same buffers; the old graphs never replay again
            log.info("layered_decode_graphs_recapture", backend=type(self).__name__, max_bs=max_bs)
            return
        self.graph = LayeredDecodeGraph(self.pool.core, max_bs, GraphTpAgreement.for_process())
        log.info("layered_decode_graphs", backend=type(self).__name__, max_bs=max_bs,
                 max_pages=self.graph.buffers.max_pages)

    def init_forward_metadata_out_graph(self, forward_batch: Any, in_capture: bool = False) -> None:
        """At capture: a padding-only step of the captured size. Before a replay: the check that
        kvplane admitted the step -- the runner's ``can_run_graph`` ran the boundary and loaded
        the buffers (:mod:`sglang_ext.graph_runner_hooks`) -- and the layer timer handed the
        timing events the replayed graph records (``GraphLayerMarks``)."""
        graph = self.graph
        assert graph is not None
        if in_capture:
            graph.capture(int(forward_batch.batch_size))
        else:
            graph.replaying(int(forward_batch.batch_size))
            if self.layer_timer is not None:  # a sampled replay is timed by the events its graph records
                self.layer_timer.replayed(graph.layer_marks())

    def init_forward_metadata_in_graph(self, forward_batch: Any) -> None:
        """Nothing is recorded ahead of the layers: they read the buffers loaded outside the graph."""

    def init_forward_metadata(self, forward_batch: Any) -> None:
        graph = self.graph
        if graph is not None:
            graph.forward = graph.admitted = False
            if graph.declined(forward_batch):  # the runner's can_run_graph ran this step's boundary
                self.pool.core.rebind_step_loc(forward_batch.out_cache_loc)
                return
        super().init_forward_metadata(forward_batch)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):  # noqa: ANN001, ANN201
        graph = self.graph
        if graph is None or not graph.forward:
            return super().forward_decode(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
        if kwargs:
            refuse_attention_kwargs(kwargs, layer)
        index = layer.layer_id - self.pool.start_layer
        graph.enter(index)  # a staged step's fetches of this layer, waited for on the stream
        if save_kv_cache and k is not None and v is not None:  # every row, padded ones onto the sink
            graph.write(index, *self.pool.stored_kv(k, v, q.shape[0]))
        q3 = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim)
        out = self.graph_attention(q3, layer, index, graph.view(index))
        graph.exit(index)  # after the layer's last read of staging: the fetches it frees
        if out.dtype != q.dtype:
            out = out.to(q.dtype)
        return out.reshape(-1, layer.tp_q_head_num * layer.v_head_dim)

    def end_graph_step(self) -> None:
        """After a replay: the step ends as an eager one does (the last layer's exit)."""
        self.graph.replays += 1  # type: ignore[union-attr]
        self._end_layer(self._last_layer)
