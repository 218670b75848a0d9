"""Attention backends over the layered KV pool (swapped into SGLang's ATTENTION_BACKENDS).

:class:`LayeredTorchNativeAttnBackend` (CPU and any device; correctness): SGLang's own
``TorchNativeAttnBackend`` math, unchanged, reading the layered pool's *device* page pool only.
``init_forward_metadata`` is the step boundary: it hands the batch to ``pool.prepare_step``
(placement reconciled, the step's tables built once and uploaded once, staging reserved, the first
fetches launched on the transfer stream). Each layer's forward is bracketed by
``pool.begin_layer`` (a stream wait on that layer's fetch events) and ``pool.end_layer``
(write-back of staged new tokens, next fetches launched); inside it the parent writes through
``pool.set_kv_buffer`` (the step's device rows) and reads:

- identity layout (the budget holds every layer-page): in place, with SGLang's own slot ids and
  ``req_to_token`` -- a host-only layer-page is staged at its own identity page;
- otherwise: the device pool through a per-layer row table ``tab[l][tok_col] * page_size +
  tok_off`` (three device ops), handed to the parent's SDPA helpers with row ids ``0..bs-1`` in
  place of ``req_pool_indices``.

Either way the parent reads exactly the values a flat pool would hold (same dtype, same order).
Nothing in a layer reads device memory from the host.

Steady decode (same requests as the previous forward, one token more each, identity layout with
everything resident) skips re-reading every request's slots: only the step's new pages
(``out_cache_loc``) are placed (``pool.prepare_decode_step``).

:class:`LayeredFlashInferDecode` (GPU, import-guarded): decode through
:class:`~sglang_ext.dataplane.flashinfer_attention.FlashInferLayeredDecode` with one plan per
step (``kv_indptr``/``last_page_len`` are the same for every layer) and per-layer page tables
that are rows of the step's one table tensor. Extend (prefill) reads the same tables through
kvplane's Triton paged-extend kernel (``sglang_ext/layered_paged_decode.py``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from sglang_ext.capped_attention import capped_decode, capped_extend
from sglang_ext.compat import SDPA_REQ_POOL_INDICES_ARG, TorchNativeAttnBackend
from sglang_ext.dataplane.at_rest_batch import at_rest_batch
from sglang_ext.layered_decode_graph import SEQ_LEN_FILL
from sglang_ext.layered_pool import LayeredTokenToKVPool
from sglang_ext.recompute_forward import RecomputeForward


def attention_layers(model: Any) -> Iterator[Any]:
    """``model``'s attention layers (SGLang's ``RadixAttention``: the modules carrying a soft cap
    and a sliding window), in module order."""
    for module in model.modules():
        if hasattr(module, "logit_cap") and hasattr(module, "sliding_window_size"):
            yield module


def attention_features(model: Any) -> bool:
    """Whether any attention layer (``RadixAttention``) of ``model`` soft-caps or windows its
    scores. Raises ValueError, naming the model, for a layer feature the layered backends do not
    apply: Grok-2's attention temperature (``xai_temperature_len``), a non-``tanh`` soft cap."""
    found = False
    for module in attention_layers(model):
        cap = float(module.logit_cap or 0.0)
        if int(getattr(module, "xai_temperature_len", -1) or -1) > 0:
            raise ValueError(f"kvplane layered attention: {type(model).__name__} scales attention by position "
                             "(xai_temperature_len), which the layered backends do not apply: not supported "
                             "with --enable-layered-kv")
        if cap > 0 and getattr(module, "logit_capping_method", "tanh") != "tanh":
            raise ValueError(f"kvplane layered attention: {type(model).__name__} soft-caps attention with "
                             f"{module.logit_capping_method!r}; the layered backends apply 'tanh' only: not "
                             "supported with --enable-layered-kv")
        window = module.sliding_window_size
        found = found or cap > 0 or (window is not None and int(window) >= 0)
    return found


def refuse_attention_kwargs(kwargs: dict[str, Any], layer: Any) -> None:
    """Raise for an attention argument the layered backends would drop (attention sinks, ...):
    a model passing one is refused at launch (``sglang_ext/model_support.py``); anything else
    reaching here fails loudly rather than decode without it. None / False values are no-ops."""
    passed = sorted(name for name, value in kwargs.items() if value is not None and value is not False)
    if passed:
        raise ValueError(
            f"kvplane layered attention: layer {getattr(layer, 'layer_id', '?')} passed {', '.join(passed)} to "
            "attention, which the layered backends do not apply: not supported with --enable-layered-kv"
        )


