"""Paged per-layer views of the layered pool (the FlashInfer path's tables), checked on CPU.

Scenario: requests written through the pool with part of their layers offloaded; per-layer
page tables (resident pages from the map, host-only pages staged into device pages) fed to the
torch paged-attention reference must equal dense attention over the shadow K/V. On a GPU the
same tables feed FlashInfer (``test_layered_pool_gpu.py``).
"""

from __future__ import annotations

import pytest
import torch

from sglang_ext.dataplane.attention import dense_attention, torch_layered_attention
from sglang_ext.dataplane.slot_page_tables import SlotPageTables

pytest.importorskip("sglang")  # the harness's pool (sglang_ext.layered_pool) imports SGLang
from tests.sglang.test_layered_pool import LAYERS, Harness, check_map, make_pool, wants  # noqa: E402


def build(budget_tokens: int) -> Harness:
    pool = make_pool(budget_tokens=budget_tokens)
    h = Harness(pool, seed=3)
    h.step("a", 7)
    h.step("b", 4, share_from="a", share_pages=2)
    h.step("b", 1)
    pool.update_residency({"a": wants(pool, h, "a", [1, 0, 1]), "b": wants(pool, h, "b", [0, 1, 0])})
    return h


@pytest.mark.parametrize("budget", [34, 40])
def test_paged_views_with_staging_equal_dense_attention(budget):
    """Per-layer page tables (resident + staged host pages) give dense attention's result."""
    h = build(budget)
    pool = h.pool
    tables = SlotPageTables(pool.store)
    rids = ["a", "b"]
    slots = [torch.tensor(h.slots[r]) for r in rids]
    free_before = pool.store.allocator.free_count
    assert tables.begin(rids, slots)
    assert tables.staging_pages > 0
    assert pool.store.allocator.free_count == free_before - tables.staging_pages
    gen = torch.Generator().manual_seed(1)
    for layer in range(LAYERS):
        view = tables.layer_view(layer)
        q = torch.randn((2, 4, 4), generator=gen).half()  # one decode query per request, 4 q heads
        out = torch_layered_attention(
            q, torch.tensor([0, 1, 2]), view.k_cache, view.v_cache, view.kv_indptr, view.kv_indices, view.kv_lens
        )
        for b, rid in enumerate(rids):
            k = torch.stack([h.shadow[(layer, s)][0] for s in h.slots[rid]])
            v = torch.stack([h.shadow[(layer, s)][1] for s in h.slots[rid]])
            torch.testing.assert_close(out[b : b + 1], dense_attention(q[b : b + 1], k, v))
    tables.end()
    assert pool.store.allocator.free_count == free_before
    check_map(pool)
    h.check()


def test_staging_that_does_not_fit_is_refused_without_side_effects():
    """When the device pool has no room for staging, begin() says so and holds nothing."""
    pool = make_pool(budget_tokens=6)  # 3 pages, all used by the local fallback
    h = Harness(pool)
    h.step("a", 8)
    free_before = pool.store.allocator.free_count
    tables = SlotPageTables(pool.store)
    assert not tables.begin(["a"], [torch.tensor(h.slots["a"])])
    assert tables.staging_pages == 0 and pool.store.allocator.free_count == free_before
