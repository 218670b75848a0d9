"""A store without a host tier (``SlotStoreConfig.host_tier=False``: the served identity layout).

Every layer of the slot space is on the device there, so offloading a layer-page frees nothing
another page could use: the pool pins no host pool (a one-page scratch for the copy engine) and
:meth:`LayeredKVCore.update_residency` keeps every want on the device. The scenario is the
offload one (:func:`offload_scenario`: offloads, decode steps, a pause, a resume), checked inside
every layer and at rest; the controls run it on the same store with the host tier.
"""

from __future__ import annotations

import pytest
import torch

from sglang_ext.dataplane.layered_kv_core import LayeredKVCore
from sglang_ext.dataplane.slot_kv_store import SlotStoreConfig
from sglang_ext.dataplane.slot_results import RequestResidency
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
    """The offload scenario without a host tier: every read right, every live layer-page mapped,
    no byte copied either way, nothing dirty left waiting for a write-back."""
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


def test_control_a_host_read_without_the_host_tier_is_caught() -> None:
    """Negative control: bypassing the core's clamp (the residency given an offload directly) on a
    store without host pages fails loudly, never reads another page's KV."""
    driver = CoreDriver(LayeredKVCore(config(host_tier=False)), seed=11)
    driver.add("a")
    driver.step([("a", 5)])
    pages = driver.pages("a")
    driver.core.residency.update_residency({"a": RequestResidency(pages=pages, gpu_layers=(True, False, True))})
    with pytest.raises(IndexError, match="out of bounds"):
        driver.core._reconcile()  # noqa: SLF001 - the write-back the clamp prevents


def test_on_device_keeps_every_layer_and_no_uncached_prefix() -> None:
    want = RequestResidency(pages=(1, 2, 3), gpu_layers=(False, True, False), paused=True, uncached_pages=2)
    got = want.on_device()
    assert got.gpu_layers == (True,) * 3 and got.uncached_pages == 0 and not got.paused
    assert (got.pages, got.planned) == (want.pages, want.planned)
    full = RequestResidency(pages=(1,), gpu_layers=(True, True))
    assert full.on_device() is full

