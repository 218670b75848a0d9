"""LayeredKVCache: per-request, per-layer KV residency over a shared device pool.

Public API (the SGLang plugin's entry points; see README.md for the step protocol):

* lifecycle: ``alloc_request``, ``append_tokens``, ``fork_prefix``, ``free``, ``pause``, ``resume``
* placement: ``install_placement`` (or ``prepare_placement`` / ``complete_placement``)
* one forward step: ``begin_step``, then per layer ``wait_layer``, ``layer_view``, ``end_layer``,
  then ``end_step``
* queries: ``placement``, ``placements``, ``memory_usage``, ``read_kv``, ``check_invariants``

Every mutating call validates first and raises (:mod:`sglang_ext.dataplane.errors`) before
changing anything, so a refused call loses no KV.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import structlog
import torch

from kernels.block_copy import copy_segments
from sglang_ext.dataplane.config import LayeredKVConfig
from sglang_ext.dataplane.errors import (
    DevicePoolFull,
    HostPoolFull,
    RequestStateError,
    UnknownRequest,
)
from sglang_ext.dataplane.kv_pools import DevicePool, HostPool
from sglang_ext.dataplane.placement_installer import PlacementInstaller, PlacementOp
from sglang_ext.dataplane.request_table import RequestTable
from sglang_ext.dataplane.results import AppendResult, InstallReport, MemoryUsage
from sglang_ext.dataplane.step_protocol import StepProtocol, StepState
from sglang_ext.dataplane.transfer_engine import make_transfer_engine

log = structlog.get_logger(__name__)


class LayeredKVCache(StepProtocol):
    """The layered KV data plane of one model (one TP rank). See module docstring."""

    def __init__(self, config: LayeredKVConfig) -> None:
        self.config = config
        self.device_pool = DevicePool(config)
        self.host_pool = HostPool(config)
        self.engine = make_transfer_engine(self.host_pool.segments, self.device_pool.segments)
        self._reqs: dict[str, RequestTable] = {}
        self._step: StepState | None = None
        self._op: PlacementOp | None = None
        self._pause_seq = 0
        self._last_tail_d2h: Any = None
        self._installer = PlacementInstaller(self)

    # ------------------------------------------------------------------ queries
    def __contains__(self, rid: object) -> bool:
        return rid in self._reqs

    def _req(self, rid: str) -> RequestTable:
        try:
            return self._reqs[rid]
        except KeyError:
            raise UnknownRequest(rid) from None

    def placement(self, rid: str) -> tuple[int, ...]:
        """Installed placement of ``rid`` (for a paused request: what is still on the device)."""
        return self._req(rid).placement

    def placements(self) -> dict[str, tuple[int, ...]]:
        """Installed placement of every active (not paused) request."""
        return {r: t.placement for r, t in self._reqs.items() if not t.paused}

    def tokens(self, rid: str) -> int:
        """Tokens in ``rid``'s context."""
        return self._req(rid).tokens

    def blocks(self, rid: str) -> int:
        """b_r: blocks per layer of ``rid``."""
        return self._req(rid).blocks

    def is_paused(self, rid: str) -> bool:
        """True while ``rid`` is paused."""
        return self._req(rid).paused

    def reclaimable_blocks(self) -> int:
        """Device blocks held by paused requests."""
        return sum(len(t.device_block_ids()) for t in self._reqs.values() if t.paused)

    def memory_usage(self) -> MemoryUsage:
        """Device blocks by role."""
        resident = staging = 0
        for t in self._reqs.values():
            if t.paused:
                continue
            resident += t.blocks * sum(t.placement)
            staging += len(t.staging or ())
        alloc = self.device_pool.allocator
        return MemoryUsage(
            resident_blocks=resident,
            staging_blocks=staging,
            removable_blocks=self.reclaimable_blocks(),
            free_blocks=alloc.free_count,
            capacity_blocks=alloc.capacity,
        )

    # ------------------------------------------------------------------ validation
    def _check_idle(self, what: str) -> None:
        if self._step is not None:
            raise RequestStateError(f"{what}: a step is in flight (call end_step first)")
        if self._op is not None:
            raise RequestStateError(f"{what}: a placement change is prepared but not completed")

    def _check_active(self, t: RequestTable, what: str) -> None:
        if t.paused:
            raise RequestStateError(f"{what}: request {t.rid!r} is paused (resume it first)")

    def _validate_placement(self, rid: str, row: Sequence[int]) -> tuple[int, ...]:
        layers = self.config.layers
        if isinstance(row, str | bytes) or len(row) != layers:
            raise ValueError(f"placement[{rid!r}] must have {layers} entries of 0/1, got {row!r}")
        out = []
        for i, x in enumerate(row):
            if x not in (0, 1) or isinstance(x, float):
                raise ValueError(f"placement[{rid!r}][{i}] = {x!r}; allowed values: 0, 1")
            out.append(int(x))
        return tuple(out)

    def _validate_targets(self, placements: Mapping[str, Sequence[int]], what: str) -> dict[str, tuple[int, ...]]:
        targets: dict[str, tuple[int, ...]] = {}
        for rid, row in placements.items():
            t = self._req(rid)
            self._check_active(t, what)
            if t.pending_start is not None:
                raise RequestStateError(f"{what}: request {rid!r} has appended tokens not yet written by a step")
            tgt = self._validate_placement(rid, row)
            if tgt != t.placement:
                targets[rid] = tgt
        return targets

    # ------------------------------------------------------------------ lifecycle
    def alloc_request(self, rid: str, placement: Sequence[int] | None = None) -> None:
        """Register an empty request; ``placement`` defaults to all layers resident."""
        if not isinstance(rid, str) or not rid:
            raise ValueError(f"request id must be a non-empty string, got {rid!r}")
        if rid in self._reqs:
            raise RequestStateError(f"alloc_request: request {rid!r} already exists")
        t = RequestTable(rid, self.config.layers)
        if placement is not None:
            tgt = self._validate_placement(rid, placement)
            t.dev = [[] if x else None for x in tgt]
            if 0 in tgt:
                t.staging = []
        self._reqs[rid] = t

    def append_tokens(self, rid: str, n: int) -> AppendResult:
        """Grow ``rid`` by ``n`` tokens; returns per-layer write slots (see :class:`AppendResult`)."""
        t = self._req(rid)
        self._check_active(t, "append_tokens")
        if self._op is not None:
            raise RequestStateError("append_tokens: a placement change is prepared but not completed")
        if self._step is not None and rid in self._step.rids:
            raise RequestStateError(f"append_tokens: request {rid!r} is in the running step")
        if t.pending_start is not None:
            raise RequestStateError(f"append_tokens: request {rid!r} already appended this step")
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"append_tokens: n = {n!r} must be an integer >= 1")
        bs = self.config.block_size
        old, new = t.tokens, t.tokens + n
        nb = -(-new // bs) - t.blocks
        host = self.host_pool.allocator.alloc(nb)
        if host is None:
            raise HostPoolFull(f"append_tokens({rid!r}, {n})", nb, self.host_pool.allocator.free_count)
        n_dev = nb * (len(t.resident_layers) + (1 if t.staging is not None else 0))
        alloc = self.device_pool.allocator
        if n_dev > alloc.free_count:
            if n_dev > alloc.free_count + self.reclaimable_blocks():
                self.host_pool.allocator.free(host)
                raise DevicePoolFull(
                    f"append_tokens({rid!r}, {n})", n_dev, alloc.free_count, self.reclaimable_blocks()
                )
            self._reclaim(n_dev)
        dev = alloc.alloc(n_dev) or []
        cursor = 0
        for layer, d in enumerate(t.dev):
            if d is not None:
                d += dev[cursor : cursor + nb]
                cursor += nb
                t.synced[layer] = min(t.synced[layer], old // bs)
        if t.staging is not None:
            t.staging += dev[cursor : cursor + nb]
        t.host_blocks += host
        t.tokens = new
        t.pending_start = old
        pos = torch.arange(old, new)
        locs = torch.empty((self.config.layers, n), dtype=torch.long)
        for layer in range(self.config.layers):
            pages = torch.tensor(t.pages(layer), dtype=torch.long)
            locs[layer] = pages[pos // bs] * bs + pos % bs
        return AppendResult(rid=rid, start_token=old, locs=locs.to(self.config.device))

    def fork_prefix(self, src: str, dst: str, tokens: int) -> None:
        """Copy the KV of ``src``'s first ``tokens`` tokens into the empty request ``dst``; each
        layer lands where ``dst``'s placement puts it. A prefix-cache hit by copy: the prefill is
        skipped, the blocks are not shared (each request owns its blocks). ``src`` may be paused.
        Raises (changing nothing) like :meth:`append_tokens` when the pools cannot hold it."""
        s, d = self._req(src), self._req(dst)
        self._check_idle("fork_prefix")
        if d.tokens or d.pending_start is not None:
            raise RequestStateError(f"fork_prefix: destination {dst!r} must be empty")
        if s.pending_start is not None:
            raise RequestStateError(f"fork_prefix: source {src!r} has tokens not yet written")
        if isinstance(tokens, bool) or not isinstance(tokens, int) or not 1 <= tokens <= s.tokens:
            raise ValueError(f"fork_prefix: tokens = {tokens!r} out of range [1, {s.tokens}]")
        self.append_tokens(dst, tokens)  # allocates (or raises before changing anything)
        d.pending_start = None
        self.engine.quiesce()  # host copies of src must have landed
        pairs: dict[str, tuple[list[int], list[int]]] = {k: ([], []) for k in ("dd", "dh", "hd", "hh")}
        for layer in range(self.config.layers):
            s_dev, d_dev = s.dev[layer], d.dev[layer]
            for j in range(d.blocks):
                if s_dev is not None:
                    src_segs, a = self.device_pool.segs([s_dev[j]]), "d"
                else:
                    src_segs, a = self.host_pool.segs([s.host_blocks[j]], layer), "h"
                if d_dev is not None:
                    dst_segs, b = self.device_pool.segs([d_dev[j]]), "d"
                else:
                    dst_segs, b = self.host_pool.segs([d.host_blocks[j]], layer), "h"
                pairs[a + b][0].extend(src_segs)
                pairs[a + b][1].extend(dst_segs)
        dev, host = self.device_pool.segments, self.host_pool.segments
        for kind, view in (("dd", dev), ("hh", host)):
            si, di = pairs[kind]
            if si:
                copy_segments(view, view, torch.tensor(si, device=view.device), torch.tensor(di, device=view.device))
        events = [self.engine.h2d(*pairs["hd"]), self.engine.d2h(*pairs["dh"])]
        self.engine.host_wait(events)

    def free(self, rid: str) -> None:
        """Release every block of ``rid`` (device, staging, host)."""
        t = self._req(rid)
        self._check_idle("free")
        self.engine.quiesce()
        self.device_pool.allocator.free(t.device_block_ids())
        self.host_pool.allocator.free(t.host_blocks)
        del self._reqs[rid]

    def pause(self, rid: str) -> None:
        """Stop ``rid`` keeping its KV: host copies made current, staging freed, resident layers
        kept as *removable* and dropped lazily, highest layer first, when space is needed."""
        t = self._req(rid)
        self._check_idle("pause")
        self._check_active(t, "pause")
        if t.pending_start is not None:
            raise RequestStateError(f"pause: request {rid!r} has appended tokens not yet written")
        self._sync_to_host(t, t.resident_layers)
        if t.staging is not None:
            self.engine.quiesce()
            self.device_pool.allocator.free(t.staging)
            t.staging = None
        t.placement_before_pause = t.placement
        self._pause_seq += 1
        t.paused, t.paused_seq = True, self._pause_seq
        log.debug("kv_paused", request=rid, resident_layers=len(t.resident_layers))

    def resume(self, rid: str, placement: Sequence[int] | None = None) -> InstallReport:
        """Make ``rid`` active again with ``placement`` (default: its placement before pausing);
        fetches only the layers dropped meanwhile."""
        t = self._req(rid)
        self._check_idle("resume")
        if not t.paused:
            raise RequestStateError(f"resume: request {rid!r} is not paused")
        target = self._validate_placement(rid, placement or t.placement_before_pause or ())
        t.paused = False
        try:
            op = self._installer.prepare({rid: target})
        except BaseException:
            t.paused = True
            raise
        if op is None:
            t.paused = True
            need = self._installer.blocks_needed({rid: target})
            raise DevicePoolFull(
                f"resume({rid!r})", need, self.device_pool.allocator.free_count, self.reclaimable_blocks()
            )
        self._installer.complete(op, success=True)
        t.placement_before_pause = None
        return _report(op)

    # ------------------------------------------------------------------ placement
    def prepare_placement(self, placements: Mapping[str, Sequence[int]]) -> PlacementOp | None:
        """Phase 1: reserve blocks and launch copies for ``placements`` ({rid: [0/1]*L}, active
        requests; absent ones keep theirs). None when old and new cannot coexist on the device."""
        self._check_idle("prepare_placement")
        targets = self._validate_targets(placements, "prepare_placement")
        op = self._installer.prepare(targets)
        self._op = op
        return op

    def complete_placement(self, op: PlacementOp, success: bool = True) -> None:
        """Phase 2: commit (``success``) or roll back the prepared change."""
        if op is None or op is not self._op:
            raise RequestStateError("complete_placement: op is not the outstanding prepared change")
        self._op = None
        self._installer.complete(op, success)

    def install_placement(self, placements: Mapping[str, Sequence[int]]) -> InstallReport:
        """Install ``placements`` with minimum movement: offloads first (freeing blocks), then
        onloads. Raises :class:`DevicePoolFull` (changing nothing) if the result cannot fit."""
        self._check_idle("install_placement")
        targets = self._validate_targets(placements, "install_placement")
        need = self._installer.blocks_needed(targets)
        alloc = self.device_pool.allocator
        if need > alloc.free_count + self.reclaimable_blocks():
            raise DevicePoolFull("install_placement", need, alloc.free_count, self.reclaimable_blocks())
        reports = []
        offload_only = {
            rid: tuple(min(a, b) for a, b in zip(self._reqs[rid].placement, tgt, strict=True))
            for rid, tgt in targets.items()
        }
        for stage in (offload_only, targets):
            stage = {r: p for r, p in stage.items() if p != self._reqs[r].placement}
            if not stage:
                continue
            op = self._installer.prepare(stage)
            if op is None:  # pragma: no cover - feasibility checked above
                raise DevicePoolFull("install_placement", need, alloc.free_count, self.reclaimable_blocks())
            self._installer.complete(op, success=True)
            reports.append(_report(op))
        report = _sum_reports(reports)
        if targets:
            log.debug("kv_placement_installed", requests=len(targets), **report.__dict__)
        return report

    # ------------------------------------------------------------------ internals
    def _sync_to_host(self, t: RequestTable, layers: Iterable[int]) -> int:
        """Write back unsynced blocks of resident ``layers``; waits; returns blocks written."""
        dev_segs: list[int] = []
        host_segs: list[int] = []
        n = 0
        for layer in layers:
            d = t.dev[layer] or []
            js = list(range(t.synced[layer], t.blocks))
            dev_segs += self.device_pool.segs([d[j] for j in js])
            host_segs += self.host_pool.segs([t.host_blocks[j] for j in js], layer)
            t.synced[layer] = t.blocks
            n += len(js)
        self.engine.host_wait([self.engine.d2h(dev_segs, host_segs)])
        return n

    def _reclaim(self, need: int) -> int:
        """Drop paused requests' layers (oldest pause first, highest layer first) until ``need``
        blocks are free or nothing is left; returns layers dropped. Lossless: paused requests'
        host copies are current (``pause`` synced them)."""
        alloc = self.device_pool.allocator
        dropped = 0
        self.engine.quiesce()
        for t in sorted((t for t in self._reqs.values() if t.paused), key=lambda t: t.paused_seq):
            while alloc.free_count < need and t.blocks and t.resident_layers:
                layer = t.resident_layers[-1]
                self._sync_to_host(t, [layer])
                alloc.free(t.dev[layer] or [])
                t.dev[layer] = None
                t.synced[layer] = 0
                dropped += 1
            if alloc.free_count >= need:
                break
        if dropped:
            log.debug("kv_reclaimed_paused_layers", layers=dropped, free_blocks=alloc.free_count)
        return dropped


def _report(op: PlacementOp) -> InstallReport:
    return InstallReport(
        offloaded_layers=len(op.offloads),
        onloaded_layers=len(op.onloads),
        d2h_blocks=op.d2h_blocks,
        h2d_blocks=op.h2d_blocks,
        reclaimed_layers=op.reclaimed_layers,
    )


def _sum_reports(reports: list[InstallReport]) -> InstallReport:
    return InstallReport(
        offloaded_layers=sum(r.offloaded_layers for r in reports),
        onloaded_layers=sum(r.onloaded_layers for r in reports),
        d2h_blocks=sum(r.d2h_blocks for r in reports),
        h2d_blocks=sum(r.h2d_blocks for r in reports),
        reclaimed_layers=sum(r.reclaimed_layers for r in reports),
    )
