"""FlashInfer paged decode over layered page tables (GPU only; import-guarded).

Every layer of a request has the same number of pages ``b_r`` (resident blocks or the staging
slot), so ``kv_indptr`` and ``last_page_len`` -- everything FlashInfer's ``plan`` schedules on --
are identical for all layers: **one plan per step serves every layer** with the same attention
parameters, whatever the residency pattern (the per-layer-group plans OrbitFlow's
distance-driven layouts would need collapse to one). Only the page ids differ per layer: the
wrapper's ``run`` reads its indices buffer at run time (the ``fa2`` backend, which kvplane asks
for as SGLang's own FlashInfer backend does: :func:`reads_rows_at_run`; another is refused at
plan), so each layer's run is handed that layer's row of the step's table, no copy launched.

Layers whose attention parameters differ (Gemma-2's alternating sliding-window and global
layers, soft-capped logits) get one plan per distinct :class:`AttentionParams` per step.

Two kinds of wrappers:

- **Eager** (serving; ``plan(..., graph=False)``): FlashInfer's dynamic mode, as SGLang's eager
  backend builds it -- one wrapper per parameter set whatever the batch size, FlashInfer's
  scheduler free to leave the KV unsplit. Its CUDA-graph mode would force a split KV on every
  run (partial results and a merge kernel per layer) and reserve partial results for the padded
  batch in the float workspace: 128 MiB overflows at about 1,600 requests of 32 query heads on
  an H100, inside SGLang's default running-request limit.
- **Graph** (``graph=True``): user-owned buffers of a fixed batch size. In ``kvplane gpu-check``'s
  capture probe at most :data:`MAX_WRAPPERS` (batch size, parameters) keys; a wrapper dropped from
  the cache is kept alive as long as the decode object (a captured graph may still replay its
  buffers): unbounded, so for a probe of a few sizes only. The indices buffers grow (to the next
  power of two) when a step lists more pages than they hold -- requests sharing a prefix list its
  pages once each. Served decode graphs (``--kv-cuda-graphs on``, :meth:`keep_graphs`) keep
  every wrapper they make -- one per captured batch size and parameter set, as SGLang's own
  backend keeps one per size -- over one indices buffer they share (as SGLang's wrappers share
  theirs), as wide as the graph buffers' rows, never re-created: a captured graph reads the
  wrapper it was captured with, so a re-created one would take the next plan where no replay
  reads it.

Tensor cores follow SGLang's rule (``should_use_tensor_core``: the adapter passes SGLang's own;
:func:`default_tensor_cores` otherwise). Each wrapper holds FlashInfer's 8 MiB device int
workspace; the float workspace is shared.

**The split schedule's pinned buffer.** FlashInfer's ``plan`` writes the step's split schedule
(request and KV-tile indices, output offsets, chunk size) into the wrapper's pinned int
workspace on the host, then copies it to the device int workspace with one async copy on the
current stream (0.7.2: ``DecodePlan`` / ``PrefillPlan`` in ``scheduler.cuh``); nothing stops the
wrapper's next ``plan`` from rewriting that pinned buffer before the copy has run. Under SGLang's
overlap loop the host plans step k+1 while step k waits on the GPU -- and kvplane puts waits
for step k's page moves on the forward stream ahead of step k's plan copy -- so the copy could
read step k+1's schedule against step k's lengths: wrong attention, or reads past a request's
pages (review, session 92; the same class as mini-sglang #103). So on CUDA each plan gets a fresh
pinned buffer from a ring (:class:`~sglang_ext.dataplane.pinned_upload_ring.PinnedUploadRing`,
:data:`SCHEDULE_SLOTS` slots of the int workspace's size): a buffer is written again only after
an event recorded behind the plan that used it has completed (the ring grows before it waits).
The wrappers' own pinned buffers are dropped at their first plan, back to PyTorch's caching host
allocator, whose next wrapper of the same size takes the same block: the ring's few (up to
:data:`~sglang_ext.dataplane.pinned_upload_ring.GROW_TO` times as many while the GPU lags, never
shrunk) and one cached block replace one per wrapper (about 36 with SGLang's default captured
sizes).
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from sglang_ext.dataplane.layer_cap_window import layer_cap_window
from sglang_ext.dataplane.pinned_upload_ring import PinnedUploadRing
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
"""Graph wrappers: (batch size, parameters) keys kept in the cache (least recently used dropped)."""

SCHEDULE_SLOTS = 4
"""Pinned buffers of the split schedule's ring (module docstring): a step plans once per parameter
set, and the GPU runs at most a step or two behind the host."""
SCHEDULE_BYTES = 8 * 1024 * 1024
"""FlashInfer 0.7.2's int workspace (``decode.py``): a wrapper without one (a stand-in) gets this."""

