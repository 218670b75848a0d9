"""``LayeredPagedDecode``: the layered attention backends whose decode reads the step's per-layer
page tables (FlashInfer on CUDA, the Triton kernel on CUDA or under ``TRITON_INTERPRET``).

Decode steps build no token tables (``pool.token_tables`` off): each layer's attention reads
row ``l`` of the step's one ``[L, n]`` page table (:class:`~sglang_ext.dataplane.step_tables.StepTables`,
uploaded once per step) with the step's CSR (``kv_indptr``, ``kv_lens``, ``last_page_len``,
identical for every layer: a host-only page is staged into the request's staging slot). Extend
steps, cross-attention and steps without tables go through the torch-native path (soft-capped
where a layer caps: ``sglang_ext/capped_attention.py``). The steady decode fast path builds the
step's tables from the last step's page lists in both layouts: the paged one advances them
(:class:`~sglang_ext.dataplane.paged_decode_step.PagedDecodeStep`), the identity one journals the
step and grows them (:class:`~sglang_ext.dataplane.identity_decode_step.IdentityDecodeStep`).
Subclasses implement :meth:`decode_layer`.
"""

from __future__ import annotations

from typing import Any

import torch

from sglang_ext.layered_attention import LayeredTorchNativeAttnBackend, refuse_attention_kwargs


class LayeredPagedDecode(LayeredTorchNativeAttnBackend):
    """Decode over the step's per-layer page tables (see module docstring)."""

    def __init__(self, model_runner: Any) -> None:
        super().__init__(model_runner)
        self.pool.core.paged_reads = True  # decode reads the step's page tables, even in place
        self._paged = False

    def init_forward_metadata(self, forward_batch: Any) -> None:
        decode = forward_batch.forward_mode.is_decode()
        self.pool.token_tables = not decode  # decode reads page tables, not token tables
        super().init_forward_metadata(forward_batch)
        self.new_step()
        self._paged = decode and self.pool.tables is not None and self.pool.tables.batch > 0

    def new_step(self) -> None:
        """A forward starts (subclasses forget per-step plans)."""

    def decode_layer(self, q: torch.Tensor, layer: Any, index: int) -> torch.Tensor:
        """Attention ``[B, Hq, D]`` of q ``[B, Hq, D]`` (model dtype; the KV cache may be narrower)
        at this rank's layer ``index``."""
        raise NotImplementedError

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):  # noqa: ANN001, ANN201
        if not self._paged or layer.is_cross_attention:
            return super().forward_decode(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
        if kwargs:
            refuse_attention_kwargs(kwargs, layer)
        self._begin_layer(layer.layer_id)
        index, rec = layer.layer_id - self.pool.start_layer, self.recompute
        bs = None if rec.rows is None else rec.batch  # recompute rows follow the decode rows
        if bs is not None:  # their K/V first: the decode rows read the prefix through tab[l]
            rec.write(self.pool.core, index, k, v, layer)
        # no slice without recompute rows: a slice of a device tensor is a dispatch of its own
        if save_kv_cache and k is not None and v is not None:
            # through the stand-in pool, as the torch-native decode writes: the meter's kv_write
            self.token_to_kv_pool.set_kv_buffer(layer, forward_batch.out_cache_loc, *(
                (k, v) if bs is None else (k[:bs], v[:bs])))
        q3 = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim)  # model dtype, as SGLang keeps it
        out = self.decode_layer(q3 if bs is None else q3[:bs], layer, index)
        if out.dtype != q.dtype:
            out = out.to(q.dtype)
        out = out.reshape(-1, layer.tp_q_head_num * layer.v_head_dim)
        if bs is not None:
            full = out.new_empty((q3.shape[0], out.shape[1]))
            full[:bs] = out
            rec.attend(index, q, k, v, full, layer)
            out = full
        self._end_layer(layer.layer_id)
        return out
