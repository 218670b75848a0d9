"""LayeredRadixCache: SGLang's RadixCache with KV residency hooks (``--radix-cache-backend layered``).

Prefix sharing is SGLang's own (match, insert, lock, LRU eviction are inherited
unchanged); this class only observes block ownership and reports it through
:class:`~sglang_ext.hooks.ResidencyHooks`:

- ``allocated`` / ``extended``: from :meth:`on_alloc_extend` / :meth:`on_alloc_decode`,
  called by the plugin's AFTER hooks on ``mem_cache.allocation.alloc_for_extend`` and
  ``alloc_for_decode`` (the two functions every non-speculative batch allocates through).
- ``checkpointed``: a tree insert that created a node (the request's blocks now belong
  to the tree and can be shared).
- ``evicted``: a leaf the tree dropped (its blocks are freed right after).
- ``freed``: every page the allocator gets back, observed on the allocator instance
  (``free`` / ``free_group_end`` for the token allocator, ``_release_page_ids`` for
  paged ones), so frees made outside the tree (over-allocation, aborts) are seen too;
  ``flush_cache`` (``reset`` then ``allocator.clear()``) reports the tree's blocks
  evicted and freed. ``rid`` on ``freed`` is best effort (set when the free happens
  inside ``checkpoint`` / ``free_kv_row`` of a known request, None for tree evictions).

``extended``, ``checkpointed`` and ``evicted`` are built only when a subscriber receives them
(SGLang inserts a running request into the tree every few steps; by default only ``freed``,
which the layered pool needs, has a subscriber). Building one is metered (``radix``).

Not covered (rejected at construction or documented): speculative decoding and PD
disaggregation allocate through other paths.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import structlog
import torch

from sglang_ext.compat import RadixCache, TreeNode
from sglang_ext.hooks import ResidencyEventKind, ResidencyHooks

log = structlog.get_logger(__name__)

_K = ResidencyEventKind


class LayeredRadixCache(RadixCache):
    """RadixCache that emits residency events; ``residency_hooks`` is the public hub."""

    def __init__(self, params: Any, hooks: ResidencyHooks | None = None) -> None:
        self.residency_hooks = hooks or ResidencyHooks()
        self.overhead_meter: Any = None
        """The process's overhead meter (set by the scheduler hooks when it is on): the per-step
        allocation wrappers count as kvplane time (``radix``)."""
        self.decode_slots_sink: Callable[[list[str], list[int], list[int]], None] | None = None
        """Takes a decode step's new slots with the host list read here (the layered pool's
        :class:`~sglang_ext.dataplane.host_slots.HostSlots`: its boundary reads nothing back)."""
        self._owner_rid: str | None = None
        self._rid_of_row: dict[int, str] = {}
        self._live_blocks: set[int] = set()
        super().__init__(params)
        if self.token_to_kv_pool_allocator is not None:
            self._instrument_allocator(self.token_to_kv_pool_allocator)

    # ----- ownership context -------------------------------------------------

    @contextlib.contextmanager
    def _owned_by(self, rid: str | None) -> Iterator[None]:
        previous, self._owner_rid = self._owner_rid, rid
        try:
            yield
        finally:
            self._owner_rid = previous

    def _blocks_of_slots(self, slots: torch.Tensor) -> list[int]:
        cpu = slots.to("cpu", torch.int64)
        return sorted(set((cpu // self.page_size if self.page_size > 1 else cpu).tolist()))

    def _new_blocks(self, slots: torch.Tensor) -> list[int]:
        """Pages that start inside ``slots`` (offset 0): the pages this allocation opened."""
        cpu = slots.to("cpu", torch.int64)
        return (cpu[cpu % self.page_size == 0] // self.page_size).tolist()

    # ----- allocator instrumentation (frees) ---------------------------------

    def _instrument_allocator(self, allocator: Any) -> None:
        """Wrap the allocator *instance* so every page it gets back is reported once."""
        if getattr(allocator, "_kvplane_instrumented", False):
            return
        cache = self
        if hasattr(allocator, "_release_page_ids"):
            original_release = allocator._release_page_ids

            def release_page_ids(*page_ids: torch.Tensor) -> Any:
                t0 = time.perf_counter()
                for ids in page_ids:
                    cache._report_freed(ids.to("cpu", torch.int64).tolist())
                cache._metered(t0)
                return original_release(*page_ids)

            allocator._release_page_ids = release_page_ids
        else:
            original_free = allocator.free
            original_group_end = allocator.free_group_end
            deferred: list[tuple[str | None, list[int]]] = []
            flushing = [False]

            def free(free_index: torch.Tensor) -> Any:
                t0 = time.perf_counter()
                if free_index.numel() > 0 and not flushing[0]:
                    blocks = cache._blocks_of_slots(free_index)
                    if allocator.free_group is None:
                        cache._report_freed(blocks)
                    else:  # returned at free_group_end(); keep who freed them
                        deferred.append((cache._owner_rid, blocks))
                cache._metered(t0)
                return original_free(free_index)

            def free_group_end() -> Any:
                if not deferred:  # nothing freed in the group (SGLang opens one every decode step):
                    return original_group_end()  # nothing of kvplane's to do, nothing to meter
                flushing[0] = True
                try:
                    result = original_group_end()
                finally:
                    flushing[0] = False
                t0 = time.perf_counter()
                pending = list(deferred)
                deferred.clear()
                for rid, blocks in pending:
                    with cache._owned_by(rid):
                        cache._report_freed(blocks)
                cache._metered(t0)
                return result

            allocator.free = free
            allocator.free_group_end = free_group_end
        original_clear = allocator.clear

        def clear() -> Any:
            t0 = time.perf_counter()
            cache._report_freed(sorted(cache._live_blocks))
            cache._rid_of_row.clear()
            cache._metered(t0)
            return original_clear()

        allocator.clear = clear
        allocator._kvplane_instrumented = True

    def _metered(self, t0: float, part: str = "radix") -> None:
        """kvplane's time since ``t0`` (allocation and free wrappers: ``radix``) into the meter."""
        meter = self.overhead_meter
        if meter is not None:
            meter.add(part, time.perf_counter() - t0)

    def meter_on_release(self) -> None:
        """Time the ``on_release`` chain -- kvplane's wrappers (the pool's release, placement
        info) around SGLang's, which is a no-op for the radix tree -- into the meter's
        ``release`` part. Called once every wrapper is installed."""
        inner = self.on_release
        cache = self

        def on_release(req: Any, *args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return inner(req, *args, **kwargs)
            finally:
                cache._metered(t0, "release")

        self.on_release = on_release

    def _report_freed(self, blocks: list[int]) -> None:
        if not blocks:
            return
        self._live_blocks.difference_update(blocks)
        self.residency_hooks.emit(_K.FREED, blocks, rid=self._owner_rid)

    # ----- allocation (called from the plugin's allocation hooks) ------------

    def _report_allocated(self, req: Any, slots: torch.Tensor) -> None:
        self._allocated(req, self._new_blocks(slots))

    def _allocated(self, req: Any, blocks: list[int]) -> None:
        if not blocks:
            return
        self._live_blocks.update(blocks)
        self._claim(req, blocks)

    def _claim(self, req: Any, blocks: list[int]) -> None:
        """``req`` got ``blocks`` (already in the live set): its row's owner, and the event if
        anyone subscribed to it (per decode token: the unwanted event is never built)."""
        rid = req.rid
        row = req.kv.req_pool_idx
        first = self._rid_of_row.get(row) != rid
        if row is not None and first:
            self._rid_of_row[row] = rid
        kind = _K.ALLOCATED if first else _K.EXTENDED
        if self.residency_hooks.wants(kind):
            self.residency_hooks.emit(kind, blocks, rid=rid)

    def on_alloc_extend(self, batch: Any, out_cache_loc: torch.Tensor) -> None:
        """Attribute an extend batch's new slots (concatenated in request order) to requests."""
        t0 = time.perf_counter()
        self._on_alloc_extend(batch, out_cache_loc)
        self._metered(t0)

    def on_alloc_decode(self, batch: Any, out_cache_loc: torch.Tensor, token_per_req: int) -> None:
        """Attribute a decode batch's new slots (``token_per_req`` each, request order)."""
        t0 = time.perf_counter()
        self._on_alloc_decode(batch, out_cache_loc, token_per_req)
        self._metered(t0)

    def _on_alloc_extend(self, batch: Any, out_cache_loc: torch.Tensor) -> None:
        offset = 0
        for req, extend_len in zip(batch.reqs, batch.extend_lens, strict=True):
            self._report_allocated(req, out_cache_loc[offset : offset + extend_len])
            offset += extend_len

    def _on_alloc_decode(self, batch: Any, out_cache_loc: torch.Tensor, token_per_req: int) -> None:
        if token_per_req != 1:
            for i, req in enumerate(batch.reqs):
                self._report_allocated(req, out_cache_loc[i * token_per_req : (i + 1) * token_per_req])
            return
        # One slot per request: one host copy for the batch (on CUDA one read of the device's
        # slots per step, not one per request)
        blocks = out_cache_loc.tolist()
        if self.decode_slots_sink is not None and batch.seq_lens_cpu is not None:
            # the step: its requests and their lengths with the new token
            self.decode_slots_sink([req.rid for req in batch.reqs], (batch.seq_lens_cpu + 1).tolist(), blocks)
        ps = self.page_size
        if ps != 1:  # a slot at offset 0 opens its page; the others continue one already reported
            for req, slot in zip(batch.reqs, blocks, strict=True):
                if slot % ps == 0:
                    self._allocated(req, [slot // ps])
            return
        # every slot opens its page: one live-set update for the batch
        self._live_blocks.update(blocks)
        rid_of_row, extended = self._rid_of_row, self.residency_hooks.wants(_K.EXTENDED)
        for req, block in zip(batch.reqs, blocks, strict=True):
            if extended or rid_of_row.get(req.kv.req_pool_idx) != req.rid:  # an event, or a new owner
                self._claim(req, [block])

    # ----- tree hand-over, release, eviction ---------------------------------

    def checkpoint(self, req: Any, *, up_to: int, **kwargs: Any) -> None:
        with self._owned_by(req.rid):  # frees inside belong to req
            super().checkpoint(req, up_to=up_to, **kwargs)

    def _insert_helper(self, node: TreeNode, key: Any, value: Any, priority: int = 0, inserted_len: int = 0):
        prefix_len, last_node = super()._insert_helper(node, key, value, priority, inserted_len)
        # the event's blocks are read only when somebody listens (SGLang checkpoints a running
        # request every few steps; by default nobody subscribes to CHECKPOINTED)
        if (prefix_len < len(key) and value is not None and self._owner_rid is not None
                and self.residency_hooks.wants(_K.CHECKPOINTED)):
            t0 = time.perf_counter()
            self.residency_hooks.emit(_K.CHECKPOINTED, self._blocks_of_slots(last_node.value), rid=self._owner_rid)
            self._metered(t0)
        return prefix_len, last_node

    def free_kv_row(self, kv: Any, ranges: list[tuple[int, int]]) -> None:
        with self._owned_by(self._rid_of_row.pop(kv.req_pool_idx, None)):
            super().free_kv_row(kv, ranges)

    def _delete_leaf(self, node: TreeNode) -> None:
        if self.residency_hooks.wants(_K.EVICTED):  # the freed pages are reported by the allocator
            t0 = time.perf_counter()
            self.residency_hooks.emit(_K.EVICTED, self._blocks_of_slots(node.value))
            self._metered(t0)
        super()._delete_leaf(node)

    def reset(self) -> None:
        if getattr(self, "root_node", None) is not None and self.residency_hooks.wants(_K.EVICTED):
            held: list[int] = []
            stack = list(self.root_node.children.values())
            while stack:
                node = stack.pop()
                held.extend(self._blocks_of_slots(node.value))
                stack.extend(node.children.values())
            if held:
                self.residency_hooks.emit(_K.EVICTED, sorted(held))
        super().reset()
