"""The served pool's identity layout (no budget: every layer of the slot space on the device),
driven like SGLang drives it (``test_layered_pool.py``'s harness): it reads in place, pins no
host pool (``SlotStoreConfig.host_tier``), keeps offloads and pauses on the device, and refuses
``--kv-recompute-ratio``; the controls run the same on the paged layout."""

from __future__ import annotations

import pytest
import torch

from sglang_ext.args import LayeredKVArgs
from tests.sglang.test_layered_pool import (
    DIM,
    HEADS,
    LAYERS,
    PAGE,
    ROOMY,
    SLOTS,
    Harness,
    make_pool,
    wants,
)

pytest.importorskip("sglang")  # sglang_ext.layered_pool imports SGLang at module level
from sglang_ext.layered_pool import LayeredTokenToKVPool  # noqa: E402


def test_identity_layout_reads_in_place_exactly_what_the_gather_returns():
    """No budget: every layer-page sits at device page l * P + p, and reading a layer in place with
    SGLang's slot ids gives the same K/V as the read at rest. The pool has no host tier (one
    scratch page): a plan that offloads a layer keeps it at its identity pages, and the steps
    after it read in place with no byte written to host (the harness checks every step)."""
    pool = make_pool(budget_tokens=None)
    assert pool.store.identity and not pool.store.host_tier and pool.store.host.shape[0] == 1
    h = Harness(pool)
    h.step("a", 3)
    h.step("b", 2)
    slots = torch.tensor(h.slots["a"] + h.slots["b"])
    for layer in range(LAYERS):
        k, v = pool.layer_in_place(layer)
        gk, gv = pool.layer_kv(layer, slots)
        assert torch.equal(k[slots], gk) and torch.equal(v[slots], gv)
    p = pool.store.config.logical_pages
    layers, pages = (pool.store.map_cpu >= 0).nonzero(as_tuple=True)
    assert torch.equal(pool.store.map_cpu[layers, pages].long(), layers * p + pages)
    pool.update_residency({"a": wants(pool, h, "a", (True, False, True))})
    assert pool.store.resident_mask()[:, [s // PAGE for s in h.slots["a"]]].all()
    assert pool.residency.gpu_layers("a") == (True,) * LAYERS
    h.step("a", 2)
    assert (pool.store.host_write_bytes, pool.store.d2h_bytes, pool.store.h2d_bytes) == (0, 0, 0)
    h.check()


def test_in_place_writes_stay_in_place_when_paused_and_offloaded():
    """Identity layout, in-place steps: pausing the request, then a plan offloading every layer,
    leaves every layer-page where it is (nothing to write back to, nothing freed that another
    page could use) and the KV exact. Control: the paged layout offloads the same wants."""
    for budget, stays in ((None, True), (ROOMY, False)):
        pool = make_pool(budget_tokens=budget)
        h = Harness(pool, in_place=budget is None)
        h.step("a", 3)
        h.step("a", 2)
        pool.update_residency({"a": wants(pool, h, "a", (True,) * LAYERS, paused=True)})
        pool.update_residency({"a": wants(pool, h, "a", (False,) * LAYERS)})
        resident = (pool.store.map_cpu[:, [s // PAGE for s in h.slots["a"]]] >= 0)
        assert bool(resident.all()) is stays and bool(resident.any()) is stays, budget
        assert (pool.store.d2h_bytes == 0) is stays, budget
        h.check()


def test_recompute_ratio_is_refused_where_every_layer_is_on_the_device():
    """--kv-recompute-ratio keeps a prefix off the device; the identity layout (no budget) has no
    host pool to keep it in and nothing to save: the pool refuses, naming the flag, the slot space
    and the way out. Control: the paged layout takes the same flag."""
    def pool(budget: int | None) -> LayeredTokenToKVPool:
        return LayeredTokenToKVPool(size=SLOTS, page_size=PAGE, dtype=torch.float16, head_num=HEADS, head_dim=DIM,
                                    layer_num=LAYERS, device="cpu", enable_memory_saver=False,
                                    layered_args=LayeredKVArgs(enable_layered_kv=True, kv_gpu_budget_tokens=budget,
                                                               kv_recompute_ratio=0.3))

    with pytest.raises(ValueError, match=r"--kv-recompute-ratio=0.3: .* \(64 tokens\) is on the device.*"
                                         r"set --max-total-tokens above 64"):
        pool(None)
    assert pool(ROOMY).store.host_tier
