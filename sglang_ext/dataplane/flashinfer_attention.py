"""FlashInfer paged decode over layered page tables (GPU only; import-guarded).

Every layer of a request has the same number of pages ``b_r`` (resident blocks or the staging
slot), so ``kv_indptr`` and ``last_page_len`` -- everything FlashInfer's ``plan`` schedules on --
are identical for all layers: **one plan per step serves every layer** with the same attention
parameters, whatever the residency pattern (the per-layer-group plans OrbitFlow's
distance-driven layouts would need collapse to one). Only the page ids differ per layer: the
wrapper (user-owned buffers, FlashInfer's CUDA-graph buffer mode) reads the layer's row of the
step's table in place of its indices buffer for that ``run`` where its backend reads the buffer
at run time (:func:`reads_indices_at_run`), else the row is copied into the buffer before the run.

Layers whose attention parameters differ (Gemma-2's alternating sliding-window and global
layers, soft-capped logits) get one plan per distinct :class:`AttentionParams` per step.

Bounded memory: wrappers (each holds FlashInfer's own int workspace, 8 MiB device + 8 MiB
pinned) are kept for at most :data:`MAX_WRAPPERS` (batch size, parameters) keys, least recently
used dropped first; the float workspace is shared. The indices buffers grow (to the next power
of two) when a step's batch lists more pages than they hold -- requests sharing a prefix list
its pages once each, so a step may list more pages than the pool has.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from sglang_ext.dataplane.layer_cap_window import layer_cap_window
from sglang_ext.dataplane.results import LayerView

try:
    import flashinfer

    HAVE_FLASHINFER = True
except Exception:  # noqa: BLE001 - flashinfer may fail to import without CUDA
    flashinfer = None
    HAVE_FLASHINFER = False

WORKSPACE_BYTES = 128 * 1024 * 1024
"""FlashInfer float workspace (its recommended size), shared by every wrapper."""

MAX_WRAPPERS = 8
"""(batch size, parameters) keys whose wrappers are kept (least recently used dropped)."""


@dataclass(frozen=True)
class AttentionParams:
    """The per-layer attention parameters a FlashInfer decode plan fixes."""

    num_qo_heads: int
    sm_scale: float | None = None
    logits_soft_cap: float = 0.0
    """``cap * tanh(logits / cap)`` when > 0 (Gemma-2, Grok); 0 is off."""
    window_left: int = -1
    """Attend to the last ``window_left + 1`` tokens (sliding window); -1 is off."""
    q_dtype: torch.dtype | None = None
    """The query's dtype (SGLang keeps q in the model dtype); None: the KV cache's."""

    @classmethod
    def of_layer(cls, layer: object, num_qo_heads: int, q_dtype: torch.dtype | None = None) -> AttentionParams:
        """From SGLang's ``RadixAttention`` (``scaling``, ``logit_cap``, ``sliding_window_size``)."""
        cap, window = layer_cap_window(layer)
        return cls(num_qo_heads=num_qo_heads, sm_scale=getattr(layer, "scaling", None), logits_soft_cap=cap,
                   window_left=window, q_dtype=q_dtype)


def grown(capacity: int, needed: int) -> int:
    """Capacity for ``needed`` entries: unchanged if it suffices, else the next power of two."""
    if needed <= capacity:
        return capacity
    return 1 << max(0, needed - 1).bit_length()


