"""The served pool's identity layout (no budget: every layer of the slot space on the device),
driven like SGLang drives it (``test_layered_pool.py``'s harness): it reads in place, pins no
host pool (``SlotStoreConfig.host_tier``), keeps offloads and pauses on the device, and refuses
``--kv-recompute-ratio``; the controls run the same on the paged layout."""

from __future__ import annotations

from types import SimpleNamespace

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
                                         r"set --max-total-tokens above 64 .* or --kv-gpu-budget-tokens below 198"):
        pool(None)
    assert pool(ROOMY).store.host_tier


def test_writes_and_moves_outside_a_step_land_on_the_device():
    """SGLang writes outside a step (a cross-attention cache write, ``set_kv_buffer`` with its own
    slots) and moves slots (``move_kv_cache``) into pages no step has placed yet: without a host
    tier both land on those pages' identity device pages and read back (before: into the host
    home; with one scratch page they raised). The stats report no host pages."""
    pool = make_pool(budget_tokens=None)
    h = Harness(pool)
    h.step("a", 3)
    fresh = torch.tensor([20, 21])  # page 10: allocated by SGLang, never observed by a step
    for layer in range(LAYERS):
        k = torch.randn((2, HEADS, DIM)).half()
        v = torch.randn((2, HEADS, DIM)).half()
        pool.set_kv_buffer(SimpleNamespace(layer_id=layer), fresh, k, v)
        got = pool.layer_kv(layer, fresh)
        assert torch.equal(got[0], k) and torch.equal(got[1], v)
        for i, slot in enumerate((20, 21)):
            h.shadow[(layer, slot)] = (k[i].clone(), v[i].clone())
    # the request that owns page 10 decodes: its step places the page (the KV written at rest is
    # at its identity pages already: nothing to copy) and reads it inside every layer
    h.free_pages.remove(10)
    h.slots["c"] = [20, 21]
    h.step("c", 1)
    assert (pool.store.map_np[:, 10] >= 0).all()
    src = torch.tensor(h.slots["a"][:2])
    want = [pool.layer_kv(layer, src) for layer in range(LAYERS)]
    moved = torch.tensor([24, 25])
    pool.move_kv_cache(moved, src)
    for layer in range(LAYERS):
        got = pool.layer_kv(layer, moved)
        assert torch.equal(got[0], want[layer][0]) and torch.equal(got[1], want[layer][1]), layer
    assert pool.residency_stats().host_pages == 0
    assert make_pool(budget_tokens=ROOMY).residency_stats().host_pages == pool.store.config.logical_pages  # control
    h.check()


def test_the_installer_reports_the_placement_the_pool_keeps():
    """A plan offloading layers, installed on the identity pool: the installer's rows (what the
    step reports and stats lines tell the control plane) are all-GPU, as the pool keeps them, and
    nothing leaves the device. Control: on the paged layout the same plan is reported and kept."""
    from sglang_ext.tp_sync import PlacementInstaller, StepInstall

    for budget, kept in ((None, LAYERS), (ROOMY, 2)):
        pool = make_pool(budget_tokens=budget)
        h = Harness(pool)
        h.step("a", 4)
        installer = PlacementInstaller(pool, LAYERS)
        installer.apply(StepInstall(step=1, placements={"a": (1, 0, 1)}, prefill_layers={"b": 1}))
        assert installer.gpu_layer_count("a") == kept and sum(installer.gpu_layers("a")) == kept
        assert sum(installer.prefill_placements["b"]) == (LAYERS if budget is None else 1)
        installer.install({"a": tuple(dict.fromkeys(s // PAGE for s in h.slots["a"]))}, {})
        assert sum(pool.residency.gpu_layers("a")) == kept
        h.check()
