"""StepProtocol: the per-step data movement of a forward pass (mixed into LayeredKVCache).

Per step (``rids`` = the batch)::

    cache.begin_step(rids)          # page tables; first fetch of every offloading request
    for layer in range(L):
        cache.wait_layer(layer)     # compute stream waits for this layer's fetches
        view = cache.layer_view(layer)
        ... write new K/V at AppendResult.locs[layer]; attention over view ...
        cache.end_layer(layer)      # write back the dirty staging blocks; fetch the next layer
    cache.end_step()                # eager write-back of newly full resident blocks

The fetch schedule is the placement model's (``controlplane.model.timeline``): each offloading
request owns one staging slot; its first offloaded layer is fetched at step start, each later one
as soon as the layer that used the slot has ended. All fetches starting at the same boundary
are one batched H2D launch; all write-backs at a boundary are one D2H launch.

New tokens of an offloaded layer are written into the staging slot (attention reads them there)
and written back to host at ``end_layer`` before the slot is reused (OrbitFlow §3.2 writes to
host directly; writing to staging keeps one write path for attention and costs one block of D2H
per request and offloaded layer per step).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from kernels.page_index import pages_to_token_locs
from sglang_ext.dataplane.errors import RequestStateError
from sglang_ext.dataplane.results import LayerView, MemoryUsage

if TYPE_CHECKING:
    from sglang_ext.dataplane.layered_kv_cache import LayeredKVCache


@dataclass
class StepState:
    """The running step."""

    rids: tuple[str, ...]
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    """``[L, P]`` int32: row l is layer l's pages for the whole batch."""
    kv_lens: torch.Tensor
    last_page_len: torch.Tensor
    layer_events: list[list[Any]] = field(default_factory=list)
    next_layer: int = 0


