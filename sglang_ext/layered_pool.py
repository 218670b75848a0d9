"""LayeredTokenToKVPool: SGLang's MHA KV pool with per-(layer, page) device/host residency.

Swapped in for ``MHATokenToKVPool`` (AROUND ``KVCacheConfigurator._resolve_kv_pool_class``,
kind ``mha``) when ``--enable-layered-kv`` is on, and constructed with its exact kwargs. It
keeps SGLang's logical slot/page space (allocator, ``req_to_token``, radix tree unchanged)
and maps each ``(layer, page)`` to a device page or to its host home
(:class:`~sglang_ext.dataplane.slot_kv_store.SlotKVStore`); residency follows the plan's
wants or a local fallback (:class:`~sglang_ext.dataplane.slot_residency.SlotResidency`).
No full per-layer device buffers are allocated: the device holds ``--kv-gpu-budget-tokens``
token-layers.

Step protocol (scheduler thread, ``--disable-overlap-schedule``):

1. (optional) ``update_residency(wants)`` from the scheduler hooks at the step boundary;
2. ``prepare_step(requests, new_slots)`` from the layered attention backend's
   ``init_forward_metadata``: eager write-back of last step's dirty pages, the batch's
   pages observed, placement reconciled (offloads, onloads, new pages), events emitted,
   a stats line written to ``$KVPLANE_POOL_STATS_FILE`` when set -- or, for a steady decode
   step in the identity layout, ``prepare_decode_step(rids, seq_lens, new_slots)``: only the
   step's new pages placed (same result, no per-request slot reads);
3. per layer: ``set_kv_buffer`` (device page if resident, else host) then
   ``layer_kv(layer, slots)``.

``attach(tree_cache)`` (plugin's radix factory) subscribes to the tree's residency hub:
``freed`` pages drop their device copies; ``on_release`` of a request releases its wants;
``offloaded`` / ``loaded`` events go out on the same hub.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import structlog
import torch
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, unwrap_write_loc

from sglang_ext.args import LayeredKVArgs
from sglang_ext.dataplane.slot_kv_store import SlotKVStore, SlotStoreConfig
from sglang_ext.dataplane.slot_residency import SlotResidency
from sglang_ext.dataplane.slot_results import RequestResidency, ResidencyDelta, ResidencyStats
from sglang_ext.hooks import ResidencyEvent, ResidencyEventKind, ResidencyHooks

log = structlog.get_logger(__name__)

POOL_STATS_FILE_ENV = "KVPLANE_POOL_STATS_FILE"
"""If set, one JSON line per forward (source ``layered_pool``) with the pool's residency stats
and the boundary's delta is appended to this file. The per-step scheduler line (step time,
placements, pauses, and these stats under ``pool``) is ``$KVPLANE_STATS_FILE``, written by
:mod:`sglang_ext.scheduler_hooks`."""

_GB = 1e9
WRITEBACK_FREE_SHARE = 0.25
"""Eager write-back runs at a step boundary when fewer than this share of device pages are free."""


class LayeredTokenToKVPool(MHATokenToKVPool):
    """MHA KV pool whose layers live partly on the device, partly in host memory."""

    def __init__(self, *args: Any, layered_args: LayeredKVArgs | None = None, **kwargs: Any) -> None:
        self._layered_args = layered_args if layered_args is not None else LayeredKVArgs.from_env()
        if kwargs.get("enable_kv_cache_copy"):
            raise ValueError("kvplane layered KV pool: enable_kv_cache_copy (speculative decoding) is unsupported")
        if kwargs.get("post_capture_active"):
            raise ValueError("kvplane layered KV pool: post-capture KV backing is unsupported")
        if kwargs.get("quant_method") is not None:
            raise ValueError("kvplane layered KV pool: quantized KV caches are unsupported")
        self.residency_hooks = ResidencyHooks()
        self._in_place_step = False
        """This forward's batch is resident in the identity layout (set by readable_in_place)."""
        self._step = 0
        self._owners_cache = np.zeros(0, dtype=np.int64)
        self._step_loc: torch.Tensor | None = None
        """``new_slots`` of this forward (its K/V writes hit these slots at every layer)."""
        self._in_place_views: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self._stats_file = None
        self._stats_path = os.environ.get(POOL_STATS_FILE_ENV) or None
        super().__init__(*args, **kwargs)

    # ----- construction (called from MHATokenToKVPool.__init__) --------------------

    def _create_buffers(self) -> None:
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
        if budget_tokens is None:
            # every layer of every page (what SGLang's own pool holds, plus the padding page):
            # the store then uses the identity layout and attention reads it in place
            device_pages = logical_pages * self.layer_num
        else:
            device_pages = budget_tokens // self.page_size
            if device_pages < 1:
                raise ValueError(
                    f"--kv-gpu-budget-tokens={budget_tokens} is below one page ({self.page_size} tokens)"
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
        )
        host_limit = self._layered_args.kv_host_pool_gb * _GB
        if config.host_bytes > host_limit:
            raise ValueError(
                f"--kv-host-pool-gb={self._layered_args.kv_host_pool_gb}: the host pool must hold every "
                f"layer of {logical_pages} pages = {config.host_bytes / _GB:.3f} GB; raise it or lower "
                "--max-total-tokens"
            )
        self.store = SlotKVStore(config)
        self.residency = SlotResidency(self.store)
        log.info(
            "layered_kv_pool_created",
            layers=self.layer_num,
            page_size=self.page_size,
            logical_pages=logical_pages,
            device_pages=device_pages,
            host_gb=round(config.host_bytes / _GB, 4),
        )

    def get_kv_size_bytes(self) -> tuple[int, int]:
        half = self.store.dev[0]
        return half.numel() * half.element_size(), half.numel() * half.element_size()

    def _clear_buffers(self) -> None:
        del self.store

    # ----- wiring -------------------------------------------------------------------

    def attach(self, tree_cache: Any) -> None:
        """Share ``tree_cache.residency_hooks``: frees drop device copies; releases drop wants."""
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
        self.residency.page_freed(list(event.blocks))

    # ----- control-plane facing API ---------------------------------------------------

    def update_residency(self, wants: Mapping[str, RequestResidency]) -> ResidencyDelta:
        """Install the plan's wants and move data now (call at a step boundary only)."""
        self.residency.update_residency(wants)
        self._eager_writeback()
        return self._reconcile()

    def release_request(self, rid: str) -> None:
        """The request finished or was aborted: drop its wants (tree-owned pages stay)."""
        self.residency.release_request(rid)

    def free_device_pages(self) -> int:
        """Device layer-pages free now, counting prefix-cache pages that are given up on demand
        (cheap: the allocator's count plus the last reconciliation's reclaimable count)."""
        return self.store.allocator.free_count + self.residency.reclaimable_pages

    def residency_stats(self) -> ResidencyStats:
        """Device/host occupancy, host fraction of live KV, bytes moved."""
        return self.residency.stats()

    # ----- step boundary (from the attention backend) ---------------------------------

    def prepare_step(
        self, requests: Sequence[tuple[str | None, torch.Tensor]], new_slots: torch.Tensor | None
    ) -> ResidencyDelta:
        """Boundary before a forward: ``requests`` = (rid, slots of its first seq_len tokens).

        Positions ``[i * page_size, (i + 1) * page_size)`` of a request share one page (SGLang's
        paged allocation), so its pages are ``slots[::page_size] // page_size``.
        """
        self._in_place_step = False
        self._step_loc = new_slots
        self.residency.drop_anonymous()
        self._eager_writeback()
        ps = self.page_size
        for index, (rid, slots) in enumerate(requests):
            # kept by residency, so never a view of req_to_token (a fresh CPU int64 tensor, as
            # the attention backend passes, is kept as it is)
            fresh = slots.device.type == "cpu" and slots.dtype == torch.int64 and slots._base is None
            pages = slots if fresh else slots.to("cpu", torch.int64, copy=True)
            if ps > 1:
                pages = pages[::ps] // ps  # position order; one slot per page
            if rid is None:
                self.residency.observe(f"__anonymous_{index}", pages, anonymous=True)
            else:
                self.residency.observe(rid, pages)
        delta = self._reconcile()
        if new_slots is not None and new_slots.numel():
            written = new_slots.to("cpu", torch.int64)
            self.residency.mark_written(written if ps == 1 else torch.unique(written // ps))
        self._step += 1
        self._write_stats_line(len(requests), 0 if new_slots is None else int(new_slots.numel()), delta)
        return delta

    def prepare_decode_step(self, rids: Sequence[str], seq_lens: Sequence[int] | np.ndarray, new_slots: torch.Tensor) -> bool:
        """:meth:`prepare_step` for a steady decode step, or False (nothing done) when it does not apply.

        Applies when the caller knows that every request of ``rids`` ran the previous forward
        with ``seq_lens - 1`` tokens (same requests, one new token each) and the store is in the
        identity layout with every live layer-page resident: then the step's only residency
        change is the new pages of ``new_slots`` (``out_cache_loc``; slot ``i`` is request
        ``i``'s new token), placed at every layer without re-reading any request's slots. The
        result equals the general path's; the forward reads in place (:meth:`readable_in_place`).
        """
        self._in_place_step = False
        if new_slots.device.type != "cpu" or new_slots.numel() != len(rids) or self.residency.has_anonymous:
            return False
        slots = new_slots.numpy()
        if slots.dtype != np.int64:
            slots = slots.astype(np.int64)
        ps = self.page_size
        if ps == 1:
            owners, pages = self._owners(slots.size), slots
        else:
            lens = np.asarray(seq_lens, dtype=np.int64)
            owners = np.flatnonzero((lens - 1) % ps == 0)  # the token opens a new page
            pages = slots[owners] // ps
        if not self.residency.append_decode_identity(rids, owners, pages):
            return False
        self._step_loc = new_slots
        self._in_place_step = True
        self.store.mark_dirty_np(slots if ps == 1 else np.unique(slots // ps))
        self._step += 1
        if self._stats_path is not None:
            self._write_stats_line(len(rids), int(slots.size), ResidencyDelta(0, 0, 0, self.layer_num * int(pages.size), 0, 0, 0, 0))
        return True

    def _owners(self, n: int) -> np.ndarray:
        """``arange(n)`` (read-only, cached: the batch size rarely changes between steps)."""
        if self._owners_cache.size != n:
            self._owners_cache = np.arange(n, dtype=np.int64)
            self._owners_cache.flags.writeable = False
        return self._owners_cache

    def _eager_writeback(self) -> None:
        """Write dirty device layer-pages back to host at the boundary -- under memory pressure only.

        SuperInfer §4.3.2 (eager block rotation): with host copies current, a later offload only
        drops the device copy. While the device pool has room (free share at least
        :data:`WRITEBACK_FREE_SHARE`) no offload is near, so the copy is deferred:
        :meth:`SlotKVStore.offload` writes back any dirty page itself before dropping it, so
        correctness never depends on this call. The identity layout (the budget holds every
        layer-page) never has to make room, so it never writes back eagerly.
        """
        allocator = self.store.allocator
        if not self.store.identity and allocator.free_count < WRITEBACK_FREE_SHARE * allocator.capacity:
            self.store.sync_dirty()

    def _reconcile(self) -> ResidencyDelta:
        delta = self.residency.reconcile()
        moves = self.residency.last_moves
        if self.residency_hooks.has_subscribers:
            for layer, pages in sorted(moves.offloaded.items()):
                self.residency_hooks.emit(ResidencyEventKind.OFFLOADED, pages, layers=[layer + self.start_layer])
            for layer, pages in sorted(moves.loaded.items()):
                self.residency_hooks.emit(ResidencyEventKind.LOADED, pages, layers=[layer + self.start_layer])
        return delta

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
            **self.residency_stats().to_dict(),
            "delta": {name: getattr(delta, name) for name in delta.__dataclass_fields__},
        }
        self._stats_file.write(json.dumps(line) + "\n")
        self._stats_file.flush()

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
        if dcp_kv_mask is not None:
            raise ValueError("kvplane layered KV pool: dcp_kv_mask (decode context parallel) is unsupported")
        loc, _, _ = unwrap_write_loc(loc_info)
        layer_id = layer_id_override if layer_id_override is not None else layer.layer_id
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
        n = loc.numel()
        if self._in_place_step:  # the forward's own slots, all resident in the identity layout
            self.store.write_in_place(
                layer_id - self.start_layer,
                loc,
                cache_k.reshape(n, self.head_num, self.head_dim),
                cache_v.reshape(n, self.head_num, self.head_dim),
                mark_dirty=loc is not self._step_loc,  # readable_in_place marked those already
            )
            return
        self.store.write(
            layer_id - self.start_layer,
            loc,
            cache_k.reshape(n, self.head_num, self.head_dim),
            cache_v.reshape(n, self.head_num, self.head_dim),
        )

    def layer_kv(self, layer_id: int, token_slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ``[n, H, D]`` (pool dtype) of ``token_slots`` at ``layer_id``."""
        k, v = self.store.gather(layer_id - self.start_layer, token_slots)
        if self.store_dtype != self.dtype:
            return k.view(self.dtype), v.view(self.dtype)
        return k, v

    def device_rows(self, layer_id: int, token_slots: torch.Tensor) -> torch.Tensor | None:
        """Rows of ``token_slots`` in :meth:`device_kv` at ``layer_id`` if all are on the device."""
        return self.store.device_rows(layer_id - self.start_layer, token_slots)

    def readable_in_place(self, token_slots: torch.Tensor) -> bool:
        """Identity layout and every layer of these slots' pages on the device: attention may read
        :meth:`layer_in_place` with SGLang's own slot ids this step (no table, no copy)."""
        self._in_place_step = False
        if not self.store.identity:
            return False
        # the batch's pages all belong to live requests, so the cheap residency test suffices
        ok = self.residency.all_live_resident() or self.store.all_resident(
            token_slots.to("cpu", torch.int64) // self.page_size
        )
        self._in_place_step = ok
        loc = self._step_loc
        if ok and loc is not None and loc.numel():
            # the forward writes these slots at every layer: dirty once here, not per layer
            self.store.mark_dirty(loc if self.page_size == 1 else loc // self.page_size)
        return ok

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

    def move_kv_cache(self, tgt_loc: torch.Tensor, src_loc: torch.Tensor) -> None:
        for layer in range(self.layer_num):
            k, v = self.store.gather(layer, src_loc)
            self.store.write(layer, tgt_loc, k.clone(), v.clone())
        self.residency.mark_written(torch.unique(tgt_loc.to("cpu", torch.int64) // self.page_size))

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
