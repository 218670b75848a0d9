"""EndedRequests: releases and frees recorded while SGLang processes a step's results, applied in
one batch by the next reader -- to the same state as applying each call when it came."""

from __future__ import annotations

import pytest

from tests.dataplane.core_driver import CoreDriver, make_core


def _driver(seed: int) -> CoreDriver:
    """Four requests, two sharing a prefix, one step each (identity layout)."""
    d = CoreDriver(make_core(None, pages=65), seed=seed)
    d.add("a")
    d.step([("a", 5)])
    d.add("b", share_from="a", share_pages=3)
    d.add("c")
    d.add("e")
    d.step([("b", 2), ("c", 4), ("e", 3)])
    return d


def _finish_all(d: CoreDriver, settle_each: bool) -> None:
    """SGLang's order per request: its unshared pages freed, then the request released."""
    for rid in ("a", "c", "e"):
        slots = d.slots.pop(rid)
        pages = sorted({s for s in slots if d._refs(s) == 0})  # page size 1
        d.core.page_freed(pages)
        if settle_each:
            d.core.settle()
        d.core.release_request(rid)
        if settle_each:
            d.core.settle()


def _orphan_candidates(d: CoreDriver) -> list[int]:
    """The orphan candidates that can matter: those with a device copy (a freed page may stay a
    candidate -- the orphan scan skips pages with no device copy)."""
    store = d.core.store
    return sorted(p for p in d.core.residency.maybe_orphan if (store.map_np[:, p] >= 0).any())


def _state(d: CoreDriver) -> tuple:
    res, store = d.core.residency, d.core.store
    return (store.map_np.tobytes(), res.counts.users.tobytes(), res.counts.want.tobytes(),
            res.has_kv_np.tobytes(), sorted(store.allocator.used_ids()), _orphan_candidates(d),
            sorted(res.requests), res.counts.active_pages, res.counts.live_resident)


def test_one_batch_equals_each_call_applied_when_it_came():
    one, each = _driver(1), _driver(1)
    _finish_all(one, settle_each=False)
    assert one.core.residency.ended.pending  # recorded only
    assert "a" in one.core.residency.requests
    one.core.settle()
    _finish_all(each, settle_each=True)
    each.core.settle()
    assert one.core.residency.ended.applications == 1
    assert _state(one) == _state(each)
    one.check_at_rest()


def test_a_batch_that_drops_the_frees_differs():
    """Negative control: the same batch with its frees dropped leaves other state."""
    one, each = _driver(2), _driver(2)
    _finish_all(one, settle_each=False)
    one.core.residency.ended.freed.clear()
    one.core.settle()
    _finish_all(each, settle_each=True)
    assert _state(one) != _state(each)


def test_the_decode_journal_declines_while_ends_are_pending():
    """A step journalled after a recorded release would be applied before it (wrong order): the
    journal declines. Control: the same step is journalled once the end is applied."""
    d = _driver(3)
    d.slots.pop("e")
    d.step([("a", 1), ("b", 1), ("c", 1)])  # reconciled: a steady step may follow
    d.core.release_request("e")
    res = d.core.residency
    assert not res.journal.record(["a"], None, [60], None)
    res.ended.apply()
    res.changed = False  # what the next reconciliation leaves (nothing else changed)
    assert res.journal.record(["a"], None, [60], None)


@pytest.mark.parametrize("order", ["release-first", "free-first"])
def test_free_page_figure_applies_pending_ends(order):
    d = _driver(4)
    slots = d.slots.pop("c")
    pages = sorted(set(slots))
    calls = [lambda: d.core.release_request("c"), lambda: d.core.page_freed(pages)]
    for call in calls if order == "release-first" else calls[::-1]:
        call()
    before = d.core.free_device_pages()  # applies: the figure is exact
    assert not d.core.residency.ended.pending
    assert before == d.core.store.allocator.free_count + d.core.residency.reclaimable_pages
