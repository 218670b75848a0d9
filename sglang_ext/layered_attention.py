"""Attention backends over the layered KV pool (swapped into SGLang's ATTENTION_BACKENDS).

:class:`LayeredTorchNativeAttnBackend` (CPU and any device; correctness): SGLang's own
``TorchNativeAttnBackend`` math, unchanged, fed with K/V gathered through
``pool.layer_kv(layer, slots)`` -- device pages directly, offloaded pages from host in one
batched gather per layer. When every row of a layer is on the device (nothing offloaded) the
parent instead reads the device page pool in place through a per-layer table of device rows:
no copy, the same values. ``init_forward_metadata`` is the step boundary: it hands the batch
to ``pool.prepare_step`` (placement reconciled, events, stats) and builds a compact
``req_to_token`` table over the gathered rows (one row per batch request; the parent's SDPA
helpers get row ids ``0..bs-1`` in place of ``req_pool_indices``), so the parent's per-request SDPA loop reads
exactly the values it would read from a flat pool (same dtype, same order): greedy outputs
are token-identical to vanilla.

Steady decode (the common step: the same requests as the previous forward, one token more each,
identity layout with everything resident) skips the per-request slot reads: only the step's new
pages (``out_cache_loc``) are placed (``pool.prepare_decode_step``), and the forward reads in
place. Anything else -- a new or finished request, a prefill, a plan that offloads, a free --
takes the general path above.

:class:`LayeredFlashInferDecode` (GPU, import-guarded): decode through
:class:`~sglang_ext.dataplane.flashinfer_attention.FlashInferLayeredDecode` with one plan per
step and per-layer page tables read from the pool's map, offloaded pages staged into device
pages first. Extend (prefill) uses the torch path. Not runnable on this CPU host; covered by a
``gpu``-marked test.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

from sglang_ext import overhead
from sglang_ext.layered_pool import LayeredTokenToKVPool


def _request_slots(req_to_token: torch.Tensor, rows: list[int], lens: list[int]) -> list[torch.Tensor]:
    """Each request's slots (fresh int64 tensors, not views of ``req_to_token``). On CPU the
    rows are cut in NumPy: a few µs per request less than torch's dispatcher, every step."""
    if req_to_token.device.type == "cpu":
        table = req_to_token.numpy()
        return [torch.from_numpy(table[row, :n].astype(np.int64)) for row, n in zip(rows, lens, strict=True)]
    return [req_to_token[row, :n].to(torch.int64) for row, n in zip(rows, lens, strict=True)]


