"""``LayeredTritonDecode``: replaces SGLang's ``triton`` attention backend under
``--enable-layered-kv``: decode through kvplane's Triton paged-decode kernel
(:func:`kernels.paged_decode.paged_decode`) over the step's per-layer page tables; extend
through the paged-extend kernel over the same tables (``LayeredPagedDecode``).

The kernel runs natively on CUDA and under the Triton interpreter (``TRITON_INTERPRET=1``) on
CPU, which is how CI serves real SGLang requests through the same kernel code a GPU runs
(``tests/sglang/test_triton_server.py``). On CPU without the interpreter the kernel's torch
reference (the same paged-table decode) runs instead. Soft cap and sliding window come from the
layer (``logit_cap``, ``sliding_window_size``).

With ``--kv-cuda-graphs on`` it also serves SGLang's decode graph runner: the graph hooks below
capture the decode over :class:`~sglang_ext.layered_decode_graph.LayeredDecodeGraph`'s persistent
tables (``docs/cuda-graphs.md``).
"""

from __future__ import annotations

from typing import Any

import structlog
import torch

from kernels.block_copy import triton_usable
from kernels.paged_decode import head_blocks, kv_splits, paged_decode, sm_count
from sglang_ext.dataplane.layer_cap_window import layer_cap_window
from sglang_ext.graph_tp_agreement import GraphTpAgreement
from sglang_ext.layered_attention import refuse_attention_kwargs
from sglang_ext.layered_decode_graph import LayeredDecodeGraph
from sglang_ext.layered_paged_decode import LayeredPagedDecode

log = structlog.get_logger(__name__)


class LayeredTritonDecode(LayeredPagedDecode):
    """Triton paged decode over the layered tables."""

    def __init__(self, model_runner: Any) -> None:
        super().__init__(model_runner)
        self.decode_layers = 0
        """Layer decodes served through the paged kernel (per process)."""
        self.graph: LayeredDecodeGraph | None = None
        """Decode graph state (SGLang's runner built it: ``--kv-cuda-graphs on``); None: eager only."""
        device = torch.device(self.device)
        self.sms = sm_count(device) if device.type == "cuda" else None
        """The GPU's SMs (the split count fills them), read once; None off CUDA (one split)."""
        self._splits: tuple[tuple[int, int, int], int] = ((-1, -1, -1), 1)
        """((batch, table width, q heads), split count) of the last eager decode step: every layer
        of a step launches with the same count, worked out at its first layer."""

    def step_splits(self, q: torch.Tensor, width: int, cache_shape: torch.Size) -> int:
        """The eager decode's split count for a step of query ``q`` over tables ``width`` pages
        wide and caches of ``cache_shape`` (:func:`kernels.paged_decode.kv_splits`, counting
        stage 1's head blocks), once per step shape."""
        key, splits = self._splits
        batch, q_heads = q.shape[0], q.shape[1]
        if key != (batch, width, q_heads):
            splits = 1  # off CUDA (where a head_dim over the kernels' is served by the torch reference)
            if self.sms is not None:
                _, page_size, kv_heads, head_dim = cache_shape
                blocks = head_blocks(q_heads // kv_heads, head_dim)
                splits = kv_splits(batch, kv_heads, self.sms, width, page_size, blocks)
            self._splits = ((batch, width, q_heads), splits)
        return splits

    def decode_layer(self, q: torch.Tensor, layer: Any, index: int) -> torch.Tensor:
        tables, store = self.pool.tables, self.pool.store
        if not self.decode_layers:
            log.info("layered_triton_decode_active",
                     impl="triton" if triton_usable(q, store.dev[0]) else "torch-reference")
        self.decode_layers += 1
        cap, window = layer_cap_window(layer)
        return paged_decode(
            q, store.dev[0], store.dev[1], tables.kv_indptr, tables.tab[index], tables.kv_lens,
            sm_scale=getattr(layer, "scaling", None), logits_soft_cap=cap, window_left=window,
            num_kv_splits=self.step_splits(q, tables.tab.shape[1], store.dev[0].shape),
        )

    # ----- SGLang's decode graph runner (--kv-cuda-graphs on) -----------------------------

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        if self.paged_blocker is not None:  # the graph path has the kernel only (no torch fallback)
            raise RuntimeError(f"kvplane: --kv-cuda-graphs on: this model has {self.paged_blocker}, which the "
                               "layered graph decode does not compute; use --kv-cuda-graphs off")
        self.graph = LayeredDecodeGraph(self.pool.core, max_bs, GraphTpAgreement.for_process())
        log.info("layered_decode_graphs", max_bs=max_bs, max_pages=self.graph.buffers.max_pages)

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
            graph.replaying()
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
        index, store = layer.layer_id - self.pool.start_layer, self.pool.store
        graph.enter(index)  # a staged step's fetches of this layer, waited for on the stream
        if save_kv_cache and k is not None and v is not None:  # every row, padded ones onto the sink
            graph.write(index, *self.pool.stored_kv(k, v, q.shape[0]))
        q3 = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim)
        view = graph.view(index)
        cap, window = layer_cap_window(layer)
        # no split count: paged_decode's default, bounded by the buffers' full row width, is the
        # one a captured size serves every context length with; an eager step bounds it by its own
        # tables (step_splits), so on a GPU a replay and an eager step sum in different orders
        out = paged_decode(q3, store.dev[0], store.dev[1], view.kv_indptr, view.kv_indices, view.kv_lens,
                           sm_scale=getattr(layer, "scaling", None), logits_soft_cap=cap, window_left=window)
        graph.exit(index)  # after the layer's last read of staging: the fetches it frees
        if out.dtype != q.dtype:
            out = out.to(q.dtype)
        return out.reshape(-1, layer.tp_q_head_num * layer.v_head_dim)

    def end_graph_step(self) -> None:
        """After a replay: the step ends as an eager one does (the last layer's exit)."""
        self.graph.replays += 1  # type: ignore[union-attr]
        self._end_layer(self._last_layer)
