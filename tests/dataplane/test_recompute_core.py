"""The served core's recompute steps (eLLM's uncached prefix, docs/recompute.md).

A request with ``(u, k)`` keeps its first ``u`` pages in no device layer; at layers ``< k`` the
forward's recompute rows write the prefix K/V into transient pages that the decode token reads
through the step's table; at layers ``>= k`` the prefix is fetched. :class:`CoreDriver` checks,
inside every layer, that the served read path returns exactly the original K/V, and at rest that
nothing was corrupted or lost.
"""

from __future__ import annotations

import numpy as np
import pytest

from sglang_ext.dataplane.layered_kv_core import LayeredKVCore
from tests.dataplane.core_driver import KV_MISMATCH, LAYERS, PAGES, CoreDriver, make_core

ALL = [True] * LAYERS


def _scenario(core: LayeredKVCore, u: int, k: int, *, corrupt: bool = False, steps: int = 4) -> CoreDriver:
    """Request ``a``: 9-token prefill (5 pages of 2), then ``steps`` decodes recomputing its
    first ``u`` pages at layers ``< k`` (b decodes beside it without recompute)."""
    d = CoreDriver(core, seed=3)
    d.corrupt_recompute = corrupt
    d.add("a")
    d.add("b")
    d.step([("a", 9), ("b", 4)])
    d.want("a", ALL, uncached=u)
    d.recompute["a"] = (u, k)
    for _ in range(steps):
        d.step([("a", 1), ("b", 1)])
    d.check_at_rest()
    return d


@pytest.mark.parametrize("budget", [None, PAGES + 6, 3 * PAGES - 9])
@pytest.mark.parametrize(("u", "k"), [(2, LAYERS), (2, 2), (4, 1), (3, 0)])
def test_recompute_steps_read_exactly_the_original_kv(budget, u, k):
    d = _scenario(make_core(budget), u, k)
    assert d.recompute_rows == (4 * u * 2 * k if k else 0)  # 4 steps, u pages of 2 tokens, k layers


def test_prefix_leaves_the_device_and_tables_follow_the_contract():
    """Budgeted layout, u=2 pages, k=2 of 3 layers, every cached layer resident: the prefix is in
    no device layer; the step reserves u staging pages (the prefix fetched at layer 2) and u
    transient pages (layers 0-1 point there); it fetches exactly the prefix at layer 2."""
    core = make_core(3 * PAGES - 9)
    d = CoreDriver(core, seed=3)
    d.add("a")
    d.step([("a", 9)])
    d.want("a", ALL, uncached=2)
    d.recompute["a"] = (2, 2)
    seen = {}

    def look(layer: int) -> None:
        t = core.tables
        if layer == 0 and t is not None:
            tab = t.tab.cpu().numpy()
            seen.update(staging=t.staging_ids.size, fetched=t.fetch_layer_pages, active=t.recompute.active,
                        tab=tab, resident=core.store.map_np[:, t.pages].copy(),
                        ids=t.recompute.input_ids.tolist(), positions=t.recompute.positions.tolist())

    d.on_layer = look
    d.step([("a", 1)])
    prefix = d.pages("a")[:2]
    assert (core.store.map_np[:, list(prefix)] < 0).all()  # in no device layer
    assert seen["staging"] == 2 + 2 and seen["fetched"] == 2  # u staging + u transient; prefix at layer 2
    assert seen["active"] == [4, 4, 0]
    assert seen["ids"] == d.slots["a"][:4] and seen["positions"] == [0, 1, 2, 3]  # uploaded with the tables
    tab, resident = seen["tab"], seen["resident"]
    assert (tab[0, :2] == tab[1, :2]).all()  # one transient layer, reused
    assert (tab[0, :2] != tab[2, :2]).all()  # layer 2 reads the staged fetch
    assert (tab[:, 2:] == resident[:, 2:]).all()  # the cached rest in place
    d.check_at_rest()


def test_without_recompute_the_same_step_stages_the_whole_prefix_at_every_layer():
    """Control for the test above: u=2 uncached but k=0 (pure fetch): no transient pages, the
    prefix fetched at all three layers."""
    core = make_core(3 * PAGES - 9)
    d = CoreDriver(core, seed=3)
    d.add("a")
    d.step([("a", 9)])
    d.want("a", ALL, uncached=2)
    d.recompute["a"] = (2, 0)
    seen = {}
    d.on_layer = lambda layer: seen.setdefault("t", (core.tables.staging_ids.size, core.tables.fetch_layer_pages))
    d.step([("a", 1)])
    assert seen["t"] == (2, 6)
    assert d.recompute_rows == 0


@pytest.mark.parametrize("budget", [None, PAGES + 6])
def test_shared_prefix_pages_stay_exact_for_their_other_user(budget):
    """b shares a's first 3 pages (a prefix hit) and wants them resident; a recomputes them. The
    resident copies must not be overwritten by a's recomputation (b's reads are checked too)."""
    d = CoreDriver(make_core(budget), seed=5)
    d.add("a")
    d.step([("a", 9)])
    d.add("b", share_from="a", share_pages=3)
    d.step([("b", 3)])
    d.want("a", ALL, uncached=3)
    d.recompute["a"] = (3, LAYERS)
    for _ in range(3):
        d.step([("a", 1), ("b", 1)])
    d.check_at_rest()
    # identity layout: the resident shared pages are read in place (nothing to recompute into);
    # budgeted: a recomputes into its own transient pages
    assert (d.recompute_rows > 0) == (budget is not None)


@pytest.mark.parametrize("budget", [None, PAGES + 6])
def test_negative_control_corrupted_recompute_is_caught(budget):
    with pytest.raises(AssertionError, match=KV_MISMATCH):
        _scenario(make_core(budget), 2, LAYERS, corrupt=True)


def test_negative_control_a_missing_recompute_write_is_caught(monkeypatch):
    """Transient pages read before anything was recomputed into them: the in-layer read fails."""
    monkeypatch.setattr(LayeredKVCore, "write_recompute", lambda self, layer, k, v: 0)
    with pytest.raises(AssertionError, match=KV_MISMATCH):
        _scenario(make_core(PAGES + 6), 2, LAYERS)


def test_recompute_with_pause_resume_and_overflowing_budget():
    """A pause and resume in between, and a budget too small to stage: overflow steps read the
    prefix at rest from host memory (exact), recomputation is skipped."""
    d = CoreDriver(make_core(4), seed=7)
    d.add("a")
    d.add("b")
    d.step([("a", 9), ("b", 5)])
    d.want("a", [True, False, True], uncached=2)
    d.recompute["a"] = (2, 2)
    d.step([("a", 1), ("b", 1)])
    d.want("a", ALL, paused=True)
    d.step([("b", 1)])
    d.want("a", ALL, uncached=2)
    d.step([("a", 1), ("b", 1)])
    d.check_at_rest()
    assert d.core.overflow_steps > 0


def test_uncached_pages_are_validated():
    from sglang_ext.dataplane.slot_results import RequestResidency

    with pytest.raises(ValueError, match="uncached_pages"):
        RequestResidency(pages=(1, 2), gpu_layers=(True,), uncached_pages=2)
    with pytest.raises(ValueError, match="uncached_pages"):
        RequestResidency(pages=(1, 2), gpu_layers=(True,), uncached_pages=-1)
    assert RequestResidency(pages=(1, 2), gpu_layers=(True,), uncached_pages=1).uncached_pages == 1
    assert np.int64(0) == RequestResidency(pages=(1,), gpu_layers=(True,)).uncached_pages
