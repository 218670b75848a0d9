"""LivePages: the give-up view (on the dirty and paused pages, with the counts' orphan count) agrees
with a brute-force pass over the whole pool, and never builds pool-sized masks."""

from __future__ import annotations

import random

import numpy as np
import pytest

from sglang_ext.dataplane.live_pages import LivePages, live_layer_pages
from tests.dataplane.core_driver import LAYERS, PAGE, CoreDriver, make_core


class TreeDriver(CoreDriver):
    """A finished request's pages may stay with SGLang's prefix cache (``cache``): not freed."""

    def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
        super().__init__(*args, **kwargs)
        self.cached: dict[str, list[int]] = {}

    def _refs(self, page: int) -> int:
        return super()._refs(page) + sum(1 for s in self.cached.values() if page in {x // self.ps for x in s})

    def cache(self, rid: str) -> None:
        self.core.release_request(rid)
        self.cached[rid] = self.slots.pop(rid)
        self.paused.discard(rid)

    def evict(self, rid: str) -> None:
        slots = self.cached.pop(rid)
        freed = sorted({s // self.ps for s in slots if self._refs(s // self.ps) == 0})
        self.core.page_freed(freed)
        self.free_pages.extend(freed)


def random_op(d: TreeDriver, rng: random.Random, n: int) -> int:
    """One random lifecycle operation (new request, maybe a prefix hit on cached pages; a batched
    step; a plan or pause; caching a request's pages, evicting the oldest; a finish); returns the
    next request number."""
    op, rids = rng.random(), list(d.slots)
    if op < 0.2 or not rids:
        rid, n = f"r{n}", n + 1
        d.add(rid)
        if d.cached and rng.random() < 0.5:  # a prefix hit on a cached request's pages
            src = d.cached[rng.choice(sorted(d.cached))]
            d.slots[rid] = list(src[: rng.randint(0, len(src) // d.ps) * d.ps])
    elif op < 0.6:
        d.step([(r, rng.choice([1, 1, 3])) for r in rng.sample(rids, rng.randint(1, len(rids)))])
    elif op < 0.8:
        d.want(rng.choice(rids), [rng.random() < 0.6 for _ in range(LAYERS)], paused=rng.random() < 0.3)
    elif op < 0.9:
        d.cache(rng.choice(rids))
        if len(d.cached) > 2:
            d.evict(sorted(d.cached)[0])
    else:
        d.finish(rng.choice(rids))
    return n


def brute_force(core) -> tuple[int, list[tuple[int, list[int]]], tuple[int, int]]:  # noqa: ANN001
    """Orphan resident count, give-up order and live stats over the whole ``[L, P]`` map (the
    computation LivePages replaces)."""
    core.settle()  # recorded releases and frees first (what every reader does)
    res = core.residency
    store = core.store
    reqs = list(res.requests.values())
    resident = store.map_np >= 0
    used = np.zeros(store.config.logical_pages, dtype=bool)
    paused = np.zeros_like(used)
    target = np.zeros_like(resident)
    for r in reqs:
        p = r.pages.numpy()
        used[p] = True
        if r.paused:
            paused[p] = True
        else:
            for layer, on in enumerate(r.gpu_layers):
                if on:
                    target[layer, p] = True
    orphan = ~used
    removable = resident & ~target & (paused | orphan)[None, :]
    order: list[tuple[int, list[int]]] = []
    for layer in range(store.config.layers - 1, -1, -1):
        pages = np.flatnonzero(removable[layer] & orphan)
        if pages.size:
            order.append((layer, pages.tolist()))
    taken = np.zeros_like(resident)
    for r in sorted((r for r in reqs if r.paused), key=lambda r: r.pause_seq):
        p = np.unique(r.pages.numpy())
        for layer in range(store.config.layers - 1, -1, -1):
            sel = p[removable[layer, p] & ~taken[layer, p]]
            if sel.size:
                taken[layer, sel] = True
                order.append((layer, sel.tolist()))
    live = np.flatnonzero(used)
    stats = (live.size * store.config.layers, int((store.map_np[:, live] < 0).sum()))
    return int((resident & orphan[None, :]).sum()), order, stats


def _view_order(core) -> list[tuple[int, list[int]]]:  # noqa: ANN001
    live = core.residency.live_pages()
    removable = live.resident & ~live.target() & live.paused[None, :]
    return [(layer, pages.tolist()) for layer, pages in live.removable_order(removable)]


@pytest.mark.parametrize("seed", range(6))
def test_live_view_matches_the_pool_wide_pass(seed):
    """Random steps, plans, pauses, finishes and prefix-cached requests under tight budgets: the
    orphan count, reclaimable pages, removable order and live stats equal the pool-wide pass."""
    rng = random.Random(seed)
    d = TreeDriver(make_core(rng.choice([9, 15, 24, 40])), seed=seed)
    n = 0
    for _ in range(50):
        n = random_op(d, rng, n)
        count, order, stats = brute_force(d.core)
        live = d.core.residency.live_pages()
        assert live.orphan_resident == count
        assert _view_order(d.core) == order
        assert live_layer_pages(d.core.store, d.core.residency.requests.values()) == stats
        d.core.settle()  # (frees recorded, not applied: the figure reads the pool as it is)
        assert d.core.residency.reclaimable_pages == count  # counted now, fast paths included
    d.check_at_rest()


def test_missed_orphans_are_found_by_the_fallback_scan():
    """If the list of maybe-orphan pages misses one, the count disagrees and the map is scanned:
    the give-up order is still the pool-wide one."""
    d = TreeDriver(make_core(30), seed=0)
    d.add("a")
    d.step([("a", 6)])
    d.cache("a")
    d.core.update_residency({})
    d.core.residency.maybe_orphan.clear()
    live = d.core.residency.live_pages()
    assert live.orphan_resident == 3 * LAYERS
    assert _view_order(d.core) == brute_force(d.core)[1] and _view_order(d.core)
    assert d.core.residency.maybe_orphan == {1, 2, 3}  # relearned from the scan


def test_full_reconciliation_builds_no_pool_sized_mask(monkeypatch):
    """Finishes, plans and pauses reconcile without the store's ``[L, P]`` resident mask."""
    d = TreeDriver(make_core(20), seed=0)

    def refuse():  # noqa: ANN202
        raise AssertionError("pool-sized mask built")

    monkeypatch.setattr(d.core.store, "resident_mask", refuse)
    for rid in "abc":
        d.add(rid)
        d.step([(rid, 5)])
    full = d.core.residency.full_reconciles
    d.want("a", [True, False, True])
    d.want("b", [True] * LAYERS, paused=True)
    d.cache("c")
    d.finish("a")
    d.add("e")
    d.step([("e", 7)])
    assert d.core.residency.full_reconciles > full
    assert isinstance(d.core.residency.live_pages(), LivePages)
    monkeypatch.undo()
    d.check_at_rest()


def test_pages_lent_as_staging_are_not_counted_resident():
    """Device pages the staging room has lent out (a step's staging, or a tool's transient take)
    are in the allocator's count but hold no layer-page: the orphan count leaves them out."""
    d = TreeDriver(make_core(30), seed=0)
    d.add("a")
    d.step([("a", 6)])
    d.cache("a")
    ids = d.core.room.take(4)
    assert ids is not None and d.core.residency.staging_lent == 4
    assert d.core.residency.live_pages().orphan_resident == brute_force(d.core)[0] == 3 * LAYERS
    d.core.room.give_back(ids)
    assert d.core.residency.staging_lent == 0


@pytest.mark.parametrize("tight", [False, True])
def test_a_paused_request_does_not_put_every_step_on_the_full_pass(tight):
    """A paused request's resident layers are given up only when space is needed, and the
    appended-pages path falls back to the full pass by itself when the new pages do not fit. So
    once the pause is reconciled, decode steps of the others with room to spare take the cheap
    path (before, any paused request made every step a full reconciliation); with the device full
    (``tight``, the control) the steps that open pages do reconcile fully and give up the paused
    request's layers, and the KV stays exact either way (the driver's checks)."""
    d = CoreDriver(make_core(3 * 3 * LAYERS + 4 if tight else 30 * LAYERS, pages=40), seed=1)
    for rid in ("a", "b", "p"):
        d.add(rid)
        assert d.step([(rid, 6)])
    d.want("p", [True] * LAYERS, paused=True)
    res = d.core.residency
    full = res.full_reconciles
    for _ in range(12):  # six new pages each for a and b
        assert d.step([("a", 1), ("b", 1)])
    d.check_at_rest()
    resident_p = int((d.core.store.map_np[:, sorted({s // PAGE for s in d.slots["p"]})] >= 0).sum())
    if tight:
        assert res.full_reconciles - full >= 6 and resident_p < 3 * LAYERS
    else:
        assert res.full_reconciles - full <= 1 and resident_p == 3 * LAYERS


@pytest.mark.parametrize("budget", [3 * 4 * LAYERS + 8, 30 * LAYERS])
def test_paused_beside_an_offloading_request_and_a_shared_prefix(budget):
    """The cheap path with requests paused when the staging reserve is not zero (``a`` keeps one
    layer of three on the device) and the paused request shares a prefix page with a running one:
    steps that open pages, then the resume. Every wanted layer-page is on the device whenever no
    full pass is pending, and the KV reads back exactly (the driver checks inside every layer and
    at rest); at the tight budget the full pass runs and gives up paused layers."""
    d = CoreDriver(make_core(budget, pages=40), seed=2)
    d.add("b")
    assert d.step([("b", 6)])
    d.add("p", share_from="b", share_pages=2)
    d.add("a")
    assert d.step([("p", 3), ("a", 6)])
    d.want("a", [True, False, False])
    d.want("p", [True] * LAYERS, paused=True)
    res, store = d.core.residency, d.core.store
    full, reserves = res.full_reconciles, []
    for step in range(10):
        assert d.step([("a", 1), ("b", 1)])
        reserves.append(res.staging_reserve())
        if not res.changed:  # nothing pending: the running requests' wanted layer-pages are resident
            for rid, layers in (("a", [0]), ("b", range(LAYERS))):
                cols = sorted({s // PAGE for s in d.slots[rid]})
                assert (store.map_np[np.ix_(list(layers), cols)] >= 0).all(), (step, rid)
        d.check_at_rest()
    assert min(reserves) > 0  # a's staging slot kept free on every step
    p_cols = sorted({s // PAGE for s in d.slots["p"]})
    if budget < 30 * LAYERS:
        assert res.full_reconciles > full and (store.map_np[:, p_cols] >= 0).sum() < LAYERS * len(p_cols)
    d.want("p", [True] * LAYERS)  # resumed
    assert d.step([("p", 1), ("a", 1), ("b", 1)])
    d.check_at_rest()
