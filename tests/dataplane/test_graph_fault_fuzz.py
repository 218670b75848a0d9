"""Random histories of the served core driven through its CUDA-graph admission path, with faults:
decode steps admitted by :class:`DecodeGraphs` (its :class:`GraphStepBuffers` and, in the paged
layout, :class:`GraphStaging`) and replayed padded to a captured size, or declined and run
eagerly; replays skipped (admitted, never run) or stopped after a layer; ``defer_tables``,
``defer_start`` and the mirror's staged uploads on or off; and single calls of the real objects'
methods that raise -- copy launches, the tables' upload, the mirror's sync, scatter and ring
upload, the graph block's send, the graph's join -- or find the pool full (a staging take or
renew). Prefixes are shared and cached, layers placed and paused, budgets go down to
overflow, in the identity and paged layouts (the fault fuzz of the eager path,
``test_fault_fuzz.py``, whose driver and checks this one extends).

A raise may escape an operation (the server logs it and keeps serving); the tokens of a forward
it cut short are unknown from the layer it reached on (a skipped or stopped replay's at every
layer). After every operation between forwards every other token reads back bit-exact at every
layer it was written at, the map and the allocator agree, no staging is lent, and the mirror
equals the map (before its sync: in every column not logged as pending); inside each forward
every layer reads what was written (eager: the step's tables; graphed: the buffers' gathered
page table). Once every request ended and the cache is evicted, no device page is in use. Why:
session 77's fault fuzz of the graph path found a boundary raise that left the last tables to
advance a token behind and builds that leaked their staging (``test_boundary_raise.py``); this is
the regression guard over the whole path. The graph's two launches run as their torch references
(as ``test_graph_staging_streams.py`` runs them; ``tests/kernels`` checks the kernels against them);
a graph replay is its layers' buffer calls run again (``_Graph``). Controls, run by hand on a
scratch copy: each of session 77's fault fixes undone -- a raising paged decode boundary keeping
the last tables, ``StagingRoom.building`` or the staged advance not giving staging back,
``LayerPipeline.end_step`` forgetting the step before its launches, the mirror's sync or the
opening advance not logging untransferred columns again -- fails 3 to 9 of the 30 seeds."""

from __future__ import annotations

import contextlib
import functools
import random
from collections import Counter
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Any

import numpy as np
import pytest
import torch

from kernels.block_copy import copy_segments_ref, fetch_page_indices
from sglang_ext.dataplane import graph_staging
from sglang_ext.dataplane.decode_graphs import DecodeGraphs
from sglang_ext.dataplane.layered_kv_core import LayeredKVCore
from sglang_ext.dataplane.slot_store_config import SlotStoreConfig
from tests.dataplane.core_driver import DIM, HEADS
from tests.dataplane.test_fault_fuzz import FaultDriver, random_op

SEEDS = range(30)
STEPS = 120
FAULT_RATE = 0.5
"""Share of boundary-carrying operations (steps, wants) in which a fault may fire."""
RATES = {"launch": 0.08, "upload": 0.15, "ring": 0.2, "sync": 0.2, "scatter": 0.6, "send": 0.1, "join": 0.2,
         "full": 0.1}
"""Per call of an armed point, the chance that it faults (about even fires per point: launches
and uploads are called most, the mirror's scatter least)."""
INJECTED = "injected fault"


def _fetch_ref(host: torch.Tensor, dev: torch.Tensor, flat: torch.Tensor, stage: torch.Tensor, map_row: torch.Tensor,
               reqs: torch.Tensor, starts: torch.Tensor, counts: torch.Tensor, max_pages: int, host_base: int,
               host_stride: int, dev_v: int, programs: int | None = None, listed: Any = None) -> None:
    """``fetch_pages_triton(listed=)`` as its reference: the listed requests' host-only pages."""
    n = int(listed[0])
    src, dst = fetch_page_indices(flat.numpy(), stage.numpy(), map_row.numpy(), reqs[:n].numpy(), starts.numpy(),
                                  counts.numpy(), host_base, host_stride, dev_v)
    copy_segments_ref(host, dev, torch.from_numpy(src), torch.from_numpy(dst))