BACKEND = "fa2"
"""FlashInfer's decode backend, as SGLang's FlashInfer backend asks for it (``decode_backend``)."""


def default_tensor_cores(kv_dtype: torch.dtype, num_qo_heads: int, num_kv_heads: int) -> bool:
    """SGLang 0.5.23's ``should_use_tensor_core`` without its environment override: fp8 KV, or
    16-bit KV with a GQA group of 4 or more (the tensor-core kernel fuses the group with the
    tokens); the CUDA-core decode kernel otherwise."""
    if kv_dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return True
    if kv_dtype in (torch.float16, torch.bfloat16):
        return num_qo_heads // max(1, num_kv_heads) >= 4
    return False


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
    per distinct :class:`AttentionParams` (module docstring)."""

    def __init__(self, device: torch.device | str, max_pages: int, *,
                 tensor_cores: Callable[[torch.dtype, int, int], bool] = default_tensor_cores,
                 wrapper_class: Any = None, workspace_bytes: int = WORKSPACE_BYTES,
                 schedule_ring: PinnedUploadRing | None = None) -> None:
        """``max_pages``: the graph wrappers' first indices capacity; ``tensor_cores``: the rule
        (KV dtype, query heads, KV heads); ``wrapper_class``: FlashInfer's
        ``BatchDecodeWithPagedKVCacheWrapper`` (None), or a stand-in of it (tests, on the CPU);
        ``schedule_ring``: the pinned buffers plans write their split schedule into (module
        docstring; default: a ring of :data:`SCHEDULE_SLOTS` on CUDA, none on a CPU)."""
        if wrapper_class is None:
            if not HAVE_FLASHINFER:
                raise RuntimeError("flashinfer is not importable; use torch_layered_attention")
            if torch.device(device).type != "cuda":
                raise ValueError(f"FlashInferLayeredDecode needs a CUDA device, got {device}")
            wrapper_class = flashinfer.BatchDecodeWithPagedKVCacheWrapper
        self.device = torch.device(device)
        self.wrapper_class = wrapper_class
        self.tensor_cores = tensor_cores
        self.max_pages = max(1, max_pages)
        self.workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=self.device)
        self._eager: dict[AttentionParams, object] = {}
        self._graph: OrderedDict[tuple[int, AttentionParams], tuple[object, torch.Tensor]] = OrderedDict()
        self._retired: list[tuple[object, torch.Tensor]] = []
        """Graph wrappers dropped from the cache, kept alive: a captured graph may replay them."""
        self._planned: dict[AttentionParams, tuple[object, torch.Tensor | None]] = {}
        self._kept = False
        """Served decode graphs (:meth:`keep_graphs`): graph wrappers are neither dropped nor re-created."""
        self._kept_indices: torch.Tensor | None = None
        """The indices buffer every kept graph wrapper shares (``max_pages`` wide)."""
        self._csr_ring: PinnedUploadRing | None = None
        """Pinned host buffers graph plans copy their CSR from (CUDA; made at the first :meth:`plan_graph`)."""
        self._no_pages = torch.zeros(0, dtype=torch.int32, device=self.device)
        """The page ids a graph plan is handed: none (its runs read each layer's row in place)."""
        if schedule_ring is None and self.device.type == "cuda":
            schedule_ring = PinnedUploadRing(self.device, slots=SCHEDULE_SLOTS)
        self.schedule_ring = schedule_ring

    def keep_graphs(self, max_pages: int) -> None:
        """Serve captured decode graphs: every graph wrapper made from now on is kept (no
        :data:`MAX_WRAPPERS` bound), with indices buffers of ``max_pages`` (the graph buffers'
        row width: a run that cannot read a layer's row in place copies it there); a plan
        listing more raises instead of re-creating the wrappers captured graphs read (module
        docstring). The served decode hands its graph plans no page ids at all.

        Called again -- SGLang captures every size again (a weight update's recapture) -- with
        the same width it keeps the wrappers, which the new captures find and plan again; with
        another width (or after the probe's cached wrappers) the wrappers made so far are
        retired (kept alive, never planned again: the graphs that read them never replay)."""
        max_pages = max(1, max_pages)
        if self._graph and not (self._kept and max_pages == self.max_pages):
            self._retired.extend(self._graph.values())
            self._graph.clear()
            self._kept_indices = None
        self._planned.clear()
        self.max_pages, self._kept = max_pages, True

    def _new(self, params: AttentionParams, kv_dtype: torch.dtype, kv_heads: int, **buffers: Any) -> object:
        return self.wrapper_class(
            self.workspace, "NHD", use_cuda_graph=bool(buffers), backend=BACKEND,
            use_tensor_cores=self.tensor_cores(kv_dtype, params.num_qo_heads, kv_heads), **buffers,
        )

    def _eager_wrapper(self, params: AttentionParams, kv_dtype: torch.dtype, kv_heads: int) -> object:
        w = self._eager.get(params)
        if w is None:
            w = self._eager[params] = self._new(params, kv_dtype, kv_heads)
        return w

    def _graph_wrapper(self, batch: int, params: AttentionParams, kv_dtype: torch.dtype,
                       kv_heads: int) -> tuple[object, torch.Tensor]:
        key = (batch, params)
        if key in self._graph:
            self._graph.move_to_end(key)
            return self._graph[key]
        while not self._kept and len(self._graph) >= MAX_WRAPPERS:
            self._retired.append(self._graph.popitem(last=False)[1])
        # kept wrappers share one indices buffer (served runs read rows in place; a copy into it runs
        # in stream order, layer by layer, as into SGLang's shared one)
        indices = self._kept_indices if self._kept else None
        if indices is None:
            indices = torch.zeros(self.max_pages, dtype=torch.int32, device=self.device)
            if self._kept:
                self._kept_indices = indices
        w = self._new(params, kv_dtype, kv_heads,
                      paged_kv_indptr_buffer=torch.zeros(batch + 1, dtype=torch.int32, device=self.device),
                      paged_kv_indices_buffer=indices,
                      paged_kv_last_page_len_buffer=torch.zeros(batch, dtype=torch.int32, device=self.device))
        self._graph[key] = (w, indices)
        return w, indices

    @property
    def wrappers(self) -> int:
        """Wrappers held now (eager ones, one per parameter set; graph ones, at most
        :data:`MAX_WRAPPERS`; the retired graph ones apart)."""
        return len(self._eager) + len(self._graph)

    def new_step(self) -> None:
        """Forget the previous step's plans (the next ``run`` of each parameter set plans)."""
        self._planned.clear()

    def plan(self, view: LayerView, num_qo_heads: int, sm_scale: float | None = None,
             params: AttentionParams | None = None, graph: bool = False, width: int | None = None) -> AttentionParams:
        """Plan this step for ``params`` (default: plain attention with ``num_qo_heads`` and
        ``sm_scale``) from any layer's view (all layers share indptr and lengths); ``graph``: on
        a graph wrapper of the view's batch size (captured replays read its buffers), whose
        indices buffer holds ``width`` page ids (default: as many as the view lists)."""
        if params is None:
            params = AttentionParams(num_qo_heads=num_qo_heads, sm_scale=sm_scale)
        kv_dtype, kv_heads = view.k_cache.dtype, view.k_cache.shape[2]
        own: torch.Tensor | None = None
        if graph:
            width = int(view.kv_indices.numel()) if width is None else width
            needed = grown(self.max_pages, width)
            if needed != self.max_pages and self._kept:
                raise RuntimeError(f"kvplane FlashInfer graph plan lists {width} pages, over the "
                                   f"{self.max_pages} its captured graphs' wrappers hold")
            if needed != self.max_pages:  # shared-prefix pages listed per request: grow, re-create
                self.max_pages = needed
                self._retired.extend(self._graph.values())
                self._graph.clear()
                self._planned.clear()
            w, own = self._graph_wrapper(view.kv_lens.numel(), params, kv_dtype, kv_heads)
        else:
            w = self._eager_wrapper(params, kv_dtype, kv_heads)
        self._plan(w, view, params)
        if own is None and not reads_rows_at_run(w):
            raise RuntimeError(f"kvplane's FlashInfer decode hands each layer its page table at run time, which "
                               f"FlashInfer's {getattr(w, '_backend', None)!r} backend does not read "
                               f"(it needs one of {RUN_READS_INDICES}, not cuDNN)")
        self._planned[params] = (w, own)
        return params

    def _plan(self, w: Any, view: LayerView, params: AttentionParams) -> None:
        _, page_size, num_kv_heads, head_dim = view.k_cache.shape
        if self.schedule_ring is not None:  # a pinned buffer no pending copy reads (module docstring)
            own = getattr(w, "_int_workspace_buffer", None)
            nbytes = SCHEDULE_BYTES if own is None else own.numel() * own.element_size()
            w._pin_memory_int_workspace_buffer = self.schedule_ring.take(nbytes)
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

    def plan_graph(self, view: LayerView, params: Iterable[AttentionParams]) -> None:
        """A captured step's plans (at its capture, or before a replay): this step's plans
        forgotten, then each of ``params`` planned on the graph wrappers of ``view``'s batch from
        its host CSR -- staged in pinned memory on CUDA (the plan copies it to the device; a
        pageable source would make that copy wait for the stream) -- and no page ids (the runs
        read each layer's row of the graph buffers in place: no copy of them is launched)."""
        rows, width = view.last_page_len.numel(), int(view.kv_indices.numel())  # width: a row, if a run copies it
        csr = np.concatenate([view.kv_indptr.numpy(), view.last_page_len.numpy()]).astype(np.int32)
        if self.device.type == "cuda":
            if self._csr_ring is None:
                self._csr_ring = PinnedUploadRing(self.device)
            host = self._csr_ring.stage(csr)
        else:  # nothing to pin
            host = torch.from_numpy(csr)
        view = dataclasses.replace(view, kv_indptr=host[: rows + 1], last_page_len=host[rows + 1:],
                                   kv_indices=self._no_pages)
        self.new_step()
        for p in dict.fromkeys(params):
            self.plan(view, p.num_qo_heads, params=p, graph=True, width=width)

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
        w, own = self._planned[params]
        rows = view.kv_indices
        if own is None:  # eager: the run reads whatever indices buffer it finds (checked at plan)
            if rows.dtype != torch.int32 or not rows.is_contiguous():
                rows = rows.to(torch.int32).contiguous()  # a copy launch (the step's table rows need none)
            w._paged_kv_indices_buf = rows  # type: ignore[attr-defined]
            return w.run(q, (view.k_cache, view.v_cache))  # type: ignore[attr-defined]
        if reads_indices_at_run(w, rows, own):
            # the layer's row of the step's table IS the indices the run reads: no copy launch
            # per layer; the wrapper's own buffer comes back before anything else (its next plan
            # writes there) -- see reads_indices_at_run
            w._paged_kv_indices_buf = rows  # type: ignore[attr-defined]
            try:
                return w.run(q, (view.k_cache, view.v_cache))  # type: ignore[attr-defined]
            finally:
                w._paged_kv_indices_buf = own  # type: ignore[attr-defined]
        n = rows.numel()
        own[:n].copy_(rows, non_blocking=True)
        return w.run(q, (view.k_cache, view.v_cache))  # type: ignore[attr-defined]


RUN_READS_INDICES = ("fa2", "fa3")
"""FlashInfer decode backends whose ``run`` passes the wrapper's ``_paged_kv_indices_buf`` to the
kernel as it finds it then (FlashInfer 0.7.2, ``decode.py``: the tensor-core ``paged_run`` and the
CUDA-core ``run`` argument lists); the others (``trtllm-gen``, cuDNN, cuTile, CuTe-DSL) read block
tables made at plan time."""


def reads_rows_at_run(wrapper: object) -> bool:
    """A planned FlashInfer wrapper of a backend in :data:`RUN_READS_INDICES` (not cuDNN): its
    ``run`` reads the page ids from whatever ``_paged_kv_indices_buf`` it finds then."""
    return getattr(wrapper, "_backend", None) in RUN_READS_INDICES and not getattr(wrapper, "_uses_cudnn", False)


def reads_indices_at_run(wrapper: object, rows: torch.Tensor, own: torch.Tensor) -> bool:
    """Whether a graph wrapper's ``run`` may read a layer's page ids from ``rows`` in place of its
    own indices buffer ``own``: :func:`reads_rows_at_run`, the wrapper holding ``own``, and
    ``rows`` int32, contiguous, on its device. Then :meth:`FlashInferLayeredDecode.run` points
    the wrapper at ``rows`` for the run and back at ``own`` after it, instead of one copy launch
    per layer (a few microseconds of host time each on a GPU host, 32 a step at Llama-3-8B's
    layers). Anything else: the copy."""
    return (reads_rows_at_run(wrapper) and getattr(wrapper, "_paged_kv_indices_buf", None) is own
            and rows.dtype == torch.int32 and rows.is_contiguous() and rows.device == own.device)
