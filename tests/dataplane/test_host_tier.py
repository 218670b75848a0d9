"""A store without a host tier (``SlotStoreConfig.host_tier=False``: the served identity layout).

Every layer of the slot space is on the device there, so offloading a layer-page frees nothing
another page could use: the pool pins no host pool (a one-page scratch for the copy engine) and
:meth:`LayeredKVCore.update_residency` keeps every want on the device. The scenario is the
offload one (:func:`offload_scenario`: offloads, decode steps, a pause, a resume), checked inside
every layer and at rest; the controls run it on the same store with the host tier.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sglang_ext.dataplane.layered_kv_core import LayeredKVCore
from sglang_ext.dataplane.slot_results import RequestResidency
from sglang_ext.dataplane.slot_store_config import SlotStoreConfig
from tests.dataplane.core_driver import HEADS, LAYERS, PAGE, PAGES, CoreDriver, offload_scenario

DIM = 4


def config(*, host_tier: bool, device_pages: int = LAYERS * PAGES) -> SlotStoreConfig:
    return SlotStoreConfig(layers=LAYERS, page_size=PAGE, kv_heads=HEADS, head_dim=DIM, logical_pages=PAGES,
                           device_pages=device_pages, dtype=torch.float32, device="cpu", host_tier=host_tier)


def live_pages(driver: CoreDriver) -> list[int]:
    return sorted({p for rid in driver.slots for p in driver.pages(rid)})


def test_no_host_tier_pins_one_page_and_needs_the_identity_layout() -> None:
    c = config(host_tier=False)
    assert c.identity and c.host_pages == 1
    assert c.host_bytes == LAYERS * c.layer_page_bytes
    assert config(host_tier=True).host_bytes == PAGES * LAYERS * c.layer_page_bytes  # control: every page
    store = LayeredKVCore(c).store
    assert not store.host_tier and store.host.shape[0] == 1
    with pytest.raises(ValueError, match=r"host_tier=False needs the identity layout .* got device_pages=98"):
        config(host_tier=False, device_pages=LAYERS * PAGES - 1)


def test_offloads_pauses_and_uncached_prefixes_stay_on_the_device_and_read_right() -> None:
    """The offload scenario without a host tier: every read right (inside every layer and at
    rest), every live layer-page mapped at every layer, no byte copied either way."""
    driver = CoreDriver(LayeredKVCore(config(host_tier=False)), seed=11)
    offload_scenario(driver)
    driver.want("a", [False] * LAYERS, uncached=2)  # a plan's uncached prefix too
    driver.step([("a", 1), ("b", 1)])
    driver.check_at_rest()
    store = driver.core.store
    pages = live_pages(driver)
    assert (store.map_np[:, pages] >= 0).all()
    assert (store.h2d_bytes, store.d2h_bytes) == (0, 0)
    assert driver.core.residency.gpu_layers("a") == (True,) * LAYERS


def test_control_the_host_tier_moves_the_same_scenario() -> None:
    """Negative control: the same identity store with its host pool offloads for real (bytes go to
    the host, layer-pages leave the device), so the checks above can fail."""
    driver = CoreDriver(LayeredKVCore(config(host_tier=True)), seed=11)
    offload_scenario(driver)
    store = driver.core.store
    assert store.d2h_bytes > 0
    assert (store.map_np[:, live_pages(driver)] < 0).any()


def test_control_an_offload_without_the_host_tier_is_caught() -> None:
    """Negative control: bypassing the core's clamp (the residency given an offload directly) on a
    store without host pages fails loudly, by name, never writes past the scratch page."""
    driver = CoreDriver(LayeredKVCore(config(host_tier=False)), seed=11)
    driver.add("a")
    driver.step([("a", 5)])
    pages = driver.pages("a")
    driver.core.residency.update_residency({"a": RequestResidency(pages=pages, gpu_layers=(True, False, True))})
    with pytest.raises(RuntimeError, match="an offload needs host pages"):
        driver.core._reconcile()  # noqa: SLF001 - the write-back the clamp prevents


def test_on_device_keeps_every_layer_and_no_uncached_prefix() -> None:
    want = RequestResidency(pages=(1, 2, 3), gpu_layers=(False, True, False), paused=True, uncached_pages=2)
    got = want.on_device()
    assert got.gpu_layers == (True,) * 3 and got.uncached_pages == 0 and not got.paused
    assert (got.pages, got.planned) == (want.pages, want.planned)
    full = RequestResidency(pages=(1,), gpu_layers=(True, True))
    assert full.on_device() is full



def test_at_rest_reads_and_writes_of_an_unplaced_page_use_its_identity_page() -> None:
    """A page SGLang allocated but no step has observed yet (``map < 0``): without a host tier a
    write between forwards lands on its own identity page and reads back, unmarked; placed
    later, the page keeps it. Control: the host tier writes it to the host home."""
    for host_tier in (False, True):
        store = LayeredKVCore(config(host_tier=host_tier)).store
        slots = torch.tensor([20, 21])  # page 10, never placed
        k = torch.randn(2, HEADS, DIM)
        v = torch.randn(2, HEADS, DIM)
        store.write_at_rest(1, slots, k, v)
        got = store.read_kv(1, slots)
        assert torch.equal(got[0], k) and torch.equal(got[1], v)
        assert not store.dirty_np.any() and (store.map_np < 0).all()
        if host_tier:
            assert torch.equal(store.host[10, 1, 0], k) and torch.equal(store.host[10, 1, 1], v)
        if not host_tier:  # placed at its identity pages, the page reads what was written
            store.place_identity(np.array([10]))
            got = store.read_kv(1, slots)
            assert store.map_np[1, 10] >= 0 and torch.equal(got[0], k) and torch.equal(got[1], v)


def test_copies_to_host_pages_are_refused_with_nothing_changed() -> None:
    """The clamp keeps them from the served path; called anyway, each is refused by name before
    any change (on CUDA an index past the scratch page would be an out-of-bounds copy). An
    onload copies nothing there (the page's KV is at its identity page: the next test)."""
    driver = CoreDriver(LayeredKVCore(config(host_tier=False)), seed=3)
    driver.add("a")
    driver.step([("a", 5)])
    store = driver.core.store
    pages = np.array(driver.pages("a"))
    layers = np.zeros_like(pages)
    before = (store.map_np.copy(), store.dirty_np.copy(), store.allocator.free_count)
    for call, what in ((lambda: store.offload(layers, pages), "an offload"),
                       (lambda: store.sync_dirty(), "a write-back")):
        with pytest.raises(RuntimeError, match=f"{what} needs host pages; this store has none"):
            call()
        assert np.array_equal(store.map_np, before[0]) and store.allocator.free_count == before[2]
    assert store.dirty_np.any()  # the refused write-back cleared no mark
    driver.check_at_rest()
