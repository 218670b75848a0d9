"""CheckBatch: `kvplane gpu-check`'s decode batch on the served core, with regenerable KV.

A :class:`~sglang_ext.dataplane.layered_kv_core.LayeredKVCore` (CUDA: pinned host pool and the
CUDA transfer engine, as SGLang's layered pool builds it) in the paged layout: the device pool
holds every layer of the batch plus a third (at least two layers of the batch) free, so the
all-resident and the planner's placement run on the same pool, the bandwidth fetches find free
pages, and the boundary's eager write-back (under 25% free) never runs. Requests have their own
contexts; each is prefilled by one prefill step through the core. Every prefill K/V is drawn
from a generator seeded by (seed, request, layer), so the dense reference regenerates it instead
of keeping a shadow copy (20 GiB at Llama-3-8B shapes); decode steps write one fixed token per
request (``k1``/``v1``).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import numpy as np
import torch

from sglang_ext.dataplane.bench_env import sync
from sglang_ext.dataplane.layered_kv_core import LayeredKVCore
from sglang_ext.dataplane.results import LayerView
from sglang_ext.dataplane.slot_results import RequestResidency, ResidencyDelta
from sglang_ext.dataplane.slot_store_config import SlotStoreConfig
from sglang_ext.dataplane.triton_row_writer import TritonRowWriter
from sglang_ext.tools.gpu_check_config import GpuCheckConfig


class CheckBatch:
    """``config.requests`` requests at ``config.contexts`` on a fresh core (module docstring)."""

    def __init__(self, config: GpuCheckConfig, device: str, identity: bool = False) -> None:
        """``identity``: a device pool that holds every layer of every logical page (the layout
        that serves while nothing is offloaded) instead of the paged one."""
        self.config, self.device = config, device
        L, ps = config.layers, config.page_size
        self.dtype = config.torch_dtype
        self.contexts: list[int] = list(config.contexts)
        headroom = config.decode_steps + ps
        per_req = [-(-(c + headroom) // ps) for c in self.contexts]
        self.batch_pages = sum(per_req)
        extra = max(-(-L * self.batch_pages // 2), 2 * self.batch_pages)
        # logical pages: the batch, the padding page 0, and enough more that the device pool stays
        # below every layer of every logical page (the paged layout, not the identity one)
        logical = self.batch_pages + 2 + -(-extra // L)
        self.core = LayeredKVCore(SlotStoreConfig(
            layers=L, page_size=ps, kv_heads=config.kv_heads, head_dim=config.head_dim, logical_pages=logical,
            device_pages=L * logical if identity else L * self.batch_pages + extra, dtype=self.dtype, device=device,
            graph_sink=True,
        ))
        # a one-launch KV write, as the served pool has on CUDA (SGLang's store kernel there; no
        # SGLang here: kvplane's Triton one), not two index_copy_ a layer
        self.core.store.row_writer = TritonRowWriter.for_device(device)
        if self.core.store.identity != identity:
            raise RuntimeError(f"CheckBatch: the store chose the {'identity' if self.core.store.identity else 'paged'}"
                               " layout, not the one asked for")
        # as SGLang's paged decode backends set it (layered_paged_decode.py): every attention of
        # the check reads the step's page tables, never the torch-native token tables
        self.core.paged_reads = True
        self.core.token_tables = False
        self.rids = [f"r{i}" for i in range(config.requests)]
        starts = 1 + np.concatenate([[0], np.cumsum(per_req)[:-1]])
        self.slots = [int(s) * ps + np.arange(n * ps, dtype=np.int64) for s, n in zip(starts, per_req, strict=True)]
        """SGLang's ``req_to_token`` rows: request ``i`` owns consecutive pages from ``starts[i]``."""
        self.lens = list(self.contexts)
        self.seeds = list(range(config.requests))
        """Per row: the seed of its request's prefill KV (:meth:`prefill_kv`); a joining request
        takes a fresh one (:meth:`replace_first`)."""
        gen = torch.Generator(device="cpu").manual_seed(config.seed)
        shape = (config.requests, config.kv_heads, config.head_dim)
        self.k1 = torch.randn(shape, generator=gen).to(device, self.dtype)
        self.v1 = torch.randn(shape, generator=gen).to(device, self.dtype)
        self.prepare_cpu_s = 0.0
        """Thread CPU time of the last ``begin_decode``'s ``prepare_step`` (kvplane's share)."""
        self.boundary_scope: Callable[[], AbstractContextManager[Any]] = nullcontext
        """Wraps each boundary call (a profiler's scope; nothing by default)."""
        for i, rid in enumerate(self.rids):  # one prefill step per request, as SGLang runs them
            loc = torch.from_numpy(self.slots[i][: self.contexts[i]].copy())
            self.core.prepare_step([(rid, loc.clone())], loc)
            for layer in range(L):
                k, v = self.prefill_kv(i, layer)
                self.core.enter_layer(layer)
                self.core.write(layer, loc, k, v)
                self.core.exit_layer(layer)
        self.core.store.engine.quiesce()

    def rewrite_decoded_token(self) -> None:
        """Each request's last decoded token (``k1``/``v1``) written again at every layer, at rest
        (a new ``loc``: the core's at-rest path, after the copies in flight). A step stopped
        inside a layer (a fault there) wrote its token at the layers before only, while
        ``begin_decode`` counted it: :meth:`reference_kv` would then regenerate KV the pool does
        not hold. The same values where the step finished; requests not yet decoding (their last
        token a prefill one) are left alone."""
        decoding = [i for i, n in enumerate(self.lens) if n > self.contexts[i]]
        if not decoding:
            return
        loc = torch.tensor([int(self.slots[i][self.lens[i] - 1]) for i in decoding], dtype=torch.int64)
        idx = torch.tensor(decoding, dtype=torch.int64, device=self.k1.device)
        k, v = self.k1.index_select(0, idx), self.v1.index_select(0, idx)
        for layer in range(self.config.layers):
            self.core.write(layer, loc, k, v)
        self.core.store.engine.quiesce()

    def vanilla_write_cpu_ms(self, repeat: int) -> float:
        """Thread CPU ms per step of the KV write kvplane's ``write`` replaces: SGLang's
        ``MHATokenToKVPool.set_kv_buffer`` (``k_buffer[layer][loc] = k``, same for V) for the
        batch's new tokens at every layer, into flat buffers on the same device (median of ``repeat``)."""
        c = self.config
        n = self.k1.shape[0]
        k_buf = torch.empty((c.layers, 4 * n, c.kv_heads, c.head_dim), dtype=self.dtype, device=self.device)
        v_buf = torch.empty_like(k_buf)
        loc = torch.arange(n, device=self.device) * 3

        def write() -> None:
            for layer in range(c.layers):
                k_buf[layer][loc] = self.k1
                v_buf[layer][loc] = self.v1

        write()
        sync(self.device)
        samples = []
        for _ in range(repeat):
            t0 = time.thread_time()
            write()
            samples.append((time.thread_time() - t0) * 1e3)
            sync(self.device)
        return statistics.median(samples)

    def prefill_kv(self, i: int, layer: int, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Request ``i``'s prefill K and V at ``layer`` (``[context, H, D]``), regenerated."""
        c = self.config
        gen = torch.Generator(device=self.device).manual_seed(c.seed * 1_000_003 + self.seeds[i] * 7919 + layer + 1)
        shape = (self.contexts[i], c.kv_heads, c.head_dim)
        k = torch.randn(shape, generator=gen, device=self.device).to(self.dtype)
        v = torch.randn(shape, generator=gen, device=self.device).to(self.dtype)
        return (k, v) if dtype is None else (k.to(dtype), v.to(dtype))

    def replace_first(self, rid: str, tokens: int) -> tuple[str, list[int]]:
        """The batch's first request finishes and ``rid`` joins last on its slots with a prompt of
        ``tokens`` tokens (not yet written: the caller prefills :meth:`prefill_kv` of the last
        row). Every row's data moves with its request -- slots, lengths, contexts, the prefill
        seed and the decode token ``k1``/``v1`` (rotated: the joiner takes the leaver's) -- so
        :meth:`reference_kv` stays the KV each request holds. Returns the leaver's id and its
        pages (the caller releases it and frees them in the core, as SGLang's end of step)."""
        ps = self.config.page_size
        gone, slots, n = self.rids.pop(0), self.slots.pop(0), self.lens.pop(0)
        self.contexts = [*self.contexts[1:], tokens]
        self.seeds = [*self.seeds[1:], max(self.seeds) + 1]
        self.k1, self.v1 = self.k1.roll(-1, 0), self.v1.roll(-1, 0)
        self.rids.append(rid)
        self.slots.append(slots)
        self.lens.append(tokens)
        return gone, sorted({int(s) // ps for s in slots[:n]})

    def reference_kv(self, i: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Every token of request ``i`` at ``layer`` now (prefill + decoded), float32."""
        k, v = self.prefill_kv(i, layer, torch.float32)
        n = self.lens[i] - self.contexts[i]
        k_new = self.k1[i].float().expand(n, -1, -1)
        v_new = self.v1[i].float().expand(n, -1, -1)
        return torch.cat([k, k_new]), torch.cat([v, v_new])

    def pages(self, i: int) -> tuple[int, ...]:
        """Request ``i``'s pages in position order."""
        ps = self.config.page_size
        return tuple(int(s) // ps for s in self.slots[i][: self.lens[i] : ps])

    def all_pages(self) -> np.ndarray:
        """Every page of the batch (``sum b_r``)."""
        return np.asarray([p for i in range(len(self.rids)) for p in self.pages(i)], dtype=np.int64)

    def blocks(self, extra_tokens: int = 0) -> list[int]:
        """``b_r``: pages per layer of every request after ``extra_tokens`` more tokens."""
        ps = self.config.page_size
        return [-(-(n + extra_tokens) // ps) for n in self.lens]

    def place(self, rows: Sequence[Sequence[int]]) -> ResidencyDelta:
        """Install per-request placements (1 = on device, per layer) as a planned plan."""
        return self.core.update_residency({
            rid: RequestResidency(pages=self.pages(i), gpu_layers=tuple(bool(x) for x in rows[i]), planned=True)
            for i, rid in enumerate(self.rids)
        })

    def begin_decode(self, recompute: np.ndarray | None = None) -> torch.Tensor:
        """The boundary of one decode step (one new token per request); returns its slots.
        ``recompute[i] = (u, k)``: request ``i`` recomputes its first ``u`` pages at layers < k."""
        new = []
        for i in range(len(self.rids)):
            new.append(int(self.slots[i][self.lens[i]]))
            self.lens[i] += 1
        loc = torch.tensor(new, dtype=torch.int64)
        # as SGLang's layered backend does: the steady decode fast path first (the same batch,
        # one token more each), else the general boundary with every request's slots
        with self.boundary_scope():
            t0 = time.thread_time()
            steady = recompute is None and self.core.prepare_decode_step(self.rids, self.lens, loc)
            self.prepare_cpu_s = time.thread_time() - t0
        if not steady:
            requests = [(rid, torch.from_numpy(self.slots[i][: self.lens[i]].copy()))
                        for i, rid in enumerate(self.rids)]
            with self.boundary_scope():
                t0 = time.thread_time()
                self.core.prepare_step(requests, loc, recompute=recompute)
                self.prepare_cpu_s += time.thread_time() - t0
        if self.core.overflow:
            raise RuntimeError("the batch overflowed the device pool: no staged step to measure")
        return loc

    def layer_view(self, layer: int) -> LayerView:
        """Layer ``layer`` of the current step as paged kernels take it (the step's tables)."""
        t = self.core.tables
        if t is None:
            raise RuntimeError("layer_view outside a staged step")
        dev = self.core.store.dev
        return LayerView(layer=layer, k_cache=dev[0], v_cache=dev[1], kv_indptr=t.kv_indptr,
                         kv_indices=t.tab[layer], kv_lens=t.kv_lens, last_page_len=t.last_page_len,
                         rids=tuple(self.rids))
