"""Paged per-layer views of the layered pool (the FlashInfer path's tables), checked on CPU.

Scenario: requests written through the pool with part of their layers offloaded; the step's
per-layer page tables (resident pages from the map, host-only pages staged into each request's
staging slot, reserved inside the budget) fed to the torch paged-attention reference must equal
dense attention over the shadow K/V. On a GPU the same tables feed FlashInfer
(``test_layered_pool_gpu.py``).
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from sglang_ext.dataplane.attention import dense_attention, torch_layered_attention
from sglang_ext.dataplane.staging_columns import staging_demand
from tests.sglang.test_layered_pool import (
    DIM,
    HEADS,
    LAYERS,
    MIN_BUDGET,
    PAGE,
    Harness,
    check_map,
    make_pool,
    wants,
)
from tests.sglang.test_layered_pool_fast_path import _decode


def build(budget_tokens: int) -> Harness:
    pool = make_pool(budget_tokens=budget_tokens)
    h = Harness(pool, seed=3)
    h.step("a", 7)
    h.step("b", 4, share_from="a", share_pages=2)
    h.step("b", 1)
    pool.update_residency({"a": wants(pool, h, "a", [1, 0, 1]), "b": wants(pool, h, "b", [0, 1, 0])})
    return h


def decode_step(h: Harness, rids: list[str]) -> torch.Tensor:
    """Start a decode step of ``rids`` (one new slot each) through the pool; return the new slots."""
    new = [h._new_slots(rid, 1)[0] for rid in rids]
    loc = torch.tensor(new, dtype=torch.int64)
    h.pool.prepare_step([(rid, torch.tensor(h.slots[rid])) for rid in rids], loc)
    return loc


@pytest.mark.parametrize("budget", [MIN_BUDGET, 80])
def test_paged_views_with_staging_equal_dense_attention(budget):
    """Per-layer page tables (resident + staged host pages) give dense attention's result, and the
    staging pages are reserved inside the budget for the step and returned after its last layer."""
    h = build(budget)
    pool = h.pool
    rids = ["a", "b"]
    loc = decode_step(h, rids)
    tables = pool.tables
    assert tables is not None and tables.staging_ids.size > 0
    assert pool.store.staging_pages == tables.staging_ids.size
    assert pool.store.allocator.used_count <= pool.store.allocator.capacity
    gen = torch.Generator().manual_seed(1)
    for layer in range(LAYERS):
        pool.enter_layer(layer)
        k_new = torch.randn((2, HEADS, DIM), generator=gen).half()
        v_new = torch.randn((2, HEADS, DIM), generator=gen).half()
        pool.set_kv_buffer(SimpleNamespace(layer_id=layer), loc, k_new, v_new)
        for i, slot in enumerate(loc.tolist()):
            h.shadow[(layer, slot)] = (k_new[i].clone(), v_new[i].clone())
        q = torch.randn((2, 4, 4), generator=gen).half()  # one decode query per request, 4 q heads
        k_cache, v_cache = pool.store.dev[0], pool.store.dev[1]
        out = torch_layered_attention(
            q, torch.tensor([0, 1, 2]), k_cache, v_cache, tables.kv_indptr, tables.tab[layer], tables.kv_lens
        )
        for b, rid in enumerate(rids):
            k = torch.stack([h.shadow[(layer, s)][0] for s in h.slots[rid]])
            v = torch.stack([h.shadow[(layer, s)][1] for s in h.slots[rid]])
            torch.testing.assert_close(out[b : b + 1], dense_attention(q[b : b + 1], k, v))
        pool.exit_layer(layer)
    assert pool.tables is None and pool.store.staging_pages == 0
    check_map(pool)
    h.check()


def test_staging_room_is_made_by_evicting_and_loses_nothing():
    """Scenario: the device is full when a step needs staging pages (the boundary's reserve did
    not foresee them): room is made from prefix-cache pages nobody uses first, then from live
    requests outside the batch, then from the batch itself, highest layer first, whole layers of
    one request at a time; KV stays exact and the next boundary sees the evicted wants as
    changed. Each stage is checked against the state before it."""
    pool = make_pool(budget_tokens=MIN_BUDGET)  # 33 device pages
    h = Harness(pool, seed=5)
    h.step("a", 8)  # 4 pages x 3 layers
    h.step("b", 8)  # 4 pages x 3 layers
    h.step("c", 2)  # 1 page x 3 layers: 27 used, all resident
    pages = {rid: sorted({s // 2 for s in h.slots[rid]}) for rid in ("a", "b", "c")}

    def layers_on(rid: str) -> list[int]:  # resident pages per layer
        return pool.store.resident_mask()[:, pages[rid]].sum(dim=1).tolist()

    assert [layers_on(r) for r in "abc"] == [[4, 4, 4], [4, 4, 4], [1, 1, 1]]
    assert pool.store.allocator.used_count == 27
    pool.release_request("c")  # finished, its page stays in the prefix cache
    h.slots.pop("c")

    def room(more: int) -> int:
        before = pool.room.evicted_layer_pages
        assert pool.room.make_room(pool.store.allocator.free_count + more, batch={"a"})
        return pool.room.evicted_layer_pages - before

    assert room(3) == 3  # the cached page, at every layer, and nothing else
    assert [layers_on(r) for r in "abc"] == [[4, 4, 4], [4, 4, 4], [0, 0, 0]]
    assert pool.residency.changed
    assert room(2) == 4  # then "b" (outside the batch): its whole top layer
    assert [layers_on(r) for r in "ab"] == [[4, 4, 4], [4, 4, 0]]
    assert room(8) == 8  # the rest of "b", top down, before the batch gives anything
    assert [layers_on(r) for r in "ab"] == [[4, 4, 4], [0, 0, 0]]
    assert room(2) == 4  # only then the batch itself, its top layer first
    assert [layers_on(r) for r in "ab"] == [[4, 4, 0], [0, 0, 0]]
    assert pool.store.allocator.used_count == 8
    h.check()
    check_map(pool)


def test_staging_room_made_for_what_its_evictions_stage_builds_the_tables_once_more():
    """Scenario: a batch of four requests fills the device (66 pages hold every layer of them but
    no staging); one request's plan offloads its top layer, and the boundary kept no staging
    reserve (the reserve is zeroed here: the case where it did not foresee the step). Making room
    evicts the batch's own resident layers, which stages those requests too, so the step asks
    more staging than the first build did. The room is made for that in rounds that read the map
    mirror (``staging_demand``), and the tables are built once more: two builds a step, where a
    rebuild per round took three here (up to ``L + 2`` on deep models). KV stays exact."""
    pool = make_pool(budget_tokens=MIN_BUDGET)
    h = Harness(pool, seed=5)
    rids = ["r0", "r1", "r2", "r3"]
    for i, rid in enumerate(rids):
        h.step(rid, 6 + 2 * i)
    builds: list[tuple[int, bool]] = []
    take = pool.room.take

    def counted(n: int) -> np.ndarray | None:
        ids = take(n)
        builds.append((n, ids is not None))
        return ids

    pool.room.take = counted
    pool.residency.staging_reserve = lambda every_active=False: 0  # the reserve did not foresee it
    pool.update_residency({"r0": wants(pool, h, "r0", [1, 1, 0])})
    evicted = pool.room.evicted_layer_pages
    rounds_needed = 0
    for _ in range(2):
        builds.clear()
        _decode(pool, h, rids, fast=False)  # the general path: a build at every step
        assert not pool.overflow
        assert 1 <= len(builds) <= 2 and builds[-1][1], builds
        if len(builds) == 2:
            first, second = builds
            assert not first[1] and second[0] > first[0], builds  # its evictions staged more
            rounds_needed += 1
        h.check()
        check_map(pool)
    assert rounds_needed >= 1 and pool.room.evicted_layer_pages > evicted


def test_staging_demand_is_what_the_build_reserves():
    """``staging_demand`` counts the distinct pages of the requests with a host-only layer, as the
    paged build reserves (a page two staged requests share takes one staging page,
    ``staging_columns.py``); a request whose layers are all resident adds nothing."""
    h = build(MIN_BUDGET)  # "a" [1, 0, 1], "b" [0, 1, 0]: both staged, sharing two pages
    pool = h.pool
    decode_step(h, ["a", "b"])
    pages = [np.asarray(sorted({s // PAGE for s in h.slots[rid]}), dtype=np.int64) for rid in ("a", "b")]
    by_position = [np.asarray([s // PAGE for s in h.slots[rid][::PAGE]], dtype=np.int64) for rid in ("a", "b")]
    distinct = len(set(pages[0].tolist()) | set(pages[1].tolist()))
    assert distinct == sum(p.size for p in pages) - 2  # the two shared pages
    assert pool.tables.staging_ids.size == staging_demand(pool.store, by_position) == distinct
    for layer in range(LAYERS):
        pool.enter_layer(layer)
        pool.exit_layer(layer)
    pool.update_residency({"b": wants(pool, h, "b", [1, 1, 1])})
    pool.prepare_step([("b", torch.tensor(h.slots["b"]))], None)
    assert staging_demand(pool.store, by_position[1:]) == 0
    assert staging_demand(pool.store, by_position) == pages[0].size  # "a" alone is staged