def _copy_ref(src: torch.Tensor, dst: torch.Tensor, src_idx: torch.Tensor, dst_idx: torch.Tensor,
              programs: int | None = None, count: Any = None) -> None:
    """``copy_segments_triton(count=)`` as its reference: the first ``count`` pairs."""
    n = int(count[0])
    copy_segments_ref(src, dst, src_idx[:n], dst_idx[:n])


def _pool_full(allocator: Any, real: Callable[..., Any], *args: Any) -> Any:
    """``real(*args)`` (a staging take or renew) with every allocation of ``allocator`` finding the pool full."""
    alloc = allocator.alloc
    allocator.alloc = lambda n: None if n else alloc(n)
    try:
        return real(*args)
    finally:
        del allocator.alloc


class Faults:
    """Faults injected into the real objects' methods: each wraps the method (an instance
    attribute over the class's) and, in an operation that :meth:`live` allows, raises on a call
    with its point's probability (:data:`RATES`) -- or runs the call with the pool full
    (``full``) -- once per operation; the calls before and after run as they are."""

    def __init__(self, rng: random.Random, full: Callable[..., Any]) -> None:
        self.rng, self.full = rng, full
        self.fired: Counter[str] = Counter()
        self.names: set[str] = set()
        self._live: frozenset[str] = frozenset()

    def install(self, name: str, owner: Any, attr: str, when: Callable[..., bool] | None = None) -> None:
        """Point ``name``: ``owner.attr``, faulted where ``when(owner, *args)`` (default: always)."""
        real = getattr(owner, attr)

        def hook(*args: Any, **kwargs: Any) -> Any:
            if name in self._live and (when is None or when(owner, *args)) and self.rng.random() < RATES[name]:
                self._live = frozenset()  # one fault an operation
                self.fired[name] += 1
                if name == "full":
                    return self.full(real, *args, **kwargs)
                raise RuntimeError(f"{INJECTED}: {name}")
            return real(*args, **kwargs)

        setattr(owner, attr, hook)
        self.names.add(name)

    @contextlib.contextmanager
    def live(self, names: Collection[str] | None = None) -> Iterator[None]:
        """An operation in which the points ``names`` (default: all) may fault, with probability
        :data:`FAULT_RATE`."""
        if self.rng.random() < FAULT_RATE:
            self._live = frozenset(self.names if names is None else names)
        try:
            yield
        finally:
            self._live = frozenset()


class _Graph:
    """A captured graph's stand-in: the capture runs the layers once over the padding-only step
    (as CUDA's warm-up and capture do: onto the sink only), a replay runs them again -- the
    buffers' calls a graph holds, plus the driver's reads (its checks)."""

    def capture(self, fn: Callable[[], Any]) -> Any:
        self.fn = fn
        return fn()

    def replay(self) -> None:
        self.fn()