def _request_slots(req_to_token: torch.Tensor, rows: list[int], lens: list[int]) -> list[torch.Tensor]:
    """Each request's slots as fresh CPU int64 tensors (not views of ``req_to_token``). On CPU the
    rows are cut in NumPy; on a GPU the batch's rows come over in one copy (one sync per step,
    at the boundary, never inside a layer)."""
    if not rows:
        return []
    if req_to_token.device.type == "cpu":
        table = req_to_token.numpy()
    else:
        index = torch.tensor(rows, dtype=torch.int64).to(req_to_token.device, non_blocking=True)
        table = req_to_token[index, : max(lens)].cpu().numpy()
        rows = list(range(len(rows)))
    return [torch.from_numpy(table[row, :n].astype(np.int64)) for row, n in zip(rows, lens, strict=True)]


def _warmup_rows(rids: list, per_req: list[torch.Tensor], lens: list[int], counts: list[int] | None,
                 out_cache_loc: torch.Tensor) -> tuple[list[torch.Tensor], list[int]]:
    """Rows of no request that are shorter than the tokens they write, made to hold exactly those
    tokens' slots. SGLang's warm-up forward (``BaseRunner._dummy_run``: FlashInfer's autotune, on
    CUDA sm90+ for FP8 / FP4 GEMMs or FlashInfer MoE, before any request) runs anonymous rows at
    ``req_to_token`` row 0 writing the padding slot 0. The eager runner's rows hold one token (the
    fill value); a decode graph runner that warms up first hands over buffers whose ``seq_lens``
    may still be 0 (SGLang refills them only after its warm-up). Such a row's slots become its
    ``out_cache_loc`` run -- SGLang's padding slot, so its pages agree with its new tokens. A
    real request's row is never changed: the core refuses one shorter than its new tokens."""
    if counts is None:
        return per_req, lens
    short = [i for i, (rid, n, c) in enumerate(zip(rids, lens, counts, strict=True)) if rid is None and n < c]
    if not short:
        return per_req, lens
    loc = out_cache_loc.to("cpu", torch.int64)  # the boundary, once, in a warm-up forward only
    starts = np.cumsum([0, *counts])
    per_req, lens = list(per_req), list(lens)
    for i in short:
        per_req[i], lens[i] = loc[starts[i]: starts[i] + counts[i]].clone(), counts[i]
    return per_req, lens