class FlashInferLayeredDecode:
    """Batch decode over the served core's per-step tables, one FlashInfer plan per step and
    per distinct :class:`AttentionParams`."""

    def __init__(self, device: torch.device | str, max_pages: int) -> None:
        if not HAVE_FLASHINFER:
            raise RuntimeError("flashinfer is not importable; use torch_layered_attention")
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise ValueError(f"FlashInferLayeredDecode needs a CUDA device, got {self.device}")
        self.max_pages = max(1, max_pages)
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self._wrappers: OrderedDict[tuple[int, AttentionParams], tuple[object, torch.Tensor]] = OrderedDict()
        self._planned: dict[AttentionParams, tuple[object, torch.Tensor]] = {}

    def _wrapper(self, batch: int, params: AttentionParams) -> tuple[object, torch.Tensor]:
        key = (batch, params)
        if key in self._wrappers:
            self._wrappers.move_to_end(key)
            return self._wrappers[key]
        while len(self._wrappers) >= MAX_WRAPPERS:
            self._wrappers.popitem(last=False)
        indices = torch.zeros(self.max_pages, dtype=torch.int32, device=self.device)
        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace,
            "NHD",
            use_cuda_graph=True,
            use_tensor_cores=True,
            paged_kv_indptr_buffer=torch.zeros(batch + 1, dtype=torch.int32, device=self.device),
            paged_kv_indices_buffer=indices,
            paged_kv_last_page_len_buffer=torch.zeros(batch, dtype=torch.int32, device=self.device),
        )
        self._wrappers[key] = (w, indices)
        return w, indices

    @property
    def wrappers(self) -> int:
        """Wrappers held now (at most :data:`MAX_WRAPPERS`)."""
        return len(self._wrappers)

    def new_step(self) -> None:
        """Forget the previous step's plans (the next ``run`` of each parameter set plans)."""
        self._planned.clear()

    def plan(self, view: LayerView, num_qo_heads: int, sm_scale: float | None = None,
             params: AttentionParams | None = None) -> AttentionParams:
        """Plan this step for ``params`` (default: plain attention with ``num_qo_heads`` and
        ``sm_scale``) from any layer's view (all layers share indptr and lengths)."""
        if params is None:
            params = AttentionParams(num_qo_heads=num_qo_heads, sm_scale=sm_scale)
        _, page_size, num_kv_heads, head_dim = view.k_cache.shape
        batch = view.kv_lens.numel()
        needed = grown(self.max_pages, int(view.kv_indices.numel()))
        if needed != self.max_pages:  # shared-prefix pages listed per request: grow, re-create
            self.max_pages = needed
            self._wrappers.clear()
            self._planned.clear()
        w, indices = self._wrapper(batch, params)
        w.plan(
            view.kv_indptr,
            view.kv_indices,
            view.last_page_len,
            params.num_qo_heads,
            num_kv_heads,
            head_dim,
            page_size,
            window_left=params.window_left,
            logits_soft_cap=params.logits_soft_cap or None,
            q_data_type=params.q_dtype or view.k_cache.dtype,
            kv_data_type=view.k_cache.dtype,
            sm_scale=params.sm_scale,
        )
        self._planned[params] = (w, indices)
        return params

    def planned(self, params: AttentionParams) -> bool:
        return params in self._planned

    def run(self, q: torch.Tensor, view: LayerView, params: AttentionParams | None = None) -> torch.Tensor:
        """Decode attention of ``view.layer`` for q ``[B, Hq, D]`` with the plan of ``params``
        (default: the only plan of this step)."""
        if params is None:
            if len(self._planned) != 1:
                raise RuntimeError(f"FlashInferLayeredDecode.run: {len(self._planned)} plans, name one")
            params = next(iter(self._planned))
        if params not in self._planned:
            raise RuntimeError("FlashInferLayeredDecode.run before plan")
        w, indices = self._planned[params]
        rows = view.kv_indices
        if reads_indices_at_run(w, rows, indices):
            # the layer's row of the step's table IS the indices the run reads: no copy launch
            # per layer; the wrapper's own buffer comes back before anything else (its next plan
            # writes there) -- see reads_indices_at_run
            w._paged_kv_indices_buf = rows  # type: ignore[attr-defined]
            try:
                return w.run(q, (view.k_cache, view.v_cache))
            finally:
                w._paged_kv_indices_buf = indices  # type: ignore[attr-defined]
        n = rows.numel()
        indices[:n].copy_(rows, non_blocking=True)
        return w.run(q, (view.k_cache, view.v_cache))


RUN_READS_INDICES = ("fa2", "fa3")
"""FlashInfer decode backends whose ``run`` passes the wrapper's ``_paged_kv_indices_buf`` to the
kernel as it finds it then (FlashInfer 0.7.2, ``decode.py``: the tensor-core ``paged_run`` and the
CUDA-core ``run`` argument lists); the others (``trtllm-gen``, cuDNN, cuTile, CuTe-DSL) read block
tables made at plan time."""


def reads_indices_at_run(wrapper: object, rows: torch.Tensor, own: torch.Tensor) -> bool:
    """Whether ``wrapper.run`` may read a layer's page ids from ``rows`` in place of its own
    indices buffer ``own``: a planned FlashInfer wrapper of a backend in :data:`RUN_READS_INDICES`
    (not cuDNN) holding ``own``, and ``rows`` int32, contiguous, on its device. Then
    :meth:`FlashInferLayeredDecode.run` points the wrapper at ``rows`` for the run and back at
    ``own`` after it, instead of one copy launch per layer (a few microseconds of host time each
    on a GPU host, 32 a step at Llama-3-8B's layers). Anything else: the copy."""
    return (getattr(wrapper, "_backend", None) in RUN_READS_INDICES and not getattr(wrapper, "_uses_cudnn", False)
            and getattr(wrapper, "_paged_kv_indices_buf", None) is own and rows.dtype == torch.int32
            and rows.is_contiguous() and rows.device == own.device)