class _GatheredKV:
    """Stand-in for the pool inside the parent's forward: writes go to the pool, reads are gathered."""

    def __init__(self, backend: LayeredTorchNativeAttnBackend) -> None:
        self._backend = backend
        self._layer: int | None = None
        self._kv: tuple[torch.Tensor, torch.Tensor] | None = None

    def set_kv_buffer(self, *args: Any, **kwargs: Any) -> None:
        self._layer, self._kv = None, None
        self._backend.pool.set_kv_buffer(*args, **kwargs)

    def _gather(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._layer != layer_id or self._kv is None:
            backend = self._backend
            if backend.layer_timer is not None:
                backend.layer_timer.mark(layer_id - backend.pool.start_layer)
            slots = backend.batch_slots
            rows = None
            if backend.in_place:
                # Identity layout, all resident: the parent reads this layer exactly like
                # SGLang's own pool (slot ids, real req_to_token and req_pool_indices).
                backend.req_to_token_pool.req_to_token = backend.real_req_to_token_pool.req_to_token
                self._kv = backend.pool.layer_in_place(layer_id)
                backend.direct_layers += 1
                self._layer = layer_id
                return self._kv
            if slots.numel():
                rows = backend.pool.device_rows(layer_id, slots)
            if rows is not None:
                # Every row of this layer is on the device: the parent reads the device pool in
                # place through a table of device rows (no copy, one small index per layer).
                backend.req_to_token_pool.req_to_token = rows[backend.compact_table]
                self._kv = backend.pool.device_kv()
                backend.direct_layers += 1
            else:
                backend.req_to_token_pool.req_to_token = backend.compact_table
                self._kv = backend.pool.layer_kv(layer_id, slots)
            self._layer = layer_id
        return self._kv

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self._gather(layer_id)[0]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self._gather(layer_id)[1]


class _CompactTable:
    """Stand-in for ``req_to_token_pool``: rows of the batch point into the gathered K/V."""

    def __init__(self) -> None:
        self.req_to_token = torch.zeros((1, 1), dtype=torch.int64)


class LayeredTorchNativeAttnBackend(TorchNativeAttnBackend):
    """SGLang's torch_native attention reading K/V through the layered pool."""

    def __init__(self, model_runner: Any) -> None:
        super().__init__(model_runner)
        pool = model_runner.token_to_kv_pool
        if not isinstance(pool, LayeredTokenToKVPool):
            raise TypeError(
                f"layered attention needs LayeredTokenToKVPool, got {type(pool).__name__} "
                "(is --enable-layered-kv set for this process?)"
            )
        self.pool = pool
        self.real_req_to_token_pool = model_runner.req_to_token_pool
        self.token_to_kv_pool = _GatheredKV(self)
        self.req_to_token_pool = _CompactTable()
        self.batch_slots = torch.zeros(0, dtype=torch.int64, device=self.device)
        self.batch_rids: list[str | None] = []
        self.batch_request_slots: list[torch.Tensor] = []
        self.compact_table = self.req_to_token_pool.req_to_token
        """``req_to_token`` rows of the batch as positions into ``batch_slots`` (built only for
        steps that are not read in place)."""
        self.compact_rows = torch.zeros(0, dtype=torch.int64, device=self.device)
        self.in_place = False
        """This step reads every layer in place (identity layout, all of the batch resident)."""
        self.layer_timer: Any = None
        """A :class:`~sglang_ext.layer_timing.LayerTimer` set by the scheduler hooks (rank 0)."""
        self.direct_layers = 0
        """Layer reads served in place from the device pool (all rows resident), not gathered."""
        self.last_delta = None
        self._last_batch: tuple[list[str], list[int]] | None = None
        """Request ids and sequence lengths of the previous forward (for :meth:`_steady_decode`)."""

    steady_decode_fast_path = True
    """Steady decode steps skip re-reading every request's slots (:meth:`_steady_decode`)."""

    def init_forward_metadata(self, forward_batch: Any) -> None:
        super().init_forward_metadata(forward_batch)
        meter = overhead.METER
        if meter is None:
            self._prepare(forward_batch)
            return
        t0 = time.perf_counter()
        self._prepare(forward_batch)
        meter.add("attention_prepare", time.perf_counter() - t0)

    def _prepare(self, forward_batch: Any) -> None:
        """kvplane's part of the step's metadata: residency for this batch, and how to read it."""
        if self._steady_decode(forward_batch):
            return
        req_to_token = self.real_req_to_token_pool.req_to_token
        rows = forward_batch.req_pool_indices
        bs = 0 if rows is None else int(rows.numel())
        seq_lens = forward_batch.seq_lens_cpu
        if seq_lens is None:
            seq_lens = forward_batch.seq_lens.cpu() if bs else torch.zeros(0, dtype=torch.int64)
        lens = [int(x) for x in seq_lens.tolist()]
        rows_cpu = rows.cpu().tolist() if bs else []
        rids = forward_batch.rids or [None] * bs
        per_req = _request_slots(req_to_token, rows_cpu, lens)
        self.last_delta = self.pool.prepare_step(list(zip(rids, per_req, strict=True)), forward_batch.out_cache_loc)
        self.batch_rids, self.batch_request_slots = list(rids), per_req
        self.batch_slots = torch.cat(per_req) if per_req else self.batch_slots[:0]
        self.in_place = bs > 0 and self.pool.readable_in_place(self.batch_slots)
        if not self.in_place:
            self._build_compact_table(lens, bs)
        self.token_to_kv_pool._layer = None
        known = bs > 0 and all(rid is not None for rid in rids)
        self._last_batch = (list(rids), lens) if known else None

    def _steady_decode(self, forward_batch: Any) -> bool:
        """The usual decode step: the same requests as the previous forward, one token more each,
        everything resident in the identity layout. Then nothing but the step's new slots
        (``out_cache_loc``) changes residency, so the general path's per-request slot reads (the
        bulk of the plugin's per-step cost on a small model) are skipped; the forward reads in
        place exactly as the general path would have decided. False (nothing done) otherwise."""
        last, self._last_batch = self._last_batch, None
        if last is None or not self.steady_decode_fast_path or not forward_batch.forward_mode.is_decode():
            return False
        rids, seq_lens = forward_batch.rids, forward_batch.seq_lens_cpu
        if rids is None or seq_lens is None or rids != last[0]:
            return False
        lens = seq_lens.tolist()  # a few ints: plain Python beats NumPy's per-call cost here
        prev = last[1]
        if len(lens) != len(prev) or any(n != p + 1 for n, p in zip(lens, prev, strict=True)):
            return False
        if not self.pool.prepare_decode_step(rids, lens, forward_batch.out_cache_loc):
            return False
        self.last_delta = None
        self.batch_rids, self.batch_request_slots = list(rids), []
        if self.batch_slots.numel():
            self.batch_slots = self.batch_slots[:0]
        self.in_place = True
        self.token_to_kv_pool._layer = None
        self._last_batch = (last[0], lens)
        return True

    def _build_compact_table(self, lens: list[int], bs: int) -> None:
        # Row i = positions of request i's tokens in batch_slots (0-padded); the parent is handed
        # row ids 0..bs-1 instead of SGLang's req_pool_indices.
        width = max(lens, default=1) or 1
        lens_t = torch.tensor(lens, dtype=torch.int64, device=self.device)
        starts = torch.cumsum(lens_t, 0) - lens_t
        cols = torch.arange(width, dtype=torch.int64, device=self.device)
        table = torch.where(cols[None, :] < lens_t[:, None], starts[:, None] + cols[None, :], 0)
        self.compact_rows = torch.arange(bs, dtype=torch.int64, device=self.device)
        self.compact_table = self.req_to_token_pool.req_to_token = table

    def _rows_arg(self, args: tuple) -> tuple:
        # positional like the parent's calls: (q, o, k, v, req_to_token, req_pool_indices, ...)
        return args if self.in_place else (*args[:5], self.compact_rows, *args[6:])

    def _run_sdpa_forward_extend(self, *args: Any, **kwargs: Any) -> Any:
        return super()._run_sdpa_forward_extend(*self._rows_arg(args), **kwargs)

    def _run_sdpa_forward_decode(self, *args: Any, **kwargs: Any) -> Any:
        return super()._run_sdpa_forward_decode(*self._rows_arg(args), **kwargs)


try:  # GPU path: import-guarded (flashinfer needs CUDA)
    from sglang_ext.dataplane.flashinfer_attention import HAVE_FLASHINFER, FlashInferLayeredDecode
except Exception:  # noqa: BLE001
    HAVE_FLASHINFER = False
    FlashInferLayeredDecode = None  # type: ignore[assignment,misc]


class LayeredFlashInferDecode(LayeredTorchNativeAttnBackend):
    """GPU: decode through FlashInfer over per-layer page tables; extend through the torch path.

    One FlashInfer plan per step (every layer has the same page counts); per layer the page ids
    come from the pool's map, host-only pages staged onto device pages first
    (:class:`~sglang_ext.dataplane.slot_page_tables.SlotPageTables`). When the staging pages do
    not fit the device budget the step falls back to the gather path (counted in
    ``staging_fallback_steps``). CUDA graphs are not used (tables change every step).
    """

    def __init__(self, model_runner: Any) -> None:
        super().__init__(model_runner)
        if not HAVE_FLASHINFER or self.pool.store.device.type != "cuda":
            raise RuntimeError("LayeredFlashInferDecode needs CUDA and an importable flashinfer")
        from sglang_ext.dataplane.slot_page_tables import SlotPageTables

        self.tables = SlotPageTables(self.pool.store)
        self.flashinfer = FlashInferLayeredDecode(self.pool.store.device, self.pool.store.config.logical_pages)
        self._paged = False
        self._planned = False
        self.staging_fallback_steps = 0

    steady_decode_fast_path = False  # decode goes through FlashInfer's per-step page tables

    def init_forward_metadata(self, forward_batch: Any) -> None:
        self.tables.end()
        super().init_forward_metadata(forward_batch)
        self._paged = self._planned = False
        if forward_batch.forward_mode.is_decode() and self.batch_request_slots:
            self._paged = self.tables.begin([r or "" for r in self.batch_rids], self.batch_request_slots)
            self.staging_fallback_steps += not self._paged
        self.pool.store.staging_pages = self.tables.staging_pages

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True):  # noqa: ANN001
        if not self._paged or layer.is_cross_attention:
            return super().forward_decode(q, k, v, layer, forward_batch, save_kv_cache)
        if save_kv_cache and k is not None and v is not None:
            self.pool.set_kv_buffer(layer, forward_batch.out_cache_loc, k, v)
        view = self.tables.layer_view(layer.layer_id - self.pool.start_layer)
        if not self._planned:
            self.flashinfer.plan(view, layer.tp_q_head_num, sm_scale=layer.scaling)
            self._planned = True
        q3 = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim).to(view.k_cache.dtype)
        out = self.flashinfer.run(q3, view)
        return out.to(q.dtype).reshape(-1, layer.tp_q_head_num * layer.v_head_dim)


def create_layered_flashinfer_backend(runner: Any) -> LayeredTorchNativeAttnBackend:
    """ATTENTION_BACKENDS factory replacing ``flashinfer`` when --enable-layered-kv is on (GPU)."""
    return LayeredFlashInferDecode(runner)


def create_layered_torch_native_backend(runner: Any) -> LayeredTorchNativeAttnBackend:
    """ATTENTION_BACKENDS factory replacing ``torch_native`` when --enable-layered-kv is on."""
    return LayeredTorchNativeAttnBackend(runner)
