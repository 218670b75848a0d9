"""PlacementInstaller: placement delta -> minimum data movement, in two phases.

``prepare(targets) -> PlacementOp | None``: computes the delta against the installed placement,
reserves device blocks (reclaiming paused requests' layers if needed; None when even that cannot
fit) and launches the copies: D2H of the *unsynced* blocks of layers going to host (normally
only the dirty tail block, thanks to eager write-back) and H2D of layers coming back. Nothing in
the block tables changes, so the old placement is intact.

``complete(op, success)``: waits for the copies; on success swaps the tables and frees the old
device blocks; on failure frees the reserved blocks and leaves everything as it was.

Staging slots move with zero allocation where possible: a request that starts offloading takes
the blocks of its first offloaded layer as its staging slot; a request that stops offloading
fetches its first onloaded layer straight into its staging slot.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sglang_ext.dataplane.layered_kv_cache import LayeredKVCache


@dataclass(frozen=True)
class PlacementOp:
    """A prepared placement change (see module docstring)."""

    targets: Mapping[str, tuple[int, ...]]
    """Target placement per request id."""
    offloads: tuple[tuple[str, int], ...]
    """(request, layer) pairs going to host memory."""
    onloads: tuple[tuple[str, int, tuple[int, ...]], ...]
    """(request, layer, destination device blocks) pairs coming back."""
    staging_from_layer: Mapping[str, int]
    """Request -> offloaded layer whose blocks become its staging slot."""
    staging_to_layer: Mapping[str, int]
    """Request -> onloaded layer that takes over its staging slot's blocks."""
    staging_alloc: Mapping[str, tuple[int, ...]]
    """Request -> newly allocated staging slot."""
    new_blocks: tuple[int, ...]
    """Every device block reserved by prepare (freed again on failure)."""
    d2h_blocks: int
    """Layer-blocks written back to host."""
    h2d_blocks: int
    """Layer-blocks fetched to the device."""
    reclaimed_layers: int
    """Paused requests' layers dropped to make room."""
    events: tuple[Any, ...]
    """Transfer events complete() waits for."""


class PlacementInstaller:
    """Two-phase placement changes on a :class:`LayeredKVCache` (uses its internals)."""

    def __init__(self, cache: LayeredKVCache) -> None:
        self.cache = cache

    def blocks_needed(self, targets: Mapping[str, tuple[int, ...]]) -> int:
        """Net device blocks ``targets`` add over the installed placement (may be negative)."""
        c = self.cache
        total = 0
        for rid, tgt in targets.items():
            t = c._reqs[rid]
            final = t.blocks * (sum(tgt) + (1 if 0 in tgt else 0))
            total += final - len(t.device_block_ids())
        return total

    def prepare(self, targets: Mapping[str, tuple[int, ...]]) -> PlacementOp | None:
        c = self.cache
        need = 0
        from_layer: dict[str, int] = {}
        to_layer: dict[str, int] = {}
        alloc_staging: list[str] = []
        offloads: list[tuple[str, int]] = []
        onload_req: list[tuple[str, int]] = []
        for rid, tgt in targets.items():
            t = c._reqs[rid]
            cur = t.placement
            off = [layer for layer in range(t.layers) if cur[layer] and not tgt[layer]]
            on = [layer for layer in range(t.layers) if tgt[layer] and not cur[layer]]
            offloads += [(rid, layer) for layer in off]
            onload_req += [(rid, layer) for layer in on]
            needs_stage, has_stage = 0 in tgt, t.staging is not None
            if needs_stage and not has_stage:
                if off:
                    from_layer[rid] = off[0]
                else:
                    alloc_staging.append(rid)
                    need += t.blocks
            if has_stage and not needs_stage:
                to_layer[rid] = on[0]
            need += t.blocks * len(on) - (t.blocks if rid in to_layer else 0)
        alloc = c.device_pool.allocator
        reclaimed = 0
        if need > alloc.free_count:
            if need > alloc.free_count + c.reclaimable_blocks():
                return None
            reclaimed = c._reclaim(need)
        new_blocks = alloc.alloc(need)
        if new_blocks is None:  # pragma: no cover - guarded above
            return None
        cursor = 0

        def take(n: int) -> tuple[int, ...]:
            nonlocal cursor
            out = tuple(new_blocks[cursor : cursor + n])
            cursor += n
            return out

        staging_alloc = {rid: take(c._reqs[rid].blocks) for rid in alloc_staging}
        onloads: list[tuple[str, int, tuple[int, ...]]] = []
        for rid, layer in onload_req:
            t = c._reqs[rid]
            if to_layer.get(rid) == layer:
                dest = tuple(t.staging or ())
            else:
                dest = take(t.blocks)
            onloads.append((rid, layer, dest))
        # D2H: only blocks whose host copy is stale (eager write-back did the rest).
        dev_segs: list[int] = []
        host_segs: list[int] = []
        d2h_blocks = 0
        for rid, layer in offloads:
            t = c._reqs[rid]
            dev = t.dev[layer] or []
            js = range(t.synced[layer], t.blocks)
            dev_segs += c.device_pool.segs([dev[j] for j in js])
            host_segs += c.host_pool.segs([t.host_blocks[j] for j in js], layer)
            d2h_blocks += len(js)
        ev_d = c.engine.d2h(dev_segs, host_segs)
        h_src: list[int] = []
        h_dst: list[int] = []
        h2d_blocks = 0
        for rid, layer, dest in onloads:
            t = c._reqs[rid]
            h_src += c.host_pool.segs(t.host_blocks, layer)
            h_dst += c.device_pool.segs(list(dest))
            h2d_blocks += len(dest)
        ev_h = c.engine.h2d(h_src, h_dst, wait=[c._last_tail_d2h, ev_d])
        return PlacementOp(
            targets=dict(targets),
            offloads=tuple(offloads),
            onloads=tuple(onloads),
            staging_from_layer=from_layer,
            staging_to_layer=to_layer,
            staging_alloc=staging_alloc,
            new_blocks=tuple(new_blocks),
            d2h_blocks=d2h_blocks,
            h2d_blocks=h2d_blocks,
            reclaimed_layers=reclaimed,
            events=(ev_d, ev_h),
        )

    def complete(self, op: PlacementOp, success: bool) -> None:
        c = self.cache
        c.engine.host_wait(list(op.events))
        alloc = c.device_pool.allocator
        if not success:
            alloc.free(list(op.new_blocks))
            return
        c.engine.quiesce()  # eager write-backs may still read blocks we are about to free
        for rid, layer in op.offloads:
            t = c._reqs[rid]
            blocks = t.dev[layer] or []
            t.dev[layer] = None
            t.synced[layer] = 0
            if op.staging_from_layer.get(rid) == layer:
                t.staging = list(blocks)
            else:
                alloc.free(blocks)
        for rid, layer, dest in op.onloads:
            t = c._reqs[rid]
            t.dev[layer] = list(dest)
            t.synced[layer] = t.blocks  # the host copy of an offloaded layer is complete
        for rid in op.staging_to_layer:
            c._reqs[rid].staging = None
        for rid, blocks in op.staging_alloc.items():
            c._reqs[rid].staging = list(blocks)
