"""A copy launch that raises at a step boundary (on CUDA: an out-of-memory error uploading the
copy's index tensors, which the server survives) moves nothing and loses no KV: the layer-pages
it was to load stay host-only with their KV there, the device pages taken for them are free
again, no step reads them as resident, and the next reconciliation retries them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sglang_ext.dataplane.slot_results import RequestResidency
from tests.dataplane.core_driver import LAYERS, PAGES, CoreDriver, make_core


def _raise(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
    raise RuntimeError("CUDA out of memory (injected into the copy launch)")


@pytest.mark.parametrize("device_pages", [None, PAGES + 40], ids=["identity", "paged"])
def test_a_failed_onload_moves_nothing_and_the_next_pass_retries_it(monkeypatch, device_pages):
    """Layers 1 and 2 of a are offloaded; the plan wants them back and the H2D launch raises.
    The error reaches the caller (the served boundary logs it and keeps serving), the map and
    the free count are as before, and the next step reloads them and reads every token right
    (inside every layer and at rest). Negative controls, by hand: without the store freeing
    the device pages the free count drops by the pages taken (identity: 90 != 96); without the
    residency marking the wants dirty again the next step leaves them on host (map -1)."""
    driver = CoreDriver(make_core(device_pages), seed=3)
    driver.add("a")
    driver.step([("a", 5)])
    driver.want("a", [True, False, False])
    driver.step([("a", 1)])
    store = driver.core.store
    pages = np.array(driver.pages("a"))
    assert (store.map_np[1:, pages] < 0).all()  # offloaded: the launch below has work to do
    before = (store.map_np.copy(), store.allocator.free_count, store.h2d_bytes, store.engine.stats.h2d_launches)
    with monkeypatch.context() as patch:
        patch.setattr(store.engine, "_launch", _raise)  # inside the engine's h2d, after its checks
        with pytest.raises(RuntimeError, match="injected"):
            driver.want("a", [True] * LAYERS)
    assert np.array_equal(store.map_np, before[0])
    assert (store.allocator.free_count, store.h2d_bytes, store.engine.stats.h2d_launches) == before[1:]
    assert not driver.core.residency.all_live_resident()
    driver.step([("a", 1)])  # the retry: a plain step, no new want
    pages = np.array(driver.pages("a"))
    assert (store.map_np[:, pages] >= 0).all() and store.h2d_bytes > before[2]
    driver.check_at_rest()


def test_a_failed_eager_write_back_keeps_every_mark_for_the_next_one(monkeypatch):
    """The eager write-back's D2H launch raises: no dirty mark is cleared and the dirty log is
    kept, so the next write-back copies the same layer-pages. Negative control (the log reset
    before the launch, as it was): the log lost all 9 marks, which no eager write-back found again."""
    driver = CoreDriver(make_core(None), seed=4)
    driver.add("a")
    driver.step([("a", 5)])
    store = driver.core.store
    dirty = store._dirty_ids()
    assert dirty.size
    with monkeypatch.context() as patch:
        patch.setattr(store.engine, "_launch", _raise)
        with pytest.raises(RuntimeError, match="injected"):
            store.sync_dirty()
    assert np.array_equal(store._dirty_ids(), dirty) and store.d2h_bytes == store.engine.stats.d2h_launches == 0
    assert store.sync_dirty() == dirty.size and store.d2h_bytes > 0
    assert store._dirty_ids().size == 0
    driver.check_at_rest()


@pytest.mark.parametrize("device_pages", [None, PAGES + 40], ids=["identity", "paged"])
def test_a_failed_onload_on_the_append_path_forces_the_next_pass_to_retry(monkeypatch, device_pages):
    """The append-only fast path (a new request joining on a prefix whose layers 1 and 2 are on
    host, as a prefix-cache hit does): its copy launch raises. The next pass is a full one that
    loads them. Negative control (the fast path unguarded, as it was): the retry took the fast
    path again with nothing appended and left them on host (map -1) until some other change.
    The event hook gets the failed pass's moves (none), not the last pass's again (negative
    control: without ``last_moves``' reset at the start of a pass, the earlier offloads)."""
    import torch

    driver = CoreDriver(make_core(device_pages), seed=6)
    driver.add("a")
    driver.step([("a", 5)])
    seen: list = []
    driver.core._on_moves = seen.append
    driver.want("a", [True, False, False])  # the last pass before the failing one moved pages
    residency, store = driver.core.residency, driver.core.store
    pages = np.array(driver.pages("a"))
    assert (store.map_np[1:, pages] < 0).all() and not residency.changed  # the fast path is next
    assert seen[-1].offloaded
    residency.observe("b", torch.from_numpy(pages[:2].copy()))  # all layers wanted: a copy-back
    with monkeypatch.context() as patch:
        patch.setattr(store.engine, "h2d", _raise)
        with pytest.raises(RuntimeError, match="injected"):
            driver.core._reconcile()
    assert (store.map_np[1:, pages[:2]] < 0).all() and not residency.all_live_resident()
    assert (seen[-1].offloaded, seen[-1].loaded) == ({}, {})  # the failed pass moved nothing
    residency.reconcile()  # the retry
    assert (store.map_np[:, pages[:2]] >= 0).all()
    driver.check_at_rest()


def test_a_pass_whose_loads_raise_still_reports_the_drops_it_made(monkeypatch):
    """The plan swaps a's layers (0 to host, 1 and 2 back): the drops of layer 0 happen, then the
    loads' launch raises. The residency-event hook still gets this pass's moves -- the drops, no
    loads. Negative control (moves reported only after a pass returned): no event
    for the failed pass (``[]``)."""
    driver = CoreDriver(make_core(None), seed=7)
    seen: list = []
    driver.core._on_moves = seen.append
    driver.add("a")
    driver.step([("a", 5)])
    driver.want("a", [True, False, False])
    pages = sorted(driver.pages("a"))
    seen.clear()
    engine = driver.core.store.engine
    launch = engine._launch

    def h2d_fails(kind, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202 - the write-backs run
        return _raise() if kind == "h2d" else launch(kind, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(engine, "_launch", h2d_fails)
        with pytest.raises(RuntimeError, match="injected"):
            driver.want("a", [False, True, True])
    assert [(m.offloaded, m.loaded) for m in seen] == [({0: pages}, {})]
    driver.step([("a", 1)])  # the retry loads them
    driver.check_at_rest()


def test_a_pass_whose_loads_raise_after_giving_up_orphans_keeps_the_reclaimable_count_true(monkeypatch):
    """A finished request's pages stay resident for SGLang's prefix cache (orphans). The plan
    wants b's offloaded layers back; the budget is short, so the pass gives up orphan pages, then
    its loads' launch raises. The pool's free figure (``free_device_pages``: free plus
    reclaimable) is the pool-wide count afterwards, not the freed orphans counted twice.
    Negative control (the count refreshed only after a pass's loads returned): it stays at the
    old orphan count and the figure overstates the free pages."""
    from tests.dataplane.test_live_pages import TreeDriver, brute_force

    d = TreeDriver(make_core(16), seed=8)
    d.add("b")
    d.step([("b", 5)])
    d.want("b", [True, False, False])
    d.step([("b", 1)])
    d.add("a")
    d.step([("a", 6)])
    d.cache("a")  # a's pages stay resident, used by no request
    d.core.update_residency({})
    orphans = brute_force(d.core)[0]
    assert orphans > 0 and d.core.residency.reclaimable_pages == orphans
    engine = d.core.store.engine
    launch = engine._launch

    def h2d_fails(kind, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        return _raise() if kind == "h2d" else launch(kind, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(engine, "_launch", h2d_fails)
        with pytest.raises(RuntimeError, match="injected"):
            d.want("b", [True] * LAYERS)
    left = brute_force(d.core)[0]
    assert left < orphans  # the pass gave some up before the loads raised
    assert d.core.residency.reclaimable_pages == left
    assert d.core.free_device_pages() == d.core.store.allocator.free_count + left
    d.step([("b", 1)])  # the retry loads them
    d.check_at_rest()


def test_a_failed_write_back_of_a_stopped_forward_keeps_the_step_for_the_next_boundary(monkeypatch):
    """Scenario (data-plane review, session 77): a wants layers 0 and 2 on host, so a decode step
    parks its new token at them and writes it back after layer 2. A forward stops after layer 1;
    the next boundary's ``end_step`` writes the token's layer-0 K/V back, and that D2H launch
    raises. The pipeline keeps the step (the staging still lent), the boundary after it writes
    the token back and gives the staging back: every token reads back right at the layers
    written, and the map and the allocator agree. Negative control (the step forgotten before
    its write-back, as it was): the token's layer 0 reads wrong and the staging pages stay in
    use with no map entry."""
    driver = CoreDriver(make_core(PAGES + 6), seed=1)
    driver.add("a")
    driver.step([("a", 5)])
    driver.want("a", [False, True, False])
    driver.step([("a", 1)])
    driver.check_at_rest()
    core = driver.core
    new = driver._grow("a", 1)
    loc = torch.tensor(new)
    core.prepare_step([("a", torch.tensor(driver.slots["a"]))], loc, [1])
    for layer in range(2):  # the forward stops after layer 1
        core.enter_layer(layer)
        k, v = driver._layer_kv(layer, loc)
        core.write(layer, loc, k, v)
        core.exit_layer(layer)
    assert core.tables.token_writeback is not None and core.store.staging_pages > 0
    lent = core.store.staging_pages
    want = {"a": RequestResidency(pages=driver.pages("a"), gpu_layers=(False, True, False))}
    with monkeypatch.context() as patch:
        patch.setattr(core.store.engine, "_launch", _raise)
        with pytest.raises(RuntimeError, match="injected"):
            core.update_residency(want)
    assert core.pipeline.active and core.store.staging_pages == lent  # held for the retry
    core.update_residency(want)  # the next boundary: written back, the staging given back
    store = core.store
    assert not core.pipeline.active and store.staging_pages == 0 and core.residency.staging_lent == 0
    mapped = store.map_np[store.map_np >= 0].tolist()
    assert len(mapped) == len(set(mapped)) and set(mapped) == store.allocator.used_ids()
    slots = driver.slots["a"]
    for layer in range(2):  # layer 2 of the new token was never written
        got_k, got_v = core.read_kv(layer, torch.tensor(slots))
        assert torch.equal(got_k.cpu(), torch.stack([driver.shadow[(layer, s)][0] for s in slots])), layer
        assert torch.equal(got_v.cpu(), torch.stack([driver.shadow[(layer, s)][1] for s in slots])), layer
