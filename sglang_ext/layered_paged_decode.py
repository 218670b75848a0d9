"""``LayeredPagedDecode``: the layered attention backends whose decode reads the step's per-layer
page tables (FlashInfer on CUDA, the Triton kernel on CUDA or under ``TRITON_INTERPRET``).

Decode steps build no token tables (``pool.token_tables`` off): each layer's attention reads
row ``l`` of the step's one ``[L, n]`` page table (:class:`~sglang_ext.dataplane.step_tables.StepTables`,
uploaded once per step) with the step's CSR (``kv_indptr``, ``kv_lens``, ``last_page_len``,
identical for every layer: a host-only page is staged into the request's staging slot).

Extend steps (prefill, chunked prefill, prefix hits, mixed batches) read the same per-layer page
tables through kvplane's Triton paged-extend kernel (:func:`kernels.paged_extend.paged_extend`)
wherever Triton runs (CUDA, or ``TRITON_INTERPRET=1``): one launch per layer, no token tables
built, no host sync in the layer -- SGLang's torch-native extend walks the batch per request and
reads its lengths from the device at every layer. Models whose attention the kernel does not
compute (cross-attention, encoder-only layers, K and V head dims that differ), steps that could
not be staged (served at rest) and hosts without Triton extend through the torch-native path
(soft-capped where a layer caps: ``sglang_ext/capped_attention.py``); which one serves is logged
once at start. The steady decode fast path builds the
step's tables from the last step's page lists in both layouts: the paged one advances them
(:class:`~sglang_ext.dataplane.paged_decode_step.PagedDecodeStep`), the identity one journals the
step and grows them (:class:`~sglang_ext.dataplane.identity_decode_step.IdentityDecodeStep`).
Subclasses implement :meth:`decode_layer`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import structlog
import torch

from kernels.block_copy import triton_usable
from kernels.paged_extend import paged_extend, shared_per_block_of
from sglang_ext.dataplane.layer_cap_window import layer_cap_window
from sglang_ext.layered_attention import (
    LayeredTorchNativeAttnBackend,
    attention_layers,
    refuse_attention_kwargs,
)

log = structlog.get_logger(__name__)


def paged_extend_blocker(model: Any) -> str | None:
    """Why ``model``'s extends cannot run on the paged-extend kernel (None: they can): a layer
    (``RadixAttention``) attends across sequences, bidirectionally, or with K and V head dims
    that differ."""
    for module in attention_layers(model):
        if getattr(module, "is_cross_attention", False):
            return "cross-attention layers"
        if getattr(getattr(module, "attn_type", None), "name", "") == "ENCODER_ONLY":
            return "encoder-only (bidirectional) attention"
        if getattr(module, "qk_head_dim", 0) != getattr(module, "v_head_dim", 0):
            return "K and V head dims differ"
    return None


def kernel_extend(kernel: bool, new: Sequence[int] | None, starts: int, lens: int) -> bool:
    """Whether an extend step (``new``: its requests' new-token counts; None: not an extend) reads
    the page tables through the paged-extend kernel: Triton runs here and SGLang did not pad the
    batch's lengths -- ``ForwardBatch._pad_inputs_to_size`` (two-batch overlap, attention-TP
    scatter) pads ``extend_seq_lens`` (``lens`` entries) but not ``extend_start_loc`` (``starts``).
    Decided before the step's tables are built: a kernel extend builds no token tables, so the
    torch-native path could not serve the step once they were skipped."""
    return kernel and new is not None and starts == lens == len(new)


def token_tables_needed(decode: bool, kernel_extend: bool, blocker: str | None) -> bool:
    """Whether a step builds token tables: decode and kernel extends read page tables,
    torch-native extends read token tables, and so does a decode of a model with layers the
    paged kernels do not compute (``blocker``: its cross-attention layers decode through the
    torch-native path, which once KV is offloaded reads the step's token tables)."""
    return (not decode and not kernel_extend) or (decode and blocker is not None)


class LayeredPagedDecode(LayeredTorchNativeAttnBackend):
    """Decode over the step's per-layer page tables (see module docstring)."""

    def __init__(self, model_runner: Any) -> None:
        super().__init__(model_runner)
        self.pool.core.paged_reads = True  # decode reads the step's page tables, even in place
        self._paged = False
        blocker = paged_extend_blocker(model_runner.model)
        kernel = triton_usable(torch.empty(0, device=self.device))
        self.paged_blocker = blocker
        """What of the model the paged kernels do not compute (None: nothing)."""
        self.extend_kernel = blocker is None and kernel
        """Extends read the page tables through the paged-extend kernel (module docstring)."""
        self._extend_paged = False
        self._max_new = 0
        self.extend_layers = 0
        """Layer extends served through the paged-extend kernel (per process)."""
        cuda = torch.device(self.device).type == "cuda"
        self.shared_per_block = shared_per_block_of(torch.device(self.device)) if cuda else None
        """The GPU's shared memory a block may use (the extend's tiles depend on it), read once here
        rather than at every layer's launch (a device-property query each); None off CUDA."""
        log.info("layered_extend_path", path="paged-extend kernel" if self.extend_kernel else "torch-native",
                 reason=None if self.extend_kernel else blocker or "triton does not run on this device "
                 "(CUDA, or TRITON_INTERPRET=1 on CPU)")

    def init_forward_metadata(self, forward_batch: Any) -> None:
        mode = forward_batch.forward_mode
        decode = mode.is_decode()
        new = forward_batch.extend_seq_lens_cpu if not decode and mode.is_extend() else None
        extend = self.extend_kernel and new is not None and kernel_extend(
            True, new, forward_batch.extend_start_loc.numel(), forward_batch.extend_seq_lens.numel())
        self.pool.token_tables = token_tables_needed(decode, extend, self.paged_blocker)
        super().init_forward_metadata(forward_batch)
        self.new_step()
        tables = self.pool.tables
        staged = tables is not None and tables.batch > 0 and not self.pool.overflow
        self._paged = decode and staged
        self._extend_paged = extend and staged
        if self._extend_paged and tables.batch != len(new):
            raise RuntimeError(f"kvplane layered extend: the step's tables hold {tables.batch} requests, SGLang's "
                               f"extend {len(new)}; no token tables were built for the torch path")
        self._max_new = max(int(x) for x in new) if self._extend_paged else 0

    def new_step(self) -> None:
        """A forward starts (subclasses forget per-step plans)."""

    def decode_layer(self, q: torch.Tensor, layer: Any, index: int) -> torch.Tensor:
        """Attention ``[B, Hq, D]`` of q ``[B, Hq, D]`` (model dtype; the KV cache may be narrower)
        at this rank's layer ``index``."""
        raise NotImplementedError

    def extend_layer(self, q: torch.Tensor, layer: Any, index: int, forward_batch: Any) -> torch.Tensor:
        """Extend attention ``[T, Hq, D]`` of q ``[T, Hq, D]`` at this rank's layer ``index``,
        through row ``index`` of the step's page table (:func:`kernels.paged_extend.paged_extend`)."""
        tables, store = self.pool.tables, self.pool.store
        if not self.extend_layers:
            log.info("layered_paged_extend_active", impl="triton" if triton_usable(q, store.dev[0]) else "torch-reference")
        self.extend_layers += 1
        cap, window = layer_cap_window(layer)
        return paged_extend(
            q, store.dev[0], store.dev[1], forward_batch.extend_start_loc, forward_batch.extend_seq_lens,
            tables.kv_indptr, tables.tab[index], tables.kv_lens, self._max_new,
            sm_scale=getattr(layer, "scaling", None), logits_soft_cap=cap, window_left=window,
            shared_per_block=self.shared_per_block,
        )

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):  # noqa: ANN001, ANN201
        if not self._extend_paged or layer.is_cross_attention:
            return super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
        if kwargs:
            refuse_attention_kwargs(kwargs, layer)
        self._begin_layer(layer.layer_id)
        if save_kv_cache and k is not None and v is not None:  # first: the new tokens read themselves
            self.token_to_kv_pool.set_kv_buffer(layer, forward_batch.out_cache_loc, k, v)
        q3 = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim)
        out = self.extend_layer(q3, layer, layer.layer_id - self.pool.start_layer, forward_batch)
        if out.dtype != q.dtype:
            out = out.to(q.dtype)
        out = out.reshape(-1, layer.tp_q_head_num * layer.v_head_dim)
        self._end_layer(layer.layer_id)
        return out

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):  # noqa: ANN001, ANN201
        if not self._paged or layer.is_cross_attention:
            return super().forward_decode(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
        if kwargs:
            refuse_attention_kwargs(kwargs, layer)
        self._begin_layer(layer.layer_id)
        index, rec = layer.layer_id - self.pool.start_layer, self.recompute
        bs = None if rec.rows is None else rec.batch  # recompute rows follow the decode rows
        if bs is not None:  # their K/V first: the decode rows read the prefix through tab[l]
            rec.write(self.pool, index, k, v, layer)
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
