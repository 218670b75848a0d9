"""A step boundary that raises (a copy launch, the tables' upload, the mirror's sync: on CUDA an
out-of-memory error the server survives) leaks no staging and leaves no tables for the next step
to advance: the fault fuzz of session 77 (the graph path, the defer modes, the mirror's uploads)
found both. Each scenario's control, the code before the fix, fails it (checked by hand)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.dataplane.core_driver import PAGES, CoreDriver, make_core


def _raise(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
    raise RuntimeError("CUDA out of memory (injected)")


def _no_leak(core) -> None:  # noqa: ANN001
    store = core.store
    mapped = store.map_np[store.map_np >= 0].tolist()
    assert set(mapped) == store.allocator.used_ids() and core.residency.staging_lent == 0, \
        sorted(store.allocator.used_ids() - set(mapped))


def _steady_staged(page_size: int = 4, warm: int = 3) -> CoreDriver:
    """Request a (layer 1 on host) decoding on advanced staged tables."""
    d = CoreDriver(make_core(PAGES + 6, page_size=page_size), seed=1, fast_decode=True, paged_reads=True)
    d.add("a")
    d.step([("a", 5)])
    d.want("a", [True, False, True])
    for _ in range(warm):
        d.step([("a", 1)])
    d.check_at_rest()
    assert d.core.staged_advances > 0 or warm < 2  # the first staged step builds, the next advance
    return d


def _next_step_reads_right(d: CoreDriver) -> bool:
    """The next decode step (built, not advanced from stale tables) writes and reads back its
    token at every layer, inside the step and at rest; True when it was built."""
    core, advanced = d.core, d.core.staged_advances
    new = d._grow("a", 1)
    loc = torch.tensor(new)
    assert core.prepare_decode_step(["a"], [len(d.slots["a"])], loc)
    assert int(core.tables.kv_lens[0]) == len(d.slots["a"])
    for layer in range(core.layers):
        core.enter_layer(layer)
        k, v = d._layer_kv(layer, loc)
        core.write(layer, loc, k, v)
        core.exit_layer(layer)
    for layer in range(core.layers):
        got_k, got_v = core.read_kv(layer, loc)
        assert torch.equal(got_k[0], d.shadow[(layer, new[0])][0]), layer
        assert torch.equal(got_v[0], d.shadow[(layer, new[0])][1]), layer
    return core.staged_advances == advanced


@pytest.mark.parametrize("where", ["upload", "sync"])
def test_a_staged_advance_that_raises_gives_its_staging_back(where: str) -> None:
    """Scenario: the steady staged step's boundary renews its staging (``StagingRoom.renew``), then
    the tables' upload (or the mirror's sync) raises. The renewed pages went back to no one: in
    use with no map entry, for good. Now they go back, and the next step builds its tables (the
    failed step's are not advanced a token behind) and reads what it wrote."""
    d = _steady_staged()
    core, store = d.core, d.core.store
    new = d._grow("a", 1)
    if where == "sync":
        store.map_changed(np.array([d.pages("a")[-1]]))  # a column pending: the sync has work
        store.mirror.sync = _raise
    else:
        store.uploads.upload = _raise
    try:
        with pytest.raises(RuntimeError, match="injected"):
            core.prepare_decode_step(["a"], [len(d.slots["a"])], torch.tensor(new))
    finally:
        del (store.mirror if where == "sync" else store.uploads).__dict__[where]
    for layer in range(core.layers):  # that forward never ran
        d.shadow.pop((layer, new[0]), None)
    _no_leak(core)
    assert _next_step_reads_right(d)


def test_a_build_that_raises_after_taking_staging_gives_it_back() -> None:
    """Scenario: a staged step's tables build takes its staging, then the upload raises
    (``LayeredKVCore._begin`` never gets the tables to give it back). Now the build gives back
    what it took (``StagingRoom.building``)."""
    d = CoreDriver(make_core(PAGES + 6), seed=2, paged_reads=True)
    d.add("a")
    d.step([("a", 5)])
    d.want("a", [True, False, True])
    d.check_at_rest()
    core, store = d.core, d.core.store
    new = d._grow("a", 1)
    store.uploads.upload = _raise
    try:
        with pytest.raises(RuntimeError, match="injected"):
            core.prepare_step([("a", torch.tensor(d.slots["a"]))], torch.tensor(new), [1])
    finally:
        del store.uploads.upload
    core.update_residency({})  # the next boundary
    assert not core.pipeline.active
    _no_leak(core)


def test_a_decode_boundary_whose_reconciliation_raises_leaves_no_tables_to_advance() -> None:
    """Scenario: a copy launch raises in the reconciliation of a steady decode boundary (after the
    continuity moved on). The last step's tables stayed installed; the map unmoved, the next
    step advanced them -- built as the failed step's successor, one token behind -- and wrote
    its token's K/V into the failed token's row (read back wrong at every layer). Now a boundary
    that raises leaves no tables: the next step builds."""
    d = _steady_staged(warm=1)
    core, engine = d.core, d.core.store.engine
    engine._launch = _raise
    try:
        with pytest.raises(RuntimeError, match="injected"):
            d.want("a", [True, True, True])  # the plan wants layer 1 back; its load raises (survived)
        new = d._grow("a", 1)  # the step's boundary retries the load, which raises again
        with pytest.raises(RuntimeError, match="injected"):
            core.prepare_decode_step(["a"], [len(d.slots["a"])], torch.tensor(new))
    finally:
        del engine._launch
    for layer in range(core.layers):  # that forward never ran
        d.shadow.pop((layer, new[0]), None)
    d.want("a", [True, False, True])  # the plan goes back: nothing moves
    assert _next_step_reads_right(d)
    _no_leak(core)