class StepProtocol:
    """Mixin for :class:`LayeredKVCache`; see module docstring."""

    def begin_step(self: LayeredKVCache, rids: Sequence[str]) -> None:
        """Start a forward step over ``rids`` (every request with appended tokens must be in it)."""
        self._check_idle("begin_step")
        rids = tuple(rids)
        if len(set(rids)) != len(rids):
            raise ValueError(f"begin_step: duplicate request ids in {rids!r}")
        tables = [self._req(r) for r in rids]
        for t in tables:
            self._check_active(t, "begin_step")
        missing = [r for r, t in self._reqs.items() if t.pending_start is not None and r not in rids]
        if missing:
            raise RequestStateError(f"begin_step: requests {missing!r} appended tokens but are not in the step")
        c = self.config
        L, bs = c.layers, c.block_size
        indptr = [0]
        for t in tables:
            indptr.append(indptr[-1] + t.blocks)
        indices = torch.empty((L, indptr[-1]), dtype=torch.int32)
        for layer in range(L):
            row: list[int] = []
            for t in tables:
                row += t.pages(layer) if t.blocks else []
            indices[layer] = torch.tensor(row, dtype=torch.int32)
        lens = [t.tokens for t in tables]
        last = [(n - 1) % bs + 1 if n else 0 for n in lens]
        dev = c.device
        step = StepState(
            rids=rids,
            kv_indptr=torch.tensor(indptr, dtype=torch.int32).to(dev),
            kv_indices=indices.to(dev),
            kv_lens=torch.tensor(lens, dtype=torch.int32).to(dev),
            last_page_len=torch.tensor(last, dtype=torch.int32).to(dev),
            layer_events=[[] for _ in range(L)],
        )
        # First fetch of every offloading request, one launch.
        src: list[int] = []
        dst: list[int] = []
        first_layers: set[int] = set()
        for t in tables:
            off = t.offloaded_layers
            if off and t.blocks:
                src += self.host_pool.segs(t.host_blocks, off[0])
                dst += self.device_pool.segs(t.staging or [])
                first_layers.add(off[0])
        ev = self.engine.h2d(src, dst, wait=[self._last_tail_d2h])
        for layer in first_layers:
            step.layer_events[layer].append(ev)
        self._step = step

    def _running(self: LayeredKVCache, what: str, layer: int) -> StepState:
        if self._step is None:
            raise RequestStateError(f"{what}: no step in flight (call begin_step first)")
        if not 0 <= layer < self.config.layers:
            raise ValueError(f"{what}: layer {layer} out of range [0, {self.config.layers})")
        return self._step

    def wait_layer(self: LayeredKVCache, layer: int) -> None:
        """Make the compute stream wait until ``layer``'s KV has landed (no-op on CPU)."""
        step = self._running("wait_layer", layer)
        self.engine.stream_wait(step.layer_events[layer])

    def layer_view(self: LayeredKVCache, layer: int) -> LayerView:
        """Pools and page tables of ``layer`` for the running step (valid until end_layer)."""
        step = self._running("layer_view", layer)
        return LayerView(
            layer=layer,
            k_cache=self.device_pool.k_cache,
            v_cache=self.device_pool.v_cache,
            kv_indptr=step.kv_indptr,
            kv_indices=step.kv_indices[layer],
            kv_lens=step.kv_lens,
            last_page_len=step.last_page_len,
            rids=step.rids,
        )

    def layer_token_locs(self: LayeredKVCache, layer: int) -> torch.Tensor:
        """Token slots ``[sum kv_lens]`` (int64, batch order) of ``layer`` into
        ``k_cache.view(-1, H, D)``: the per-layer ``req_to_token`` of token-indexed backends
        (SGLang ``torch_native``/``triton``), expanded by ``kernels.pages_to_token_locs``."""
        view = self.layer_view(layer)
        return pages_to_token_locs(view.kv_indptr, view.kv_indices, view.kv_lens, self.config.block_size)

    def end_layer(self: LayeredKVCache, layer: int) -> None:
        """``layer``'s compute is issued: write back its staged new tokens, start next fetches."""
        step = self._running("end_layer", layer)
        if layer != step.next_layer:
            raise RequestStateError(f"end_layer: expected layer {step.next_layer}, got {layer}")
        bs = self.config.block_size
        d_src: list[int] = []
        d_dst: list[int] = []
        h_src: list[int] = []
        h_dst: list[int] = []
        next_layers: set[int] = set()
        for rid in step.rids:
            t = self._reqs[rid]
            if t.dev[layer] is not None or not t.blocks:
                continue
            staging = t.staging or []
            if t.pending_start is not None:
                js = range(t.pending_start // bs, t.blocks)
                d_src += self.device_pool.segs([staging[j] for j in js])
                d_dst += self.host_pool.segs([t.host_blocks[j] for j in js], layer)
            later = [x for x in t.offloaded_layers if x > layer]
            if later:
                h_src += self.host_pool.segs(t.host_blocks, later[0])
                h_dst += self.device_pool.segs(staging)
                next_layers.add(later[0])
        ev_d = self.engine.d2h(d_src, d_dst)
        if d_src:
            self._last_tail_d2h = ev_d
        ev_h = self.engine.h2d(h_src, h_dst, wait=[ev_d])
        for nxt in next_layers:
            step.layer_events[nxt].append(ev_h)
        step.next_layer += 1

    def end_step(self: LayeredKVCache) -> None:
        """Finish the step: eager write-back (SuperInfer §4.3.2) of resident blocks that became
        full, so a later offload only writes the dirty tail."""
        if self._step is None:
            raise RequestStateError("end_step: no step in flight")
        step = self._step
        if step.next_layer != self.config.layers:
            raise RequestStateError(
                f"end_step: only {step.next_layer} of {self.config.layers} layers ended"
            )
        bs = self.config.block_size
        src: list[int] = []
        dst: list[int] = []
        for rid in step.rids:
            t = self._reqs[rid]
            full = t.tokens // bs
            for layer in t.resident_layers:
                js = range(t.synced[layer], full)
                if js:
                    d = t.dev[layer] or []
                    src += self.device_pool.segs([d[j] for j in js])
                    dst += self.host_pool.segs([t.host_blocks[j] for j in js], layer)
                    t.synced[layer] = full
            t.pending_start = None
        self.engine.d2h(src, dst)
        self._step = None

    # ------------------------------------------------------------------ reads and checks
    def read_kv(self: LayeredKVCache, rid: str, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(k, v)`` of ``rid``'s ``layer``, ``[tokens, kv_heads, head_dim]``, from wherever it
        lives (device blocks if resident, else host). Not during a step."""
        self._check_idle("read_kv")
        t = self._req(rid)
        self.engine.quiesce()
        c = self.config
        n = t.tokens
        d = t.dev[layer]
        if d is not None:
            idx = torch.tensor(d, dtype=torch.long, device=c.device)
            k = self.device_pool.k_cache.index_select(0, idx)
            v = self.device_pool.v_cache.index_select(0, idx)
        else:
            hb = torch.tensor(t.host_blocks, dtype=torch.long)
            kv = self.host_pool.kv.index_select(0, hb)[:, layer]
            k, v = kv[:, 0], kv[:, 1]
        shape = (-1, c.kv_heads, c.head_dim)
        return k.reshape(shape)[:n].cpu(), v.reshape(shape)[:n].cpu()

    def check_invariants(self: LayeredKVCache) -> MemoryUsage:
        """Raise AssertionError unless the tables and allocators agree: every block owned exactly
        once, no leaks, staging iff offloading, device use = the model's memory_blocks."""
        from controlplane.model import memory_blocks

        dev_owned: list[int] = []
        host_owned: list[int] = []
        active_rows: list[tuple[int, ...]] = []
        active_blocks: list[int] = []
        for rid, t in self._reqs.items():
            dev_owned += t.device_block_ids()
            host_owned += t.host_blocks
            if t.blocks != -(-t.tokens // self.config.block_size):
                raise AssertionError(f"{rid}: {t.blocks} blocks for {t.tokens} tokens")
            for layer, d in enumerate(t.dev):
                if d is not None and len(d) != t.blocks:
                    raise AssertionError(f"{rid} layer {layer}: {len(d)} blocks, expected {t.blocks}")
            if t.paused:
                if t.staging is not None:
                    raise AssertionError(f"{rid}: paused request holds a staging slot")
                continue
            if (t.staging is not None) != (0 in t.placement):
                raise AssertionError(f"{rid}: staging {t.staging} with placement {t.placement}")
            if t.staging is not None and len(t.staging) != t.blocks:
                raise AssertionError(f"{rid}: staging has {len(t.staging)} blocks, expected {t.blocks}")
            active_rows.append(t.placement)
            active_blocks.append(t.blocks)
        for name, owned, alloc in (
            ("device", dev_owned, self.device_pool.allocator),
            ("host", host_owned, self.host_pool.allocator),
        ):
            if len(owned) != len(set(owned)):
                raise AssertionError(f"{name} block used twice")
            if set(owned) != alloc.used_ids():
                raise AssertionError(f"{name} allocator and tables disagree (leak or stray block)")
        usage = self.memory_usage()
        resident, staging = memory_blocks(active_rows, active_blocks)
        if (usage.resident_blocks, usage.staging_blocks) != (resident, staging):
            raise AssertionError(f"usage {usage} != model ({resident}, {staging})")
        used = self.device_pool.allocator.used_count
        if used != resident + staging + usage.removable_blocks:
            raise AssertionError(f"{used} device blocks used, accounted {resident + staging} + removable")
        return usage