class GraphFaultDriver(FaultDriver):
    """:class:`FaultDriver` whose decode steps go through :class:`DecodeGraphs`' admission and
    whose boundaries and layers may raise (:class:`Faults`); ``stop_at`` stops an eager forward
    or a replay after that layer (-1: before layer 0; a replay admitted and never run)."""

    def __init__(self, core: LayeredKVCore, graphs: DecodeGraphs, faults: Faults, seed: int,
                 rng: random.Random, fast_decode: bool) -> None:
        super().__init__(core, seed=seed, fast_decode=fast_decode, paged_reads=True, rng=rng)
        self.graphs, self.faults = graphs, faults
        self.counts: Counter[str] = Counter()
        self._ctx: tuple[list[tuple[str, int]], torch.Tensor, int] | None = None
        graphs.capture(self._replayed_layers, _Graph)

    # ----- faults ---------------------------------------------------------------------------

    def _escaped(self, exc: RuntimeError, where: str) -> None:
        if INJECTED not in str(exc):
            raise exc
        self.counts[f"escaped {where}"] += 1

    def _lost(self, loc: torch.Tensor, first: int) -> None:
        """The step's tokens from layer ``first`` on were never written (or not written back)."""
        for layer in range(first, self.core.layers):
            for s in loc.tolist():
                self.shadow.pop((layer, s), None)
                self.unknown.add((layer, s))

    # ----- operations -----------------------------------------------------------------------

    def want(self, rid: str, layers: Sequence[bool], paused: bool = False, uncached: int = 0) -> None:
        try:
            with self.faults.live(("launch", "join")):  # a held step's end, the moves
                super(FaultDriver, self).want(rid, layers, paused, uncached)
        except RuntimeError as exc:
            self._escaped(exc, "want")
            req = self.core.residency.requests.get(rid)  # recorded or not (a held step's join raised first)
            (self.paused.add if req is not None and req.paused else self.paused.discard)(rid)

    def step(self, batch: Sequence[tuple[str, int]]) -> bool:
        stop, self.stop_at = self.stop_at, None
        core = self.core
        grown = self.grow_batch(batch)
        if grown is None:
            return False
        batch, news, loc, rids, lens = grown
        decode = all(n == 1 for _, n in batch)
        if self.publish_slots and decode:
            core.continuity.slots.publish(rids, lens, loc.tolist())
        with self.faults.live():
            try:
                if not (self.fast_decode and decode and core.prepare_decode_step(rids, lens, loc)):
                    core.prepare_step([(rid, torch.tensor(self.slots[rid])) for rid, _ in batch], loc,
                                      [n for _, n in batch])
                self.check_staging()
                size = self.graphs.admit(slots=loc) if decode else None
            except RuntimeError as exc:  # the boundary or the admission: the forward never runs
                self._escaped(exc, "boundary")
                self._lost(loc, 0)
                return True
            if size is not None:
                self._replay(batch, loc, size, stop)
            else:
                self._eager(batch, loc, stop)
        self.steps += 1
        return True

    def _eager(self, batch: list[tuple[str, int]], loc: torch.Tensor, stop: int | None) -> None:
        core = self.core
        last = core.layers - 1 if stop is None else stop
        self.counts["eager" if stop is None else "eager stopped"] += 1
        for layer in range(last + 1):
            try:
                self.run_layer(layer, batch, loc)
            except RuntimeError as exc:  # the forward ends here; the next boundary ends its step
                self._escaped(exc, "layer")
                self._lost(loc, layer)
                return
        if stop is None:
            assert core.tables is None and core.store.staging_pages == 0
        self._lost(loc, last + 1)

    def _replay(self, batch: list[tuple[str, int]], loc: torch.Tensor, size: int, stop: int | None) -> None:
        core = self.core
        last = core.layers - 1 if stop is None else stop
        staged = self.graphs.buffers.staging is not None and bool(core.tables.staging_ids.size)  # type: ignore[union-attr]
        self.counts["padded" if size > len(batch) else "unpadded"] += 1
        self.counts["staged replays"] += staged
        if last < 0:
            self.counts["skipped"] += 1
            self._lost(loc, 0)  # admitted, never replayed: the next boundary ends the step
            return
        self._ctx = (list(batch), loc, last)
        try:
            self.graphs.replay(size)
        finally:
            self._ctx = None
        if stop is not None:  # the replay stopped: its write-back never ran
            self.counts["stopped"] += 1
            self._lost(loc, 0)
            return
        self.counts["replayed"] += 1
        try:
            core.exit_layer(core.layers - 1)  # the step ends as after a replay (the join may raise: held)
        except RuntimeError as exc:
            self._escaped(exc, "join")
            return
        assert core.tables is None and core.store.staging_pages == 0

    def _replayed_layers(self, bs: int) -> list[torch.Tensor]:
        """The layers as a replay runs them: the buffers' calls only (a capture: padding rows);
        each real row's KV read through the buffers' page table and CSR equals the shadow."""
        core, g = self.core, self.graphs.buffers
        batch, loc, last = self._ctx if self._ctx is not None else ([], torch.zeros(0, dtype=torch.int64), -2)
        shape = (bs - len(batch), core.config.kv_heads, core.config.head_dim)
        for layer in range(core.layers if last == -2 else last + 1):
            g.enter(layer)
            pad_k, pad_v = torch.randn(shape, generator=self.gen), torch.randn(shape, generator=self.gen)
            k, v = self._layer_kv(layer, loc) if batch else (pad_k[:0], pad_v[:0])
            g.write(core.store, layer, torch.cat([k, pad_k]), torch.cat([v, pad_v]))
            k_all, v_all = core.device_kv()
            for b, (rid, _) in enumerate(batch):
                lo, hi, n = int(g.kv_indptr[b]), int(g.kv_indptr[b + 1]), int(g.kv_lens[b])
                pages = g.tab[layer][lo:hi].to(torch.int64)
                rows = (pages[:, None] * self.ps + torch.arange(self.ps)).reshape(-1)[:n]
                assert n == rows.numel() == len(self.slots[rid]), (rid, layer, "graph CSR", n, len(self.slots[rid]))
                for i, s in enumerate(self.slots[rid]):
                    if (layer, s) not in self.unknown:
                        want_k, want_v = self.shadow[(layer, s)]
                        assert torch.equal(k_all[rows[i]], want_k) and torch.equal(v_all[rows[i]], want_v), \
                            (rid, layer, s, "graph")
            g.exit(layer)
        return []

    # ----- invariants ------------------------------------------------------------------------

    def check_at_rest(self) -> None:
        """:meth:`FaultDriver.check_at_rest`'s reads and map checks, after: no staging lent, the
        sink never mapped, and the mirror current in every column not logged as pending (a raise
        between taking columns off the log and scattering them logs them again). The mirror is
        not synced here (the final check does)."""
        core = self.core
        store = core.store
        core.settle()
        assert core.residency.staging_lent == 0 and store.staging_pages == 0, "staging lent at rest"
        if store.sink_page is not None and not store.identity:
            assert store.sink_page not in store.map_np, "the sink page is mapped"
        mirror = store.mirror
        if mirror is not None:
            logged = np.concatenate(mirror._log) if mirror._log else np.zeros(0, dtype=np.int64)
            current = np.setdiff1d(np.arange(store.map_np.shape[1]), logged)
            dev = mirror.dev.cpu().numpy()
            assert np.array_equal(dev[:, current], store.map_np[:, current]), "mirror behind outside its log"
            assert np.array_equal(mirror.host_bits[current], mirror._bits(store.map_np[:, current])), "host bits"
        store.mirror = None  # the reads only: its sync is the next boundary's (one here would hide what it finds)
        try:
            super().check_at_rest()
        finally:
            store.mirror = mirror


