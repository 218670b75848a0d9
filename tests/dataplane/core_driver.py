"""CoreDriver: drives the SGLang-free served core (:class:`LayeredKVCore`) the way SGLang's
forward does -- paged slot allocation, batched prefill/decode steps, per-layer enter / write /
read / exit -- keeping a shadow copy of every live token's K/V and checking, inside every layer,
that the attention's read path (identity in place, staged row table, or overflow at rest)
returns exactly the shadow."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from sglang_ext.dataplane.layered_kv_core import LayeredKVCore
from sglang_ext.dataplane.slot_results import RequestResidency
from sglang_ext.dataplane.slot_store_config import SlotStoreConfig

LAYERS, HEADS, DIM, PAGE, PAGES = 3, 2, 4, 2, 33
"""Toy shapes: 33 logical pages of 2 tokens (page 0 is SGLang's padding page)."""

KV_MISMATCH = r"^\('\w+', \d+\)$"
"""``pytest.raises(AssertionError, match=KV_MISMATCH)``: the failure is one of the driver's K/V
comparisons (message ``(rid, layer)``, inside a layer or at rest), not any other assertion."""


def make_core(device_pages: int | None, *, dtype: torch.dtype = torch.float32, device: str = "cpu",
              layers: int = LAYERS, pages: int = PAGES, page_size: int = PAGE,
              head_dim: int = DIM) -> LayeredKVCore:
    """A core at toy sizes; ``device_pages=None`` is the identity layout (every layer-page fits).
    ``head_dim``: FlashInfer's kernels need 64, 128 or 256."""
    return LayeredKVCore(SlotStoreConfig(
        layers=layers, page_size=page_size, kv_heads=HEADS, head_dim=head_dim, logical_pages=pages,
        device_pages=layers * pages if device_pages is None else device_pages, dtype=dtype, device=device,
    ))


class CoreDriver:
    """SGLang's side of the core: slots, steps, frees -- plus the shadow KV and the checks."""

    def __init__(self, core: LayeredKVCore, seed: int = 0,
                 on_layer: Callable[[int], None] | None = None, fast_decode: bool = False,
                 paged_reads: bool = False) -> None:
        self.core = core
        if paged_reads:  # as SGLang's paged decode backends set the core (layered_paged_decode.py)
            core.paged_reads, core.token_tables = True, False
        self.fast_decode = fast_decode
        """Decode steps (one token each) try the served fast path first
        (:meth:`LayeredKVCore.prepare_decode_step`, which decides whether each request continues
        what it held), as SGLang's layered backends do."""
        self.fast_steps = 0
        """Forwards the fast path took (their bookkeeping journalled)."""
        self.publish_slots = False
        """Decode steps publish their new slots' host list first, as SGLang's allocation hook does
        (``LayeredRadixCache.on_alloc_decode`` -> :class:`HostSlots`)."""
        self.skip_idle = paged_reads
        """As the served adapter does (``LayeredTorchNativeAttnBackend._begin_layer``): a step whose
        layers are idle (:attr:`LayeredKVCore.layers_idle`) skips ``enter_layer`` and every
        ``exit_layer`` but the last, and a steady step (the decode fast path in the identity
        layout: ``_prepare``'s ``steady``) skips that one too, so its pipeline stays begun until
        the next step begins. On for the paged-reads driver (what the paged decode backends
        serve); ``"always"`` skips them on every step, ``"enter"`` every ``enter_layer`` and
        nothing else (negative controls)."""
        self.idle_steps = 0
        """Forwards whose layers skipped the per-layer calls."""
        self.steady_steps = 0
        """Of those, steady ones (below): not even the last layer's exit ran."""
        self.loc_dtype = torch.int64
        """dtype of the step's ``out_cache_loc`` (SGLang's is int64; int32 must work as well)."""
        self.finishes = 0
        self.rewrites = 0
        """Rows rewritten to another request's first page (:meth:`rewrite_prefix`)."""
        """Requests finished (odd ones free their pages first, as SGLang does, even ones after)."""
        self.ps = core.page_size
        self.gen = torch.Generator().manual_seed(seed)
        self.free_pages = list(range(core.config.logical_pages - 1, 0, -1))
        self.slots: dict[str, list[int]] = {}
        self.paused: set[str] = set()
        self.shadow: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.graph_buffers: Any = None
        """A :class:`GraphStepBuffers` (with a :class:`GraphStaging`, or not): the decode steps it
        admits run their layers through it -- its ``enter`` / ``write`` / tables / ``exit``, the
        core's pipeline told the step is graphed (``in_graph``) -- as a replayed graph's layers
        do; the others as before. Counts: :attr:`graph_steps`, :attr:`graph_declined`."""
        self.graph_steps = 0
        self.graph_declined: Counter[str] = Counter()
        self.on_layer = on_layer
        """Called inside every layer (after the write, before the read): tests hook assertions."""
        self.steps = 0
        self._rows: torch.Tensor | None = None
        self.recompute: dict[str, tuple[int, int]] = {}
        """rid -> (uncached pages u, recomputed layers k) for its decode steps (docs/recompute.md)."""
        self.corrupt_recompute = False
        """Negative control: recomputed K/V written off by one."""
        self.recompute_rows = 0
        """Recomputed token-layers written in total."""

    # ----- SGLang's allocator ------------------------------------------------------------

    def _refs(self, page: int) -> int:
        return sum(1 for s in self.slots.values() if s and page in {x // self.ps for x in s})

    def _grow(self, rid: str, n: int) -> list[int] | None:
        slots = self.slots[rid]
        fresh = -(-max(0, n - (-len(slots) % self.ps)) // self.ps)
        if fresh > len(self.free_pages):
            return None
        out = []
        for _ in range(n):
            if slots and (slots[-1] + 1) % self.ps != 0:
                nxt = slots[-1] + 1
            else:
                nxt = self.free_pages.pop() * self.ps
            slots.append(nxt)
            out.append(nxt)
        return out

    def add(self, rid: str, share_from: str | None = None, share_pages: int = 0) -> None:
        """A new request, optionally starting with another's first ``share_pages`` full pages
        (a prefix-cache hit: same pages, no copy)."""
        prefix: list[int] = []
        if share_from is not None and share_from in self.slots:
            full = len(self.slots[share_from]) // self.ps
            prefix = self.slots[share_from][: min(share_pages, full) * self.ps]
        self.slots[rid] = list(prefix)

    # ----- a forward -----------------------------------------------------------------------

    def step(self, batch: Sequence[tuple[str, int]]) -> bool:
        """One forward of ``batch`` = (rid, new tokens); False when SGLang would have no room."""
        batch = [(rid, n) for rid, n in batch if rid in self.slots and rid not in self.paused and n > 0]
        if not batch:
            return False
        fresh = sum(-(-max(0, n - (-len(self.slots[rid]) % self.ps)) // self.ps) for rid, n in batch)
        if fresh > len(self.free_pages):
            return False  # SGLang would not schedule this batch
        news = [self._grow(rid, n) or [] for rid, n in batch]
        loc = torch.tensor([s for new in news for s in new], dtype=self.loc_dtype)
        core = self.core
        rec = self._recompute_spec(batch)
        ids = None if rec is None else [np.asarray(self.slots[rid]) for rid, _ in batch]  # slots stand for ids
        rids, lens = [rid for rid, _ in batch], [len(self.slots[rid]) for rid, _ in batch]
        steady = self.fast_decode and rec is None and all(n == 1 for _, n in batch)
        if self.publish_slots and all(n == 1 for _, n in batch):
            core.continuity.slots.publish(rids, lens, loc.tolist())
        if steady and core.prepare_decode_step(rids, lens, loc):
            self.fast_steps += 1
            # the adapter's steady step (``LayeredTorchNativeAttnBackend._prepare``): the fast path
            # in the identity layout stages nothing, and its layers skip every per-layer call
            steady = self.skip_idle is True and core.store.identity
        else:
            steady = False
            core.prepare_step([(rid, torch.tensor(self.slots[rid])) for rid, _ in batch], loc, [n for _, n in batch],
                              recompute=rec, recompute_ids=ids)
        self.check_staging()
        graph = self._admit_graph(batch, loc) if rec is None else None
        if graph is not None:
            return self._graph_layers(graph, batch, loc)
        idle = steady or self.skip_idle == "always" or (self.skip_idle is True and core.layers_idle)
        self.idle_steps += idle
        self.steady_steps += steady
        skip_enter = idle or self.skip_idle == "enter"
        for layer in range(core.layers):
            if not skip_enter:
                core.enter_layer(layer)
            k, v = self._layer_kv(layer, loc)
            core.write(layer, loc, k.to(core.store.device), v.to(core.store.device))
            if rec is not None:
                self._write_recompute(layer, batch)
            if self.on_layer is not None:
                self.on_layer(layer)
            self._rows = None  # the served attention takes the layer's row table once
            for b, (rid, _) in enumerate(batch):
                got_k, got_v = self.read_in_step(layer, b, self.slots[rid])
                want = [self.shadow[(layer, s)] for s in self.slots[rid]]
                assert torch.equal(got_k.cpu(), torch.stack([w[0] for w in want])), (rid, layer)
                assert torch.equal(got_v.cpu(), torch.stack([w[1] for w in want])), (rid, layer)
            if not idle or (layer == core.layers - 1 and not steady):
                core.exit_layer(layer)
        assert (core.tables is None or steady) and core.store.staging_pages == 0
        self.steps += 1
        return True

    def _layer_kv(self, layer: int, loc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Random new K/V of the step's slots ``loc`` at ``layer`` (host, the pool's dtype), recorded
        in the shadow."""
        core = self.core
        shape = (loc.numel(), core.config.kv_heads, core.config.head_dim)
        k = torch.randn(shape, generator=self.gen).to(core.store.dev.dtype)
        v = torch.randn(shape, generator=self.gen).to(core.store.dev.dtype)
        for i, slot in enumerate(loc.tolist()):
            self.shadow[(layer, slot)] = (k[i].clone(), v[i].clone())
        return k, v

    def _admit_graph(self, batch: Sequence[tuple[str, int]], loc: torch.Tensor) -> Any:
        """:attr:`graph_buffers` loaded with this decode step, or None (the reason counted)."""
        g, core = self.graph_buffers, self.core
        if g is None or any(n != 1 for _, n in batch):
            return None
        why = g.why_not(None if core.overflow else core.tables, len(batch))
        if why is not None:
            self.graph_declined[why.split(";")[0]] += 1
            return None
        g.load(core.tables, padded_to=len(batch), slots=loc)
        core.pipeline.in_graph()
        self.graph_steps += 1
        return g

    def _graph_layers(self, g: Any, batch: Sequence[tuple[str, int]], loc: torch.Tensor) -> bool:
        """The step's layers as a graph replays them: the buffers' calls only, the shadow check
        reading the buffers' page table; the core's last exit ends the step."""
        core = self.core
        for layer in range(core.layers):
            g.enter(layer)
            k, v = self._layer_kv(layer, loc)
            g.write(core.store, layer, k.to(core.store.device), v.to(core.store.device))
            if self.on_layer is not None:
                self.on_layer(layer)
            for b, (rid, _) in enumerate(batch):
                lo, hi, n = int(g.kv_indptr[b]), int(g.kv_indptr[b + 1]), int(g.kv_lens[b])
                pages = g.tab[layer][lo:hi].to(torch.int64)
                rows = (pages[:, None] * self.ps + torch.arange(self.ps, device=pages.device)).reshape(-1)[:n]
                k_all, v_all = core.device_kv()
                want = [self.shadow[(layer, s)] for s in self.slots[rid]]
                assert torch.equal(k_all[rows].cpu(), torch.stack([w[0] for w in want])), (rid, layer, "graph")
                assert torch.equal(v_all[rows].cpu(), torch.stack([w[1] for w in want])), (rid, layer, "graph")
            g.exit(layer)
        core.exit_layer(core.layers - 1)
        assert core.tables is None and core.store.staging_pages == 0
        self.steps += 1
        return True

    def _recompute_spec(self, batch: Sequence[tuple[str, int]]) -> np.ndarray | None:
        """(u, k) per batch row for a decode step (u clamped below the request's page count)."""
        if not self.recompute or any(n != 1 for _, n in batch):
            return None
        rows = []
        for rid, _ in batch:
            u, k = self.recompute.get(rid, (0, 0))
            rows.append((min(u, len(self.pages(rid)) - 1), k))
        return np.asarray(rows, dtype=np.int64) if any(u for u, _ in rows) else None

    def _write_recompute(self, layer: int, batch: Sequence[tuple[str, int]]) -> None:
        """What the forward's recompute rows produce at ``layer``: the prefix tokens' own K/V
        (recomputation is exact), in the step's recompute token order."""
        tables = self.core.tables
        if tables is None or tables.recompute is None:
            return
        rec = tables.recompute
        ks, vs = [], []
        for j, row in enumerate(rec.order.tolist()):
            for slot in self.slots[batch[row][0]][: int(rec.tokens[j])]:
                ks.append(self.shadow[(layer, slot)][0])
                vs.append(self.shadow[(layer, slot)][1])
        if not ks:
            return
        k, v = torch.stack(ks), torch.stack(vs)
        if self.corrupt_recompute:
            k = k + 1
        dev = self.core.store.device
        self.recompute_rows += self.core.write_recompute(layer, k.to(dev), v.to(dev))

    def read_in_step(self, layer: int, b: int, slots: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Request ``b``'s K/V at ``layer`` exactly as the served attention reads them."""
        core = self.core
        if core.overflow:
            return core.read_kv(layer, torch.tensor(slots))
        if core.store.identity and (core.token_tables or not core.paged_reads):  # the paged kernels read tables
            k_layer, v_layer = core.layer_in_place(layer)
            idx = torch.tensor(slots, device=k_layer.device)
            return k_layer[idx], v_layer[idx]
        if not core.token_tables:
            return self._read_paged(layer, b, slots)
        if self._rows is None:
            self._rows = core.token_rows(layer)
        rows = self._rows[b, : len(slots)]
        k_all, v_all = core.device_kv()  # (on CUDA the read is ordered after the fetch by the stream wait)
        return k_all[rows], v_all[rows]

    def _read_paged(self, layer: int, b: int, slots: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """As a paged kernel reads request ``b`` (FlashInfer, Triton): its pages from the layer's
        page table row through the CSR, ``kv_lens[b]`` tokens; the CSR's lengths must agree."""
        t = self.core.tables
        assert t is not None
        lo, hi = int(t.kv_indptr[b]), int(t.kv_indptr[b + 1])
        n, last = int(t.kv_lens[b]), int(t.last_page_len[b])
        assert n == len(slots) and last == n - (hi - lo - 1) * self.ps, (b, n, last, len(slots))
        # the host copies FlashInfer's plan reads (StepTables.plan_view) say the same
        assert int(t.host_indptr[b]) == lo and int(t.host_indptr[b + 1]) == hi and int(t.host_last_page_len[b]) == last
        assert t.host_indptr.device.type == "cpu" and t.host_last_page_len.device.type == "cpu"
        pages = t.tab[layer][lo:hi].to(torch.int64)
        rows = (pages[:, None] * self.ps + torch.arange(self.ps, device=pages.device)).reshape(-1)[:n]
        k_all, v_all = self.core.device_kv()
        return k_all[rows], v_all[rows]

    # ----- control plane / scheduler changes ----------------------------------------------

    def pages(self, rid: str) -> tuple[int, ...]:
        return tuple(dict.fromkeys(s // self.ps for s in self.slots[rid]))

    def want(self, rid: str, layers: Sequence[bool], paused: bool = False, uncached: int = 0) -> None:
        if rid not in self.slots or not self.slots[rid]:
            return
        pages = self.pages(rid)
        self.core.update_residency({rid: RequestResidency(pages=pages, gpu_layers=tuple(layers), paused=paused,
                                                          uncached_pages=min(uncached, len(pages) - 1))})
        (self.paused.add if paused else self.paused.discard)(rid)

    def finish(self, rid: str) -> None:
        """The request ends; pages nobody else uses go back to SGLang's allocator."""
        if rid not in self.slots:
            return
        slots = self.slots.pop(rid)
        self.paused.discard(rid)
        self.recompute.pop(rid, None)
        pages = sorted({s // self.ps for s in slots if self._refs(s // self.ps) == 0})
        self.finishes += 1
        if self.finishes % 2:  # SGLang's order: the frees before the release
            self.core.page_freed(pages)
            self.core.release_request(rid)
        else:
            self.core.release_request(rid)
            self.core.page_freed(pages)
        self.free_pages.extend(pages)
        for slot in slots:
            if self._refs(slot // self.ps) == 0:
                for layer in range(self.core.layers):
                    self.shadow.pop((layer, slot), None)

    def rewrite_prefix(self, rid: str, src: str) -> bool:
        """SGLang's prefix dedupe after a prefill (``cache_unfinished_req``): the tree already
        holds ``src``'s first page for the same tokens, so ``rid``'s row is rewritten to it and
        ``rid``'s own copy freed. (Here the two pages' K/V differ: ``rid`` reads ``src``'s from
        now on, as the rewritten row says.) False when it does not apply -- also when ``rid``'s
        first page is shared with another request: SGLang rewrites only a request's own unshared
        slots (``RadixCache._insert_cache``: ``[cache_protected_len, prefix_len)``), so a shared
        page never leaves a row while its other users keep it."""
        return rid != src and self._rewrite_first_page(rid, self.slots.get(src))

    def _rewrite_first_page(self, rid: str, a: list[int] | None) -> bool:
        """``rid``'s first page replaced by the first page of slots ``a`` (see :meth:`rewrite_prefix`)."""
        b = self.slots.get(rid)
        ps = self.ps
        if not a or not b or len(a) < ps or len(b) <= ps or a[0] // ps == b[0] // ps:
            return False
        if self._refs(b[0] // ps) > 1:
            return False
        old = b[0] // ps
        b[:ps] = a[:ps]
        if self._refs(old) == 0:
            self.core.page_freed([old])
            self.free_pages.append(old)
            for slot in range(old * ps, old * ps + ps):
                for layer in range(self.core.layers):
                    self.shadow.pop((layer, slot), None)
        self.rewrites += 1
        return True

    # ----- invariants ------------------------------------------------------------------------

    def check_staging(self) -> None:
        """During a staged step: every host-only layer-page of the batch points at a reserved
        staging page (or its identity page), and the budget holds resident + staging."""
        core = self.core
        alloc = core.store.allocator
        assert alloc.used_count <= alloc.capacity
        tables = core.tables
        if tables is None:
            return
        tab = tables.tab.cpu().numpy()
        host = core.store.map_np[:, tables.pages] < 0
        if core.store.identity:
            assert np.array_equal(tab[host], core.store.identity_ids(tables.pages)[host])
        else:
            staged = set(tables.staging_ids.tolist())
            assert set(tab[host].tolist()) <= staged
            assert staged.isdisjoint(core.store.map_np[core.store.map_np >= 0].tolist())
            # resident entries are the map's (PagedStepTables gathers them from the mirror; a
            # recompute step points recomputed prefix pages at transient staging instead)
            if tables.recompute is None:
                assert np.array_equal(tab[~host], core.store.map_np[:, tables.pages][~host])
            mirror = core.store.mirror
            if mirror is not None and not mirror.pending:  # synced by this step's build
                assert np.array_equal(mirror.dev.cpu().numpy(), core.store.map_np)
                assert np.array_equal(mirror.host_bits, mirror._bits(core.store.map_np))

    def check_at_rest(self) -> None:
        """Between forwards: every live token's K/V reads back bit-exact; the map and allocator
        agree (no leak, no double use); dirty marks only on resident layer-pages. The free-page
        figure read first (the journal, if any, unapplied) is what it is once everything settled."""
        store = self.core.store
        free_unsettled = self.core.free_device_pages()
        self.core.settle()
        assert free_unsettled == self.core.free_device_pages()
        for rid, slots in self.slots.items():
            if not slots:
                continue
            for layer in range(self.core.layers):
                got_k, got_v = self.core.read_kv(layer, torch.tensor(slots))
                want = [self.shadow[(layer, s)] for s in slots]
                assert torch.equal(got_k.cpu(), torch.stack([w[0] for w in want])), (rid, layer)
                assert torch.equal(got_v.cpu(), torch.stack([w[1] for w in want])), (rid, layer)
        mapped = store.map_np[store.map_np >= 0].tolist()
        assert len(mapped) == len(set(mapped))
        assert set(mapped) == store.allocator.used_ids()
        assert not (store.dirty_np & (store.map_np < 0)).any()


def two_offloading(core: LayeredKVCore, seed: int = 7) -> CoreDriver:
    """Requests ``a`` (6 tokens) and ``b`` (4) prefilled on ``core``, then both wanting only layer
    1 of 3 on the device (layers 0 and 2 offloaded): the next decode step stages both."""
    d = CoreDriver(core, seed=seed)
    d.add("a")
    d.add("b")
    d.step([("a", 6), ("b", 4)])
    d.want("a", [False, True, False])
    d.want("b", [False, True, False])
    return d


def offload_scenario(driver: CoreDriver) -> None:
    """Two requests with offloaded layers: a prefill, decode steps, a pause, a resume; then every
    live token is checked at rest (each step checks inside every layer)."""
    driver.add("a")
    driver.add("b")
    driver.step([("a", 5), ("b", 3)])
    driver.want("a", [True, False, True])
    driver.want("b", [False, False, True])
    for _ in range(4):
        driver.step([("a", 1), ("b", 1)])
    driver.want("b", [True] * LAYERS, paused=True)
    driver.step([("a", 2)])
    driver.want("b", [True, False, False])
    driver.step([("a", 1), ("b", 1)])
    driver.check_at_rest()


def offloaded_driver(*, device: str = "cpu", clock: Any = None) -> CoreDriver:
    """A staged core with two requests whose layers 1 and 2 are on host (each decode step fetches
    and writes back), after one closed transfer step. ``clock`` replaces the engine's clock."""
    core = make_core(33 + 40, device=device)
    if clock is not None:
        core.store.engine.clock = clock
    d = CoreDriver(core, seed=5)
    for rid in ("a", "b"):
        d.add(rid)
        assert d.step([(rid, 5)])
    for rid in ("a", "b"):
        d.want(rid, [True, False, False])
    if device == "cuda":
        torch.cuda.synchronize()
    core.close_transfer_step()
    return d
