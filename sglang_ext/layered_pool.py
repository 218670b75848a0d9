"""LayeredTokenToKVPool: SGLang's MHA KV pool with per-(layer, page) device/host residency.

Swapped in for ``MHATokenToKVPool`` (AROUND ``KVCacheConfigurator._resolve_kv_pool_class``,
kind ``mha``) when ``--enable-layered-kv`` is on, and constructed with its exact kwargs. A thin
adapter: it keeps SGLang's logical slot/page space (allocator, ``req_to_token``, radix tree
unchanged) and maps SGLang's calls onto the SGLang-free served core,
:class:`~sglang_ext.dataplane.layered_kv_core.LayeredKVCore` (store, residency, staging, the
step's tables, the layer pipeline). No full per-layer device buffers are allocated: the device
holds ``--kv-gpu-budget-tokens`` token-layers.

Step protocol (scheduler thread, ``--disable-overlap-schedule``):

1. (optional) ``update_residency(wants)`` from the scheduler hooks at the step boundary;
2. ``prepare_step(requests, new_slots, new_counts)`` from the layered attention backend's
   ``init_forward_metadata``: placement reconciled, the step's tables built once, staging
   reserved, first fetches launched, events emitted, a stats line written to
   ``$KVPLANE_POOL_STATS_FILE`` when set -- or, for a steady decode step in the identity layout,
   ``prepare_decode_step(rids, seq_lens, new_slots)``;
3. per layer: ``enter_layer`` (stream wait on the layer's fetches), ``set_kv_buffer`` (the step's
   device rows), the attention's read of the device pool, ``exit_layer`` (write-back of staged
   new tokens, next fetches).

``attach(tree_cache)`` (plugin's radix factory) subscribes to the tree's residency hub:
``freed`` pages drop their device copies; ``on_release`` of a request releases its wants;
``offloaded`` / ``loaded`` events go out on the same hub.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np
import structlog
import torch

from sglang_ext import settings
from sglang_ext.args import LayeredKVArgs
from sglang_ext.capacity_hooks import wanted_tokens
from sglang_ext.compat import MHATokenToKVPool, unwrap_write_loc
from sglang_ext.dataplane.host_pool import available_host_bytes, host_pool_limit
from sglang_ext.dataplane.layer_page_moves import LayerPageMoves
from sglang_ext.dataplane.layered_kv_core import LayeredKVCore
from sglang_ext.dataplane.slot_results import RequestResidency, ResidencyDelta, ResidencyStats
from sglang_ext.dataplane.slot_store_config import SlotStoreConfig, layer_page_bytes
from sglang_ext.dataplane.step_tables import StepTables
from sglang_ext.dataplane.triton_row_writer import TritonRowWriter
from sglang_ext.device_capacity import DeviceCapacity, budget_pages
from sglang_ext.hooks import ResidencyEvent, ResidencyEventKind, ResidencyHooks
from sglang_ext.store_cache_writer import StoreCacheWriter

log = structlog.get_logger(__name__)

POOL_STATS_FILE_ENV = settings.POOL_STATS_FILE_ENV
"""If set, one JSON line per forward (source ``layered_pool``) with the pool's residency stats
and the boundary's delta is appended to this file. The per-step scheduler line (step time,
placements, pauses, and these stats under ``pool``) is ``$KVPLANE_STATS_FILE``, written by
:mod:`sglang_ext.scheduler_hooks`."""

_GB = 1e9


class LayeredTokenToKVPool(MHATokenToKVPool):
    """MHA KV pool whose layers live partly on the device, partly in host memory."""

    device_capacity: ClassVar[DeviceCapacity | None] = None
    """SGLang's profiled device capacity when the slot space is wider (:meth:`for_capacity`);
    None: the slot space is SGLang's profile (or within it)."""

    @classmethod
    def for_capacity(cls, capacity: DeviceCapacity | None) -> type[LayeredTokenToKVPool]:
        """This class, or (``capacity`` given) a subclass of it bound to that capacity: SGLang
        constructs the pool class it is handed with its own arguments, and the capacity was
        measured by the same scheduler's configurator just before (:mod:`sglang_ext.capacity_hooks`)."""
        if capacity is None:
            return cls
        return type(cls.__name__, (cls,), {"device_capacity": capacity, "__module__": cls.__module__,
                                           "__qualname__": cls.__qualname__})

    def __init__(self, *args: Any, layered_args: LayeredKVArgs | None = None, **kwargs: Any) -> None:
        self._layered_args = layered_args if layered_args is not None else LayeredKVArgs.from_env()
        if kwargs.get("enable_kv_cache_copy"):
            raise ValueError("kvplane layered KV pool: enable_kv_cache_copy (speculative decoding) is unsupported")
        if kwargs.get("post_capture_active"):
            raise ValueError("kvplane layered KV pool: post-capture KV backing is unsupported")
        if kwargs.get("quant_method") is not None:
            raise ValueError("kvplane layered KV pool: quantized KV caches are unsupported")
        self.residency_hooks = ResidencyHooks()
        self._step = 0
        self._in_place_views: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self._stats_file = None
        self._stats_path = settings.read_output_file(POOL_STATS_FILE_ENV)
        self.recompute_forward: Any = None
        """The attention backend's :class:`~sglang_ext.recompute_forward.RecomputeForward` (set by
        the backend): its per-layer recompute row count joins the stats line."""
        super().__init__(*args, **kwargs)

    # ----- construction (called from MHATokenToKVPool.__init__) --------------------

    def _create_buffers(self) -> None:
        if self.dtype.is_floating_point and self.dtype.itemsize == 1:  # fp8, however it was reached
            raise ValueError(
                f"kvplane layered KV pool: the KV cache dtype resolved to {self.dtype} (--kv-cache-dtype, or a "
                "checkpoint that quantizes its KV under --kv-cache-dtype auto); quantized KV caches are not "
                "supported with --enable-layered-kv: pass --kv-cache-dtype bfloat16"
            )
        if self.use_hnd or getattr(self, "kv_cache_layout", "nhd") != "nhd":
            raise ValueError(f"kvplane layered KV pool needs the NHD layout, got {self.kv_cache_layout!r}")
        if self.v_head_dim != self.head_dim:
            raise ValueError(
                f"kvplane layered KV pool needs v_head_dim == head_dim, got {self.v_head_dim} != {self.head_dim}"
            )
        self.k_scale_buffer = self.v_scale_buffer = None
        self.native_k_scale_buffer = self.native_v_scale_buffer = None
        self.dq_k_buffer = self.dq_v_buffer = None
        self.k_buffer = self.v_buffer = None
        self.data_ptrs = self.k_data_ptrs = self.v_data_ptrs = None
        self._kv_buffer_descs = ()
        logical_pages = -(-(self.size + self.page_size) // self.page_size)
        budget_tokens = self._layered_args.kv_gpu_budget_tokens
        capacity = self.device_capacity
        if capacity is not None:  # a slot space beyond the device (sglang_ext.device_capacity)
            device_pages = capacity.device_pages(
                layers=self.layer_num, page_size=self.page_size, logical_pages=logical_pages,
                layer_page_bytes=layer_page_bytes(self.page_size, self.head_num, self.head_dim, self.store_dtype),
                budget_tokens=budget_tokens, maps=2 if self._layered_args.kv_cuda_graphs == "on" else 1)
        elif budget_tokens is None:
            # every layer of every page (what SGLang's own pool holds, plus the padding page):
            # the store then uses the identity layout and attention reads it in place
            device_pages = logical_pages * self.layer_num
        else:
            device_pages = budget_pages(budget_tokens, self.page_size)
        identity = device_pages >= self.layer_num * logical_pages
        ratio = self._layered_args.kv_recompute_ratio
        if identity and ratio:
            raise ValueError(
                f"--kv-recompute-ratio={ratio}: eLLM's recompute keeps a prefix off the device, but every layer of "
                f"this launch's slot space ({self.size} tokens) is on the device, so there is no host pool to keep "
                f"it in and nothing to save: drop the flag, or set --max-total-tokens above {self._wider()} (README "
                f"'More KV than the GPU holds') or --kv-gpu-budget-tokens below {self.layer_num * logical_pages * self.page_size}"
            )
        config = SlotStoreConfig(
            layers=self.layer_num,
            page_size=self.page_size,
            kv_heads=self.head_num,
            head_dim=self.head_dim,
            logical_pages=logical_pages,
            device_pages=device_pages,
            dtype=self.store_dtype,
            device=str(self.device),
            copy_programs=self._layered_args.kv_copy_programs,
            copy_engine=self._layered_args.kv_copy_engine,
            timing_interval=self._layered_args.kv_timing_interval,
            graph_sink=self._layered_args.kv_cuda_graphs == "on",  # padded graph rows' page
            host_tier=not identity,  # every layer on the device: a host mirror would hold nothing used
        )
        host_pool_limit(config.host_bytes, self._layered_args.kv_host_pool_gb, available_host_bytes(),
                        what=(f"every layer of {logical_pages} pages of {self.page_size} tokens" if not identity
                              else "the copy engine's one-page scratch (no host tier)"),
                        device_in_host_bytes=config.device_bytes if config.device == "cpu" else 0,
                        share=settings.read_host_memory(), host_tier=not identity)
        self.core = LayeredKVCore(config, on_moves=self._emit_moves)
        self.store = self.core.store
        # SGLang's own one-launch KV write on CUDA, else kvplane's Triton one (None off CUDA: two
        # index_copy_ a layer)
        self.store.row_writer = StoreCacheWriter.for_device(
            self.store.device, self.head_num * self.head_dim * self.store.dev.element_size()
        ) or TritonRowWriter.for_device(self.store.device)
        self.residency = self.core.residency
        self.room = self.core.room
        self.pipeline = self.core.pipeline
        log.info(
            "layered_kv_pool_created",
            layers=self.layer_num,
            page_size=self.page_size,
            logical_pages=logical_pages,
            device_pages=device_pages,
            host_gb=round(config.host_bytes / _GB, 4),
            host_tier=config.host_tier,
            profiled_device_tokens=None if capacity is None else capacity.profiled_tokens,
        )
        if config.identity:
            log.info("layered_kv_slot_space_on_device", slot_tokens=self.size, host_tier=False,
                     note=("every layer of SGLang's slot space is on the device: no host pool is pinned and "
                           "nothing is offloaded or recomputed (pauses keep their KV in place); to hold more KV "
                           f"than the device, set --max-total-tokens above {self._wider()} (README 'More KV "
                           "than the GPU holds')"))
        elif device_pages < logical_pages:
            log.warning("layered_kv_budget_below_one_layer", device_pages=device_pages, layer_pages=logical_pages,
                        note=("--kv-gpu-budget-tokens counts token-layers; below one layer of the slot space a "
                              "batch over most of it cannot be staged and is read from host memory at rest, "
                              "synchronously, until the control plane pauses requests"))

    def _wider(self) -> str:
        """What ``--max-total-tokens`` must pass for a slot space wider than the device: this one's
        size where it is SGLang's profile; where the flag set it (within the profile, so the size is
        the flag's), the profile's figure, which SGLang does not report then (review, session 86:
        "above 4096" for a flag of 4096 on a host whose profile fits 8.3M tokens)."""
        try:
            asked = wanted_tokens()
        except ValueError:  # no SGLang runtime context (a pool built outside a scheduler: "not published")
            asked = None
        if asked is None:
            return str(self.size)
        return (f"what SGLang's memory profile fits at every layer (the max_total_num_tokens it logs when started "
                f"without the flag; this launch's --max-total-tokens {asked} is within it)")

    def get_kv_size_bytes(self) -> tuple[int, int]:
        half = self.store.dev[0]
        return half.numel() * half.element_size(), half.numel() * half.element_size()

    def _clear_buffers(self) -> None:
        # no copy in flight may outlive the pool it reads and writes (SGLang 0.5.23 itself calls
        # _clear_buffers only from subclasses; teardown is the host pool's finalizer, host_pool.py)
        self.store.engine.quiesce()
        del self.store

    # ----- wiring -------------------------------------------------------------------

    def attach(self, tree_cache: Any, tp_rank: int = 0, dp_rank: int = 0) -> None:
        """Share ``tree_cache.residency_hooks``: frees drop device copies; releases drop wants.
        The stats lines go to TP rank ``tp_rank``'s file of replica ``dp_rank``
        (:func:`settings.rank_output_file`)."""
        base = settings.read_output_file(POOL_STATS_FILE_ENV)  # from the variable: idempotent
        if base is not None:
            self._stats_path = settings.rank_output_file(base, tp_rank, dp_rank)
        if hasattr(tree_cache, "decode_slots_sink"):  # the decode step's slots, read once (HostSlots)
            tree_cache.decode_slots_sink = self.core.continuity.slots.publish
        hooks = getattr(tree_cache, "residency_hooks", None)
        if hooks is not None:
            self.residency_hooks = hooks
            hooks.subscribe(self._on_freed, kinds=[ResidencyEventKind.FREED])
        original_on_release = getattr(tree_cache, "on_release", None)
        if original_on_release is not None and not getattr(tree_cache, "_kvplane_pool_attached", False):
            pool = self

            def on_release(req: Any, *args: Any, **kwargs: Any) -> Any:
                result = original_on_release(req, *args, **kwargs)
                pool.release_request(req.rid)
                return result

            tree_cache.on_release = on_release
            tree_cache._kvplane_pool_attached = True

    def _on_freed(self, event: ResidencyEvent) -> None:
        self.core.page_freed(event.blocks)

    # ----- control-plane facing API ---------------------------------------------------

    def update_residency(self, wants: Mapping[str, RequestResidency]) -> ResidencyDelta:
        """Install the plan's wants and move data now (call at a step boundary only)."""
        return self.core.update_residency(wants)

    def release_request(self, rid: str) -> None:
        """The request finished or was aborted: drop its wants (tree-owned pages stay)."""
        self.core.release_request(rid)

    def holds_wants(self, rid: str) -> bool:
        """Whether the pool holds installed wants of ``rid`` (none after a release: a request
        SGLang retracted and re-admits is installed again, :meth:`PlacementInstaller.install`)."""
        return self.core.holds_wants(rid)

    def free_device_pages(self) -> int:
        """Device layer-pages free now, counting prefix-cache pages that are given up on demand."""
        return self.core.free_device_pages()

    def residency_stats(self) -> ResidencyStats:
        """Device/host occupancy, host fraction of live KV, bytes moved, steps staged / overflowed."""
        return self.core.stats()

    @property
    def recompute_ratio(self) -> float:
        """This launch's ``--kv-recompute-ratio`` (0: every request fetches its prefix)."""
        return float(self._layered_args.kv_recompute_ratio or 0.0)

    @property
    def tables(self) -> StepTables | None:
        """The current forward's tables (None between forwards)."""
        return self.core.tables

    @property
    def overflow(self) -> bool:
        """This step could not be staged inside the budget (served at rest)."""
        return self.core.overflow

    @property
    def overflow_steps(self) -> int:
        return self.core.overflow_steps

    @property
    def token_tables(self) -> bool:
        return self.core.token_tables

    @token_tables.setter
    def token_tables(self, value: bool) -> None:
        self.core.token_tables = value

    # ----- step boundary (from the attention backend) ---------------------------------

    def prepare_step(
        self,
        requests: Sequence[tuple[str | None, torch.Tensor]],
        new_slots: torch.Tensor | None,
        new_counts: Sequence[int] | None = None,
        recompute: np.ndarray | None = None,
        recompute_ids: list | None = None,
    ) -> ResidencyDelta:
        """Boundary before a forward (:meth:`LayeredKVCore.prepare_step`), plus the stats line."""
        delta = self.core.prepare_step(requests, new_slots, new_counts, recompute, recompute_ids)
        self._step += 1
        if self._stats_path is not None:
            self._write_stats_line(len(requests), 0 if new_slots is None else int(new_slots.numel()), delta)
        return delta

    def prepare_decode_step(self, rids: Sequence[str], seq_lens: Sequence[int] | np.ndarray, new_slots: torch.Tensor) -> bool:
        """Steady-decode fast path (:meth:`LayeredKVCore.prepare_decode_step`)."""
        if not self.core.prepare_decode_step(rids, seq_lens, new_slots):
            return False
        self._step += 1
        if self._stats_path is not None:
            delta = self.core.decode_delta if not self.core.store.identity else None
            if delta is None:  # journalled: every layer of each new page is placed
                delta = ResidencyDelta(0, 0, 0, self.layer_num * int(new_slots.numel()), 0, 0, 0, 0)
            self._write_stats_line(len(rids), int(new_slots.numel()), delta)
        return True

    def enter_layer(self, layer_id: int) -> None:
        """Before layer ``layer_id``'s KV write and attention: wait (on the stream) for its fetches."""
        self.core.enter_layer(layer_id - self.start_layer)

    def exit_layer(self, layer_id: int) -> None:
        """After layer ``layer_id``'s attention: write back its staged new tokens, launch next fetches."""
        self.core.exit_layer(layer_id - self.start_layer)

    def _emit_moves(self, moves: LayerPageMoves) -> None:
        if self.residency_hooks.has_subscribers:
            for layer, pages in sorted(moves.offloaded.items()):
                self.residency_hooks.emit(ResidencyEventKind.OFFLOADED, pages, layers=[layer + self.start_layer])
            for layer, pages in sorted(moves.loaded.items()):
                self.residency_hooks.emit(ResidencyEventKind.LOADED, pages, layers=[layer + self.start_layer])

    def _write_stats_line(self, batch_size: int, new_tokens: int, delta: ResidencyDelta) -> None:
        path = self._stats_path
        if not path:
            return
        if self._stats_file is None:
            self._stats_file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - kept open for the pool's life
        line = {
            "source": "layered_pool",
            "step": self._step,
            "time_s": time.monotonic(),
            "batch_size": batch_size,
            "new_tokens": new_tokens,
            "recompute_tokens": self._recompute_tokens(),
            "recompute_layer_rows_total": getattr(self.recompute_forward, "layer_rows", 0),
            # decode tables built without their device half for a graph, and those made after all (declined)
            "deferred_tables": self.store.deferred_tables, "materialized_tables": self.store.materialized_tables,
            **self.residency_stats().to_dict(),
            "delta": {name: getattr(delta, name) for name in delta.__dataclass_fields__},
        }
        self._stats_file.write(json.dumps(line) + "\n")
        self._stats_file.flush()

    def _recompute_tokens(self) -> int:
        """Prefix tokens the current forward recomputes (eLLM, ``docs/recompute.md``)."""
        tables = self.core.tables
        rec = None if tables is None or self.core.overflow else tables.recompute
        return 0 if rec is None else rec.m

    # ----- data path ---------------------------------------------------------------------

    def set_kv_buffer(
        self,
        layer: Any,
        loc_info: Any,
        cache_k: torch.Tensor,
        cache_v: torch.Tensor,
        k_scale: float | None = None,
        v_scale: float | None = None,
        layer_id_override: int | None = None,
        dcp_kv_mask: torch.Tensor | None = None,
    ) -> None:
        """The layer's new KV: into the step's rows (resident pages or staging), no host work.
        A write outside the step's slots (not SGLang's forward path) goes through the at-rest
        path, which waits for copies in flight."""
        if dcp_kv_mask is not None:
            raise ValueError("kvplane layered KV pool: dcp_kv_mask (decode context parallel) is unsupported")
        loc, _, _ = unwrap_write_loc(loc_info)
        layer_id = layer_id_override if layer_id_override is not None else layer.layer_id
        cache_k, cache_v = self.stored_kv(cache_k, cache_v, loc.shape[0], k_scale, v_scale)
        self.core.write(layer_id - self.start_layer, loc, cache_k, cache_v)

    def stored_kv(self, cache_k: torch.Tensor, cache_v: torch.Tensor, n: int, k_scale: float | None = None,
                  v_scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """New K/V of ``n`` tokens as the store keeps them: the pool's dtype (scaled first where
        SGLang passes scales), viewed as the store's, ``[n, H, D]``."""
        if cache_k.dtype != self.dtype:
            if k_scale is not None:
                cache_k.div_(k_scale)
            if v_scale is not None:
                cache_v.div_(v_scale)
            cache_k = cache_k.to(self.dtype)
            cache_v = cache_v.to(self.dtype)
        if self.store_dtype != self.dtype:
            cache_k = cache_k.view(self.store_dtype)
            cache_v = cache_v.view(self.store_dtype)
        if cache_k.dim() != 3 or cache_v.dim() != 3:  # SGLang's attention passes [n, H, D] already
            cache_k = cache_k.reshape(n, self.head_num, self.head_dim)
            cache_v = cache_v.reshape(n, self.head_num, self.head_dim)
        return cache_k, cache_v

    def layer_kv(self, layer_id: int, token_slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ``[n, H, D]`` (pool dtype) of ``token_slots`` at ``layer_id``, read at rest
        (tests and tools; waits for copies in flight -- never called inside a forward)."""
        k, v = self.core.read_kv(layer_id - self.start_layer, token_slots)
        if self.store_dtype != self.dtype:
            return k.view(self.dtype), v.view(self.dtype)
        return k, v

    def layer_in_place(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer indexed by slot id (identity layout; pool dtype; views)."""
        if self._in_place_views is None:
            views = [self.store.layer_in_place(layer) for layer in range(self.layer_num)]
            if self.store_dtype != self.dtype:
                views = [(k.view(self.dtype), v.view(self.dtype)) for k, v in views]
            self._in_place_views = views
        return self._in_place_views[layer_id - self.start_layer]

    def device_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The device page pool as flat K and V rows (pool dtype; views, no copy)."""
        k, v = self.store.device_views()
        if self.store_dtype != self.dtype:
            return k.view(self.dtype), v.view(self.dtype)
        return k, v

    def token_rows(self, layer_id: int) -> torch.Tensor:
        """``[B, W]`` rows of :meth:`device_kv` holding every batch token at ``layer_id`` this
        step (non-identity layout; three device ops from the step's tables)."""
        return self.core.token_rows(layer_id - self.start_layer)

    def move_kv_cache(self, tgt_loc: torch.Tensor, src_loc: torch.Tensor) -> None:
        """SGLang moves slots (every layer), at rest (:meth:`LayeredKVCore.move_kv`)."""
        self.core.move_kv(tgt_loc, src_loc)

    def _no_flat_buffers(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            "kvplane layered KV pool has no per-layer flat KV buffers; read through "
            "layer_kv(layer_id, slots) (use the layered attention backend)"
        )

    get_key_buffer = _no_flat_buffers
    get_value_buffer = _no_flat_buffers
    get_kv_buffer = _no_flat_buffers
    _get_key_buffer = _no_flat_buffers
    _get_value_buffer = _no_flat_buffers
    get_cpu_copy = _no_flat_buffers
    load_cpu_copy = _no_flat_buffers
    get_contiguous_buf_infos = _no_flat_buffers
    get_device_pool_infos = _no_flat_buffers
