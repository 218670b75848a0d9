"""ServedBatch: the data-plane tools' batch on the served core (what SGLang runs), not a model.

A :class:`~sglang_ext.dataplane.layered_kv_core.LayeredKVCore` at the tool's shapes (CUDA: pinned
host pool and the CUDA transfer engine, as in SGLang; CPU: the same code, synchronous copies) in
the paged layout: the budget holds every layer of the batch plus one layer of staging, so an
all-resident plan and an offloading one run on the same pool. Requests are filled by one prefill
step each through the core; ``place(row)`` installs a plan with ``update_residency``; a decode
step is ``prepare_step`` + per layer ``enter_layer`` / ``write`` / the attention over the step's
tables (FlashInfer's paged decode over ``tables.tab[l]``, else the torch reference) /
``exit_layer`` -- SGLang's layered attention backend's sequence (an idle step: the writes and
the last ``exit_layer``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from sglang_ext.dataplane.attention import torch_layered_attention
from sglang_ext.dataplane.layered_kv_core import LayeredKVCore
from sglang_ext.dataplane.results import LayerView
from sglang_ext.dataplane.slot_results import RequestResidency, ResidencyDelta
from sglang_ext.dataplane.slot_store_config import SlotStoreConfig


class ServedBatch:
    """``requests`` requests of ``context`` tokens on a fresh core (see module docstring)."""

    def __init__(self, *, layers: int, page_size: int, kv_heads: int, head_dim: int, requests: int,
                 context: int, headroom: int, dtype: torch.dtype, device: str, seed: int = 0) -> None:
        """``headroom``: decode tokens per request the batch may still grow by."""
        self.layers, self.ps, self.device = layers, page_size, device
        per_req = -(-(context + headroom) // page_size)
        batch_pages = requests * per_req
        self.core = LayeredKVCore(SlotStoreConfig(
            layers=layers, page_size=page_size, kv_heads=kv_heads, head_dim=head_dim,
            logical_pages=2 * batch_pages + 1, device_pages=(layers + 1) * batch_pages, dtype=dtype,
            device=device,
        ))
        assert not self.core.store.identity
        self.max_pages = batch_pages
        """Pages of the whole batch once grown by ``headroom`` (FlashInfer's indices buffer)."""
        self.rids = [f"r{i}" for i in range(requests)]
        self.table = np.zeros((requests, per_req * page_size), dtype=np.int64)
        """SGLang's ``req_to_token`` rows: request ``i`` owns pages ``1 + i * per_req ...``."""
        base = 1 + np.arange(requests)[:, None] * per_req
        self.table[:] = (base * page_size + np.arange(per_req * page_size)[None, :])
        self.lens = [0] * requests
        self.row = (True,) * layers
        gen = torch.Generator().manual_seed(seed)
        shape = (requests, kv_heads, head_dim)
        self.k1 = torch.randn(shape, generator=gen).to(device, dtype)
        self.v1 = torch.randn(shape, generator=gen).to(device, dtype)
        for i, rid in enumerate(self.rids):  # one prefill step per request, as SGLang runs them
            loc = torch.from_numpy(self.table[i, :context].copy())
            self.lens[i] = context
            self.core.prepare_step([(rid, loc.clone())], loc)
            for layer in range(layers):
                k = torch.randn((context, kv_heads, head_dim), generator=gen).to(device, dtype)
                self.core.enter_layer(layer)
                self.core.write(layer, loc, k, k)
                self.core.exit_layer(layer)

    def pages(self, i: int) -> tuple[int, ...]:
        """Request ``i``'s pages in position order."""
        return tuple(int(s) // self.ps for s in self.table[i, : self.lens[i] : self.ps])

    def blocks(self) -> list[int]:
        """``b_r``: pages per layer of every request (the placement model's blocks)."""
        return [-(-n // self.ps) for n in self.lens]

    def place(self, row: Sequence[bool]) -> ResidencyDelta:
        """Install the plan ``row`` (True = on device, per layer) for every request."""
        self.row = tuple(bool(x) for x in row)
        return self.core.update_residency({
            rid: RequestResidency(pages=self.pages(i), gpu_layers=self.row, planned=True)
            for i, rid in enumerate(self.rids)
        })

    def begin_decode(self) -> torch.Tensor:
        """Boundary of one decode step (one new token per request); returns its slots."""
        new = []
        for i in range(len(self.rids)):
            new.append(int(self.table[i, self.lens[i]]))
            self.lens[i] += 1
        loc = torch.tensor(new, dtype=torch.int64)
        requests = [(rid, torch.from_numpy(self.table[i, : self.lens[i]].copy())) for i, rid in enumerate(self.rids)]
        self.core.prepare_step(requests, loc)
        if self.core.overflow:
            raise RuntimeError("the batch overflowed the budget: no staged step to measure")
        return loc

    def layer_view(self, layer: int) -> LayerView:
        """Layer ``layer`` of the current step as paged kernels take it (the step's tables)."""
        t = self.core.tables
        assert t is not None
        dev = self.core.store.dev
        return LayerView(layer=layer, k_cache=dev[0], v_cache=dev[1], kv_indptr=t.kv_indptr,
                         kv_indices=t.tab[layer], kv_lens=t.kv_lens, last_page_len=t.last_page_len,
                         rids=tuple(self.rids))

    def decode_step(self, body: Callable[[int], None] | None = None) -> None:
        """One decode step; ``body(layer)`` runs after the layer's KV write (attention, MLP)."""
        loc = self.begin_decode()
        core = self.core
        idle, last = core.layers_idle, self.layers - 1  # as served: an idle step skips enter / exit (but the last)
        for layer in range(self.layers):
            if not idle:
                core.enter_layer(layer)
            core.write(layer, loc, self.k1, self.v1)
            if body is not None:
                body(layer)
            if not idle or layer == last:
                core.exit_layer(layer)


class DecodeAttention:
    """Paged decode attention over a :class:`ServedBatch`'s step tables: FlashInfer on CUDA when
    importable (one plan per step, at layer 0), else the torch reference."""

    def __init__(self, batch: ServedBatch, q_heads: int) -> None:
        self.batch = batch
        heads, dim = batch.k1.shape[1:]
        self.q = torch.randn((len(batch.rids), q_heads, dim), device=batch.device, dtype=batch.k1.dtype)
        self.qo = torch.arange(len(batch.rids) + 1, device=batch.device)
        self.fi = None
        if batch.device.startswith("cuda"):
            from sglang_ext.dataplane.flashinfer_attention import (
                HAVE_FLASHINFER,
                FlashInferLayeredDecode,
            )

            if HAVE_FLASHINFER:
                self.fi = FlashInferLayeredDecode(batch.device, max_pages=batch.max_pages)

    @property
    def name(self) -> str:
        return "flashinfer" if self.fi is not None else "torch reference"

    def __call__(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s attention (FlashInfer plans the step at layer 0)."""
        if self.fi is not None and layer == 0:
            self.fi.plan(self.batch.layer_view(layer), self.q.shape[1])
        return self.run(layer)

    def run(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s attention under the step's plan."""
        view = self.batch.layer_view(layer)
        if self.fi is not None:
            return self.fi.run(self.q, view)
        return torch_layered_attention(self.q, self.qo, view.k_cache, view.v_cache, view.kv_indptr,
                                       view.kv_indices, view.kv_lens)