def _core(rng: random.Random) -> LayeredKVCore:
    layers, ps, pages = rng.choice([2, 3, 4]), rng.choice([1, 2, 4]), rng.choice([17, 33])
    budget = rng.choice([None, None, layers * pages - 5, pages + 6, pages + 1, 13, 9, 5 + layers])
    return LayeredKVCore(SlotStoreConfig(
        layers=layers, page_size=ps, kv_heads=HEADS, head_dim=DIM, logical_pages=pages,
        device_pages=layers * pages if budget is None else budget, dtype=torch.float32, device="cpu",
        graph_sink=True))


def _driver(seed: int) -> GraphFaultDriver:
    """The core, its graphs (captured sizes, staged or not, buffers maybe too small) and modes."""
    rng = random.Random(seed * 31 + 7)
    core = _core(rng)
    store, mirror = core.store, core.store.mirror
    paged = mirror is not None
    sizes = sorted(set(rng.sample([1, 2, 3, 4, 6], rng.randrange(1, 4))))
    max_pages = rng.choice([core.config.logical_pages + sizes[-1], 2 * core.config.logical_pages, 10])
    graphs = DecodeGraphs(core, sizes, max_pages, staged=paged and rng.random() < 0.75)
    staged = graphs.buffers.staging is not None
    core.defer_tables = rng.random() < 0.5
    if not staged:
        core.pipeline.defer_start = rng.random() < 0.5
    if mirror is not None:
        mirror.staged = rng.random() < 0.5
    faults = Faults(random.Random(seed * 13 + 5), functools.partial(_pool_full, store.allocator))
    d = GraphFaultDriver(core, graphs, faults, seed, random.Random(seed * 7 + 1), rng.random() < 0.85 or paged)
    d.publish_slots = rng.random() < 0.5
    faults.install("launch", store.engine, "_launch")
    faults.install("upload", store.uploads, "upload")
    if mirror is not None:
        faults.install("sync", mirror, "sync", lambda owner, *args: owner.pending)  # a sync with work
        faults.install("scatter", mirror, "scatter")
        faults.install("send", graphs.buffers.block, "send")
        faults.install("full", core.room, "take", lambda room, n: n > 0)
        faults.install("full", core.room, "renew")
        if mirror.staged:
            faults.install("ring", mirror._ring, "upload")
    if staged:
        faults.install("join", store.engine, "after_graph")
    return d