class _LayeredKV:
    """Stand-in for the pool inside the parent's forward: writes go to the pool, reads are the
    device pool (in place, or through the layer's row table)."""

    def __init__(self, backend: LayeredTorchNativeAttnBackend) -> None:
        self._backend = backend
        self._layer: int | None = None
        self._kv: tuple[torch.Tensor, torch.Tensor] | None = None

    def set_kv_buffer(self, *args: Any, **kwargs: Any) -> None:
        meter = self._backend.overhead_meter
        if meter is None:
            self._backend.pool.set_kv_buffer(*args, **kwargs)
            return
        t0 = time.perf_counter()
        self._backend.pool.set_kv_buffer(*args, **kwargs)
        meter.add("kv_write", time.perf_counter() - t0)  # the layer's KV copy (vanilla SGLang writes it too)

    def _read(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._layer != layer_id or self._kv is None:
            meter = self._backend.overhead_meter
            if meter is None:
                self._take(layer_id)
            else:
                t0 = time.perf_counter()
                self._take(layer_id)
                meter.add("layers", time.perf_counter() - t0)
        return self._kv  # type: ignore[return-value]

    def _take(self, layer_id: int) -> None:
        """Point the parent at ``layer_id``'s K/V (kvplane's per-layer read metadata)."""
        backend = self._backend
        if backend.in_place:
            backend.req_to_token_pool.req_to_token = backend.real_req_to_token_pool.req_to_token
            self._kv = backend.pool.layer_in_place(layer_id)
        elif backend.pool.overflow:  # staging did not fit: the at-rest read (counted, logged)
            backend.req_to_token_pool.req_to_token = backend.compact_table
            self._kv = backend.pool.layer_kv(layer_id, backend.batch_slots)
        else:
            backend.req_to_token_pool.req_to_token = backend.pool.token_rows(layer_id)
            self._kv = backend.pool.device_kv()
        self._layer = layer_id

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self._read(layer_id)[0]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self._read(layer_id)[1]


class _CompactTable:
    """Stand-in for ``req_to_token_pool``: rows of the batch point into the device pool."""

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
        self.token_to_kv_pool = _LayeredKV(self)
        self.req_to_token_pool = _CompactTable()
        self.batch_rids: list[str | None] = []
        self.batch_request_slots: list[torch.Tensor] = []
        self.compact_rows = torch.zeros(0, dtype=torch.int64, device=self.device)
        self.batch_slots = torch.zeros(0, dtype=torch.int64)
        self.compact_table = self.req_to_token_pool.req_to_token
        self.in_place = False
        """This step reads every layer in place (identity layout)."""
        self.steady = False
        """This step took the steady-decode fast path: nothing staged, so the layers skip the
        pool's per-layer calls (no fetch to wait for, nothing to write back)."""
        self.idle = False
        """This step's layers launch and wait on nothing (``LayeredKVCore.layers_idle``: an
        all-resident paged step): they skip the pool's per-layer calls but the last layer's exit,
        which ends the step."""
        self._logit_cap = 0.0
        """The current layer's soft cap (set around SGLang's torch-native call; 0: none)."""
        self._last_layer = self.pool.start_layer + self.pool.core.layers - 1
        self.overhead_meter: Any = None
        """The process's :class:`~sglang_ext.overhead.OverheadMeter` (set by the scheduler hooks
        when ``$KVPLANE_OVERHEAD_FILE`` is on): per-step preparation and per-layer calls."""
        self.layer_timer: Any = None
        """A :class:`~sglang_ext.layer_timing.LayerTimer` set by the scheduler hooks (rank 0)."""
        self.last_delta = None
        self.recompute_inputs: dict[str, tuple[int, int, np.ndarray]] = {}
        """This step's recompute requests, rid -> (uncached pages u, recomputed layers k, prefix
        ids), set by :class:`~sglang_ext.recompute_requests.RecomputeRequests` (decode steps)."""
        self.recompute = RecomputeForward()
        capped_or_windowed = attention_features(model_runner.model)
        # eLLM's recompute rows attend with plain causal SDPA (RecomputeForward.attend): not for
        # models whose layers soft-cap or window their attention, nor for models whose decoder layers
        # take another call than SGLang's, which the rows' cut binds (RecomputeForward.layers_fit:
        # SGLang's Transformers backend, OPT, Persimmon, Phi, PhiMoE), nor for multimodal or M-RoPE
        # models, whose prefix KV token ids and 1-D positions do not rebuild, nor where SGLang sets
        # per-row state for its own rows before the rows are appended: LoRA adapters, the MoE top-k
        # capture, expert parallelism (inputs_reason)
        inputs_why = RecomputeForward.inputs_reason(getattr(model_runner, "model_config", None),
                                                    getattr(model_runner, "server_args", None),
                                                    lora=getattr(model_runner, "lora_manager", None) is not None)
        self.recompute_ok = (not capped_or_windowed and inputs_why is None
                             and RecomputeForward.layers_fit(model_runner.model)
                             and self.recompute.wrap_logits(model_runner.model))
        """The model's decode forward can carry recompute rows (``docs/recompute.md``)."""
        if pool.recompute_ratio and not self.recompute_ok:  # the flag would do nothing: refused at start
            raise ValueError(RecomputeForward.refusal(model_runner.model, pool.recompute_ratio, capped_or_windowed,
                                                      inputs_why))
        self.recompute_cut_layers = self.recompute.wrap_layers(model_runner.model) if self.recompute_ok else 0
        """Decoder layers at whose entry the rows of prefixes recomputed only below them are cut."""
        self.pool.recompute_forward = self.recompute

    steady_decode_fast_path = True
    """Steady decode steps skip re-reading every request's slots (:meth:`_steady_decode`)."""

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        """SGLang's ``seq_lens`` of dummy and padded rows: its warm-up forward's buffers ask every
        backend (``BaseRunner._alloc_dummy_decode_buffers``; SGLang's torch-native backend does not
        answer, so that warm-up fails on it, FlashInfer's says 1), and its decode graph runner
        pads with it (the layered Triton decode's graphs)."""
        return SEQ_LEN_FILL

    def init_forward_metadata(self, forward_batch: Any) -> None:
        super().init_forward_metadata(forward_batch)
        meter = self.overhead_meter
        t0 = 0.0 if meter is None else time.perf_counter()
        fast = self._prepare(forward_batch)
        self.idle = not self.steady and self.pool.core.layers_idle
        if meter is not None:
            meter.add("attention_prepare", time.perf_counter() - t0)
            meter.count("prepare_steady_decode" if fast else "prepare_general")

    def _prepare(self, forward_batch: Any) -> bool:
        """kvplane's part of the step's metadata: residency for this batch, and how to read it.
        True when the steady decode fast path served it."""
        self.token_to_kv_pool._layer = None
        self.recompute.clear()
        fast = not self.recompute_inputs and self._steady_decode(forward_batch)
        # ``steady``: nothing staged, so the layers skip the pool's per-layer calls -- the identity
        # layout's journalled step only; the paged layout's steady step stages as usual
        self.steady = fast and self.in_place
        if fast:
            return True
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
        new_counts = None
        if forward_batch.forward_mode.is_extend() and forward_batch.extend_seq_lens_cpu is not None:
            new_counts = [int(x) for x in forward_batch.extend_seq_lens_cpu]
        if None in rids:
            decode = forward_batch.forward_mode.is_decode()
            per_req, lens = _warmup_rows(rids, per_req, lens, new_counts or ([1] * bs if decode else None),
                                         forward_batch.out_cache_loc)
        inputs = self.recompute_inputs
        spec = ids = None
        if inputs and self.recompute_ok and forward_batch.forward_mode.is_decode():
            spec = self._recompute_spec(rids, lens, inputs)
            if spec is not None:
                ids = [inputs[rid][2] if rid in inputs else None for rid in rids]
        self.last_delta = self.pool.prepare_step(
            list(zip(rids, per_req, strict=True)), forward_batch.out_cache_loc, new_counts, spec, ids
        )
        tables = self.pool.tables
        if spec is not None and tables is not None and not self.pool.overflow and tables.recompute is not None:
            self.recompute.augment(forward_batch, tables.recompute)
        self.batch_rids, self.batch_request_slots = list(rids), per_req
        self.in_place = self.pool.store.identity
        if not self.in_place and self.compact_rows.numel() != bs:
            self.compact_rows = torch.arange(bs, dtype=torch.int64, device=self.device)
        if self.pool.overflow:
            self.batch_slots, self.compact_table = at_rest_batch(per_req, lens, self.device)
        return False

    def _steady_decode(self, forward_batch: Any) -> bool:
        """The usual decode step: each request one token more than at its last boundary (the
        batch may have changed: the core knows what each request held,
        :class:`~sglang_ext.dataplane.decode_continuity.DecodeContinuity`). Then nothing but the
        step's new slots (``out_cache_loc``) changes residency, so the general path's per-request
        slot reads are skipped. False (nothing done) otherwise."""
        if not self.steady_decode_fast_path or not forward_batch.forward_mode.is_decode():
            return False
        rids, seq_lens = forward_batch.rids, forward_batch.seq_lens_cpu
        if not rids or seq_lens is None or None in rids:
            return False
        lens = seq_lens.tolist()  # a few ints: plain Python beats NumPy's per-call cost here
        if not self.pool.prepare_decode_step(rids, lens, forward_batch.out_cache_loc):
            return False
        self.in_place = self.pool.store.identity  # the paged layout's steady step stages as usual
        # the worker metrics count the step's moves: the paged step reconciles, the journal does not
        # (but after a release or free)
        self.last_delta = self.pool.core.decode_delta
        self.batch_rids, self.batch_request_slots = list(rids), []
        if not self.in_place:
            bs = len(lens)
            if self.compact_rows.numel() != bs:
                self.compact_rows = torch.arange(bs, dtype=torch.int64, device=self.device)
            if self.pool.overflow:  # served at rest: the batch's slots, as the general path reads them
                per_req = _request_slots(self.real_req_to_token_pool.req_to_token,
                                         forward_batch.req_pool_indices.cpu().tolist(), lens)
                self.batch_request_slots = per_req
                self.batch_slots, self.compact_table = at_rest_batch(per_req, lens, self.device)
        return True

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):  # noqa: ANN001, ANN201
        if kwargs:
            refuse_attention_kwargs(kwargs, layer)
        self._begin_layer(layer.layer_id)
        self._logit_cap = layer.logit_cap or 0.0  # > 0: the torch-native loop below is soft-capped
        try:
            out = super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache)
        finally:
            self._logit_cap = 0.0
        self._end_layer(layer.layer_id)
        return out

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):  # noqa: ANN001, ANN201
        if kwargs:
            refuse_attention_kwargs(kwargs, layer)
        self._begin_layer(layer.layer_id)
        rec = self.recompute
        self._logit_cap = layer.logit_cap or 0.0
        try:
            if rec.rows is None:
                out = super().forward_decode(q, k, v, layer, forward_batch, save_kv_cache)
            else:  # the prefix rows first (their K/V are read by the decode rows), docs/recompute.md
                index, bs = layer.layer_id - self.pool.start_layer, rec.batch
                rec.write(self.pool, index, k, v, layer)
                out = super().forward_decode(q, k[:bs], v[:bs], layer, forward_batch, save_kv_cache)
                rec.attend(index, q, k, v, out, layer)
        finally:
            self._logit_cap = 0.0
        self._end_layer(layer.layer_id)
        return out

    def _recompute_spec(self, rids: list[str | None], lens: list[int], inputs: dict) -> np.ndarray | None:
        """``(u, k)`` per batch row (u below the row's page count), or None when nobody recomputes."""
        ps = self.pool.page_size
        spec = np.zeros((len(rids), 2), dtype=np.int64)
        for i, rid in enumerate(rids):
            got = inputs.get(rid) if rid is not None else None
            if got is not None:
                spec[i] = (min(got[0], -(-lens[i] // ps) - 1), got[1])
        return spec if spec[:, 0].any() else None

    def _begin_layer(self, layer_id: int) -> None:
        meter = self.overhead_meter
        t0 = 0.0 if meter is None else time.perf_counter()
        if self.layer_timer is not None:
            self.layer_timer.mark(layer_id - self.pool.start_layer)
        if not (self.steady or self.idle):  # a steady or idle step staged nothing: no fetch to wait for
            self.pool.enter_layer(layer_id)
            if self.layer_timer is not None:  # the layer's compute starts after its fetches' wait
                self.layer_timer.ready(layer_id - self.pool.start_layer)
        if meter is not None:
            meter.add("layers", time.perf_counter() - t0)

    def _end_layer(self, layer_id: int) -> None:
        if self.steady or (self.idle and layer_id != self._last_layer):  # no write-back, no fetch to launch
            return
        meter = self.overhead_meter
        if meter is None:
            self.pool.exit_layer(layer_id)
            return
        t0 = time.perf_counter()
        self.pool.exit_layer(layer_id)
        meter.add("layers", time.perf_counter() - t0)

    def _rows_arg(self, args: tuple) -> tuple:
        # positional like the parent's calls: (q, o, k, v, req_to_token, req_pool_indices, ...)
        i = SDPA_REQ_POOL_INDICES_ARG
        return args if self.in_place else (*args[:i], self.compact_rows, *args[i + 1:])

    def _run_sdpa_forward_extend(self, *args: Any, **kwargs: Any) -> Any:
        if self._logit_cap > 0:  # SGLang's loop has no soft cap (sglang_ext/capped_attention.py)
            return capped_extend(*self._rows_arg(args), cap=self._logit_cap, **kwargs)
        return super()._run_sdpa_forward_extend(*self._rows_arg(args), **kwargs)

    def _run_sdpa_forward_decode(self, *args: Any, **kwargs: Any) -> Any:
        if self._logit_cap > 0:
            return capped_decode(*self._rows_arg(args), cap=self._logit_cap, **kwargs)
        return super()._run_sdpa_forward_decode(*self._rows_arg(args), **kwargs)


def create_layered_flashinfer_backend(runner: Any) -> LayeredTorchNativeAttnBackend:
    """ATTENTION_BACKENDS factory replacing ``flashinfer`` when --enable-layered-kv is on (GPU)."""
    from sglang_ext.layered_flashinfer_decode import LayeredFlashInferDecode

    return LayeredFlashInferDecode(runner)


def create_layered_triton_backend(runner: Any) -> LayeredTorchNativeAttnBackend:
    """ATTENTION_BACKENDS factory replacing ``triton`` when --enable-layered-kv is on."""
    from sglang_ext.layered_triton_decode import LayeredTritonDecode

    return LayeredTritonDecode(runner)


def create_layered_torch_native_backend(runner: Any) -> LayeredTorchNativeAttnBackend:
    """ATTENTION_BACKENDS factory replacing ``torch_native`` when --enable-layered-kv is on."""
    return LayeredTorchNativeAttnBackend(runner)
