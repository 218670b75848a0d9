"""Rules of the step boundary that issue 13 names (items 2 and 3):

- **Eager write-back** (SuperInfer §4.3.2): under memory pressure -- fewer than
  ``WRITEBACK_FREE_SHARE`` of the device pages free -- the boundary writes every dirty resident
  layer-page back to host, so that a later offload only drops the device copy; with room it
  defers (an offload writes back what it drops). Checked on the host copy itself.
- **One upload per built step**: a step's tables reach the device in one copy from pinned
  memory (``StepTables._upload``); an advanced step uploads nothing.
- **The device budget**: resident layer-pages plus the step's staging pages never exceed the
  device pages, counted from the map (not the allocator's own figure).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sglang_ext.dataplane import layered_kv_core
from sglang_ext.dataplane.pinned_upload_ring import PinnedUploadRing
from tests.dataplane.core_driver import LAYERS, CoreDriver, make_core


def _host_equals_device(core, layers: np.ndarray, pages: np.ndarray) -> bool:  # noqa: ANN001
    store = core.store
    dev = store.dev.cpu()
    for layer, page in zip(layers.tolist(), pages.tolist(), strict=True):
        d = int(store.map_np[layer, page])
        if not (torch.equal(store.host[page, layer, 0], dev[0, d]) and torch.equal(store.host[page, layer, 1], dev[1, d])):
            return False
    return True


def _filled(device_pages: int) -> CoreDriver:
    d = CoreDriver(make_core(device_pages, pages=24), seed=11)
    d.add("a")
    d.add("b")
    d.step([("a", 9), ("b", 7)])  # 5 + 4 pages at 3 layers = 27 resident layer-pages, all dirty
    return d


@pytest.mark.parametrize(("device_pages", "pressure"), [(33, True), (60, False)])
def test_eager_write_back_under_pressure_only(device_pages, pressure):
    d = _filled(device_pages)
    store = d.core.store
    free_share = store.allocator.free_count / store.allocator.capacity
    assert (free_share < layered_kv_core.WRITEBACK_FREE_SHARE) == pressure, free_share
    layers, pages = np.nonzero(store.dirty_np & (store.map_np >= 0))
    assert layers.size == 27 and not _host_equals_device(d.core, layers, pages)  # control: not yet written
    d2h = store.d2h_bytes
    d.step([("a", 1), ("b", 1)])  # the boundary of this step decides
    written = {d.slots[rid][-1] // d.ps for rid in ("a", "b")}  # the step's new tokens went there after
    keep = np.asarray([p not in written for p in pages.tolist()])
    if pressure:
        assert store.d2h_bytes > d2h
        assert _host_equals_device(d.core, layers[keep], pages[keep])
        assert not store.dirty_np[layers[keep], pages[keep]].any() and store.dirty_np[layers[~keep], pages[~keep]].all()
    else:
        assert store.d2h_bytes == d2h and store.dirty_np[layers, pages].all()
    d.check_at_rest()


def test_a_built_step_uploads_once_and_an_advanced_step_not_at_all(monkeypatch):
    uploads = []
    real = PinnedUploadRing.upload

    def counted(ring, values):  # noqa: ANN001, ANN202
        uploads.append(values.size)
        return real(ring, values)

    # on the CPU only the tables upload through a ring (the mirror scatters in place)
    monkeypatch.setattr(PinnedUploadRing, "upload", counted)
    core = make_core(40, pages=24, page_size=4)
    d = CoreDriver(core, seed=12, fast_decode=True, paged_reads=True)
    d.add("a")
    d.add("b")
    d.step([("a", 6), ("b", 2)])
    for _ in range(8):
        before, advanced = len(uploads), core.advanced_decode_steps
        d.step([("a", 1), ("b", 1)])
        assert len(uploads) - before == (0 if core.advanced_decode_steps > advanced else 1)
    assert core.advanced_decode_steps > 0
    d.want("a", [True, False, True])  # staged steps: still one upload each
    for _ in range(3):
        before = len(uploads)
        d.step([("a", 1), ("b", 1)])
        assert len(uploads) - before == 1
    d.check_at_rest()


def test_resident_and_staging_pages_stay_inside_the_device_pages():
    core = make_core(30, pages=24)
    seen = []

    def on_layer(layer: int) -> None:
        store = core.store
        resident = int((store.map_np >= 0).sum())
        staging = 0 if core.tables is None or core.overflow else int(core.tables.staging_ids.size)
        seen.append(resident + staging)
        assert resident + staging <= store.allocator.capacity, (resident, staging)

    d = CoreDriver(core, seed=13, on_layer=on_layer)
    for rid, n in (("a", 9), ("b", 7), ("c", 5)):
        d.add(rid)
        d.step([(rid, n)])
    for rid in ("a", "b", "c"):
        d.want(rid, [True, False, False])
    for _ in range(4):
        d.step([("a", 1), ("b", 1), ("c", 1)])
    assert max(seen) > core.store.allocator.capacity // 2  # the budget was actually under pressure
    d.check_at_rest()
    assert LAYERS == 3