def _history(seed: int) -> tuple[GraphFaultDriver, list[tuple]]:
    """One random history (``STEPS`` operations) of seed ``seed``, checked as it goes, then every
    request ended and the cache evicted: nothing may stay in use."""
    d = _driver(seed)
    rng = random.Random(seed)
    rids = ["a", "b", "c", "d", "e"]
    log: list[tuple] = []
    for _ in range(STEPS):
        random_op(d, rng, rids, log, prefill=0.13, burst=7, stop_p=0.12, stop_from=-1)
        if not d.core.pipeline.active:
            d.check_at_rest()
    for rid in sorted(d.slots):
        d.finish(rid)
    while d.cached:
        d.evict(0)
    d.core.update_residency({})  # the next boundary ends a step still held
    d.check_at_rest()
    store = d.core.store
    if store.mirror is not None:
        store.mirror.sync()
        assert np.array_equal(store.mirror.dev.cpu().numpy(), store.map_np), "mirror after its sync"
    assert store.allocator.used_count == 0, ("in use after every request ended", store.allocator.used_count)
    return d, log


@pytest.fixture
def _reference_launches(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the tables' gather: its torch reference too
    monkeypatch.setattr(graph_staging, "fetch_pages_triton", _fetch_ref)
    monkeypatch.setattr(graph_staging, "copy_segments_triton", _copy_ref)
    monkeypatch.setattr(graph_staging, "triton_usable", lambda *tensors: True)


@pytest.mark.usefixtures("_reference_launches")
def test_random_graph_histories_with_faults_lose_no_kv_and_leak_nothing() -> None:
    """Every seed's history keeps every invariant of the module docstring; across the seeds the
    histories do replay (padded, staged), skip and stop replays, decline steps, fire every fault
    point and let raises escape boundaries, layers, joins and wants (else the test proves nothing)."""
    fired: Counter[str] = Counter()
    counts: Counter[str] = Counter()
    for seed in SEEDS:
        try:
            d, _ = _history(seed)
        except Exception as exc:  # name the seed: ``_history(seed)`` replays it (under the fixture)
            pytest.fail(f"seed {seed}: {type(exc).__name__}: {exc}")
        fired.update(d.faults.fired)
        counts.update(d.counts)
        counts["declined"] += sum(d.graphs.eager_reasons.values())
        counts["deferred"] += d.core.store.deferred_tables
    assert min(fired[name] for name in RATES) >= 4, fired
    least = {"replayed": 200, "padded": 150, "staged replays": 100, "skipped": 8, "stopped": 15, "declined": 250,
             "deferred": 60, "eager stopped": 30, "escaped boundary": 60, "escaped layer": 4, "escaped join": 5,
             "escaped want": 4}
    assert all(counts[key] >= n for key, n in least.items()), (counts, fired)
