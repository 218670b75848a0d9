"""``LayeredFlashInferDecode``: the layered GPU serving backend (replaces SGLang's ``flashinfer``
under ``--enable-layered-kv``): decode through FlashInfer over the step's per-layer page tables,
extend through kvplane's Triton paged-extend kernel over the same tables (``LayeredPagedDecode``).

One FlashInfer plan per step and per distinct layer parameters (soft cap, sliding window:
:class:`~sglang_ext.dataplane.flashinfer_attention.AttentionParams`), on FlashInfer's eager
(dynamic) wrappers, one per parameter set, as SGLang's own backend builds them (its ``fa2``
decode, its tensor-core choice); per layer the page ids are row ``l`` of the step's one
``[L, n]`` table. Staging is always reserved (the pool makes room), so there is no fallback path.

With ``--kv-cuda-graphs on`` it also serves SGLang's decode graph runner
(:class:`~sglang_ext.layered_graph_decode.LayeredGraphDecode`'s hooks) on FlashInfer's CUDA-graph
wrappers, one per captured batch size and parameter set, kept for the process
(``FlashInferLayeredDecode.keep_graphs``): each is planned outside the graph -- at its capture
from the padding-only step, before each replay from the admitted step's host CSR
(``GraphStepBuffers.plan_view``; ``FlashInferLayeredDecode.plan_graph`` stages it in pinned
memory: a plan copies it to the device, and a pageable source would make that copy wait for the
stream), as SGLang's own FlashInfer backend
plans before a replay -- and a captured layer's run reads its page ids from the graph buffers' row
(no copy launch; the plan is handed no page ids). FlashInfer's decode kernel reads the lengths from
the wrapper's ``indptr`` and ``last_page_len`` buffers, which each plan rewrites (its int
workspace holds the plan's split schedule, fixed per batch size in CUDA-graph mode), so a replay
not planned for its own step reads the last plan's (``tests/sglang/test_graph_server.py``'s control).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from sglang_ext import compat
from sglang_ext.dataplane.flashinfer_attention import (
    HAVE_FLASHINFER,
    AttentionParams,
    FlashInferLayeredDecode,
)
from sglang_ext.dataplane.results import LayerView
from sglang_ext.layered_attention import attention_layers
from sglang_ext.layered_graph_decode import LayeredGraphDecode


class LayeredFlashInferDecode(LayeredGraphDecode):
    """FlashInfer paged decode over the layered tables (CUDA; ``wrapper_class``: a stand-in of
    FlashInfer's decode wrapper, the tests' on the CPU)."""

    def __init__(self, model_runner: Any, wrapper_class: Any = None) -> None:
        super().__init__(model_runner)
        if wrapper_class is None and (not HAVE_FLASHINFER or self.pool.store.device.type != "cuda"):
            raise RuntimeError("LayeredFlashInferDecode needs CUDA and an importable flashinfer")
        # FlashInfer's kernel for the model's heads as SGLang's own backend picks it
        self.flashinfer = FlashInferLayeredDecode(self.pool.store.device, self.pool.store.config.logical_pages,
                                                  tensor_cores=compat.should_use_tensor_core,
                                                  wrapper_class=wrapper_class)
        self._params: dict[tuple[int, torch.dtype], AttentionParams] = {}
        """Each layer's attention parameters (fixed by the model), made once, not once a step."""
        self._model, self._dtype = model_runner.model, model_runner.dtype
        self._graph_params: dict[int, AttentionParams] = {}
        """Under decode graphs: each of this rank's layers' parameters (the model's dtype), by index."""

    def new_step(self) -> None:
        self.flashinfer.new_step()

    def decode_layer(self, q: torch.Tensor, layer: Any, index: int) -> torch.Tensor:
        tables, store = self.pool.tables, self.pool.store
        view = LayerView(
            layer=index, k_cache=store.dev[0], v_cache=store.dev[1], kv_indptr=tables.kv_indptr,
            kv_indices=tables.tab[index], kv_lens=tables.kv_lens, last_page_len=tables.last_page_len,
            rids=(),
        )
        key = (layer.layer_id, q.dtype)
        params = self._params.get(key)
        if params is None:  # soft cap, window
            params = self._params[key] = AttentionParams.of_layer(layer, layer.tp_q_head_num, q.dtype)
        if not self.flashinfer.planned(params):  # from the host CSR: no wait for the GPU here
            self.flashinfer.plan(tables.plan_view(view), layer.tp_q_head_num, params=params)
        return self.flashinfer.run(q, view, params)

    # ----- SGLang's decode graph runner (--kv-cuda-graphs on) -----------------------------

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """The graph state (again at SGLang's recapture: the wrappers kept, ``keep_graphs``), and
        each of this rank's layers' attention parameters, read from the model."""
        super().init_cuda_graph_state(max_bs, max_num_tokens)
        assert self.graph is not None
        self.flashinfer.keep_graphs(self.graph.buffers.max_pages)
        start, layers = self.pool.start_layer, self.pool.store.config.layers
        params: dict[int, AttentionParams] = {}
        for module in attention_layers(self._model):  # plans happen before the layers run
            index = int(module.layer_id) - start
            if index in params:
                raise RuntimeError(f"kvplane: --kv-cuda-graphs on: two attention modules of layer {module.layer_id}; "
                                   "the layered FlashInfer graph decode plans one per layer")
            if 0 <= index < layers:
                params[index] = AttentionParams.of_layer(module, module.tp_q_head_num, self._dtype)
        if len(params) != layers:
            raise RuntimeError(f"kvplane: --kv-cuda-graphs on: found {len(params)} attention layers "
                               f"of this rank's {layers} to plan FlashInfer's graph decode for")
        self._graph_params = params

    def init_forward_metadata_out_graph(self, forward_batch: Any, in_capture: bool = False) -> None:
        """The graph hooks' part (the capture's padding step, or the replay's admission check),
        then one plan per parameter set on the wrappers of the loaded size, from the buffers'
        host CSR (outside the graph: capture and replay alike)."""
        super().init_forward_metadata_out_graph(forward_batch, in_capture)
        graph = self.graph
        assert graph is not None
        buffers, store = graph.buffers, self.pool.store
        view = buffers.layer_view(store, 0, ())
        if in_capture:  # the padding-only step: its CSR read back once, at start-up
            view = dataclasses.replace(view, kv_indptr=view.kv_indptr.cpu(), last_page_len=view.last_page_len.cpu())
        else:
            view = buffers.plan_view(graph.core.tables, view)
        self.flashinfer.plan_graph(view, self._graph_params.values())  # the CSR pinned, no page ids

    def graph_attention(self, q: torch.Tensor, layer: Any, index: int, view: LayerView) -> torch.Tensor:
        params = self._graph_params[index]
        if params != AttentionParams.of_layer(layer, layer.tp_q_head_num, q.dtype):  # Python runs at capture only
            raise RuntimeError(f"kvplane: --kv-cuda-graphs on: layer {layer.layer_id}'s attention ({q.dtype}) is not "
                               f"what its FlashInfer graph plan was made for ({params}); use --kv-cuda-graphs off")
        return self.flashinfer.run(q, view, params)
