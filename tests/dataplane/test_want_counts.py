"""WantCounts: the residency's incremental want counts equal a recount after every change, pages
outside the dirty set are settled, and a change of one request makes the next full
reconciliation look at that request's pages only (not at the other live requests')."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from tests.dataplane.core_driver import LAYERS, make_core
from tests.dataplane.test_live_pages import TreeDriver, random_op


def recount(res) -> None:  # noqa: ANN001 - SlotResidency
    """The counts equal a brute-force pass over the requests; clean live pages are settled."""
    res.settle()  # recorded releases and frees first (what every reader does)
    c, store = res.counts, res.store
    users, paused, want = np.zeros_like(c.users), np.zeros_like(c.paused_users), np.zeros_like(c.want)
    active: set[int] = set()
    offloading: set[int] = set()  # distinct pages: one staging page per page (staging_columns.py)
    for r in res.requests.values():
        p = r.pages.numpy()
        np.add.at(users, p, 1)
        if r.paused:
            np.add.at(paused, p, 1)
            continue
        active.update(p.tolist())
        if r.uncached or not all(r.gpu_layers):
            offloading.update(p.tolist())
        for layer, on in enumerate(r.gpu_layers):
            if on:
                np.add.at(want[layer], p, 1)
    assert (users == c.users).all() and (paused == c.paused_users).all() and (want == c.want).all()
    assert (c.active_pages, c.offloading_pages) == (len(active), len(offloading))
    assert c.paused_requests == sum(r.paused for r in res.requests.values())
    live, resident = users > 0, store.map_np >= 0
    assert (c.live_count, c.live_resident) == (int(live.sum()), int(resident[:, live].sum()))
    clean = live.copy()
    clean[c.dirty_live()] = False
    target = want > 0
    assert not (target & ~resident)[:, clean].any()
    assert not (resident & ~target & (paused == 0)[None, :])[:, clean].any()


@pytest.mark.parametrize("seed", range(4))
def test_counts_match_a_recount(seed):
    """Random prefills, decodes, plans, pauses, prefix hits, cached prefixes and frees under
    budgets from roomy to overflowing: the counts and the settled invariant hold throughout."""
    rng = random.Random(seed)
    d = TreeDriver(make_core(rng.choice([None, 9, 15, 40])), seed=seed)
    n = 0
    for _ in range(60):
        n = random_op(d, rng, n)
        recount(d.core.residency)
    d.check_at_rest()


def _columns_seen(d: TreeDriver, change) -> int:  # noqa: ANN001
    """Columns the full reconciliations after ``change()`` compute on (0 when only the
    append-only fast path ran: an arrival)."""
    counts = d.core.residency.counts
    seen = []
    dirty_live = counts.dirty_live
    counts.dirty_live = lambda: seen.append(dirty_live()) or seen[-1]
    try:
        change()
        d.core.update_residency({})
    finally:
        del counts.dirty_live
    return max((int(s.size) for s in seen), default=0)


def test_a_change_of_one_request_looks_at_its_pages_only():
    """Twelve live requests: a finish, an arrival, a plan change, a pause and a resume of one of
    them each reconcile on at most that request's pages."""
    d = TreeDriver(make_core(None, pages=200), seed=0)
    for i in range(12):
        d.add(f"r{i}")
        d.step([(f"r{i}", 9)])
    d.core.update_residency({})
    assert not d.core.residency.counts.dirty_live().size  # the prefills' pages were settled
    pages = len(d.pages("r3"))
    assert _columns_seen(d, lambda: d.finish("r3")) <= pages
    assert _columns_seen(d, lambda: (d.add("new"), d.step([("new", 9)]))) <= len(d.pages("new"))
    assert _columns_seen(d, lambda: d.want("r5", [True, False, True])) <= len(d.pages("r5"))
    assert _columns_seen(d, lambda: d.want("r6", [True] * LAYERS, paused=True)) <= len(d.pages("r6"))
    assert _columns_seen(d, lambda: d.want("r6", [True] * LAYERS)) <= len(d.pages("r6"))
    d.check_at_rest()


def test_add_with_repeated_pages_counts_each_occurrence():
    """A page list longer than the scalar path with a repeat (the sort-free distinctness check
    must see it) counts every occurrence in users and want, exactly as ``np.add.at`` would; the
    same pages without the repeat take the distinct path and count once each."""
    counts = make_core(None).residency.counts
    pages = np.array([3, 4, 5, 6, 7, 8, 9, 10, 11, 5], dtype=np.int64)  # 5 twice, > SMALL pages
    assert not counts._distinct(pages) and counts._distinct(pages[:-1])
    counts.add(pages, [True] * LAYERS, False, 1)
    expected = np.zeros_like(counts.users)
    np.add.at(expected, pages, 1)
    assert (counts.users == expected).all() and counts.users[5] == 2
    assert (counts.want[:, 5] == 2).all() and (counts.want[:, 4] == 1).all()
    counts.add(pages, [True] * LAYERS, False, -1)
    assert not counts.users.any() and not counts.want.any()


def _shared_core():  # noqa: ANN202
    """Two requests sharing their first pages (page size 1); returns the driver and the pages
    both hold."""
    from tests.dataplane.core_driver import CoreDriver

    d = CoreDriver(make_core(None, pages=65), seed=5)
    d.add("a")
    d.step([("a", 4)])
    d.add("b", share_from="a", share_pages=2)
    d.step([("b", 2)])
    users = d.core.residency.counts.users
    shared = [p for p in sorted(set(d.slots["a"])) if users[p] == 2]
    assert shared
    return d, shared


def test_freed_pages_leave_every_holder():
    """SGLang frees a finishing request's pages before releasing it. A freed page two live
    requests hold is cut from both (one vectorised pass finds every holder), once the recorded
    frees are applied, and the counts equal a recount."""
    d, shared = _shared_core()
    res = d.core.residency
    d.core.page_freed(shared)
    assert (res.counts.users[shared] == 2).all()  # recorded, not applied
    d.core.settle()
    assert (res.counts.users[shared] == 0).all()
    assert not set(shared) & set(res.requests["b"].pages.tolist())
    recount(res)


def test_a_holder_left_with_a_freed_page_is_caught():
    """Negative control for the test above: had the cut missed ``b`` (it keeps a freed page),
    both its checks fail."""
    d, shared = _shared_core()
    res = d.core.residency
    d.core.page_freed(shared)
    d.core.settle()
    b = res.requests["b"]
    b.pages = torch.cat([torch.tensor(shared[:1], dtype=torch.int64), b.pages])  # the miss
    assert set(shared) & set(b.pages.tolist())
    with pytest.raises(AssertionError):
        recount(res)


def test_a_holder_keeping_pages_leaves_the_counts_for_the_cut_ones_only(monkeypatch):
    """The cheap path (the holder keeps other pages: only the cut pages leave the counts) is
    what the recount above checks; with it skipping the user counts the recount fails."""
    d, shared = _shared_core()
    res = d.core.residency
    real = res.counts.track_removed_many
    called: list[list[int]] = []

    def track_removed_many(cuts):  # noqa: ANN001, ANN202
        called.append([int(removed.size) for _, removed in cuts])
        real(cuts)
        for _, removed in cuts:
            np.add.at(res.counts.users, removed, 1)  # the defect: users not decremented

    monkeypatch.setattr(res.counts, "track_removed_many", track_removed_many)
    d.core.page_freed(shared)
    d.core.settle()
    assert called == [[len(shared), len(shared)]]  # both holders keep other pages: the cheap path, one call
    with pytest.raises(AssertionError):
        recount(res)


def _rewritten_row():  # noqa: ANN202
    """``b`` shares ``a``'s first pages; SGLang then rewrites ``b``'s row: its first page is
    swapped for another (a prefill's duplicate prefix replaced by the tree's copy)."""
    from sglang_ext.dataplane.slot_results import RequestResidency

    d, shared = _shared_core()
    res = d.core.residency
    old = d.pages("b")
    spare = next(p for p in range(1, 65) if res.counts.users[p] == 0 and p not in old)
    new = (spare, *old[1:])
    return d, res, old, new, RequestResidency(pages=new, gpu_layers=(True,) * LAYERS)


def test_a_rewritten_row_moves_only_the_pages_that_differ(monkeypatch):
    """Only the swapped pages leave and join the counts (the request does not leave and rejoin);
    the counts equal a recount and the page given up becomes an orphan candidate."""
    d, res, old, new, want = _rewritten_row()
    moved: list[tuple[str, list[int]]] = []
    for name in ("track_removed", "track_added"):
        real = getattr(res.counts, name)
        monkeypatch.setattr(res.counts, name, lambda req, p, real=real, name=name: (moved.append((name, p.tolist())), real(req, p))[1])
    d.core.update_residency({"b": want})
    assert moved == [("track_removed", [old[0]]), ("track_added", [new[0]])]
    assert res.requests["b"].pages.tolist() == list(new)
    assert old[0] in res.maybe_orphan
    recount(res)


def test_a_rewritten_row_that_forgets_the_added_page_is_caught(monkeypatch):
    """Negative control: a diff that drops the page that joined leaves the counts wrong."""
    d, res, old, new, want = _rewritten_row()
    monkeypatch.setattr(res.counts, "track_added", lambda req, p: None)
    d.core.update_residency({"b": want})
    with pytest.raises(AssertionError):
        recount(res)


def test_members_is_numpy_isin():
    """The scratch-based membership equals np.isin (repeats, misses, stale scratch values)."""
    counts = make_core(None, pages=65).residency.counts
    rng = np.random.default_rng(3)
    for _ in range(50):
        pages = rng.integers(0, 65, size=int(rng.integers(0, 40)))
        of = rng.integers(0, 65, size=int(rng.integers(0, 10)))
        assert (counts.members(pages, of) == np.isin(pages, of)).all()
    assert counts.members(np.array([1, 2, 3]), np.array([2])).tolist() == [False, True, False]  # not all-False


def test_an_appended_page_resident_at_an_unwanted_layer_stays_dirty(monkeypatch):
    """The append-only fast path checks its pages only when a request that does not want every
    layer appended a page resident at a layer it does not want (a prefix page): seed 10 of the
    random ops makes one (found by search), the check sees a page to drop, and the page stays
    dirty -- the recount's settled invariant holds after every op. The control: without the
    resident check in ``_reconcile_appended`` the page is taken for settled and the recount fails."""
    counts_cls = type(make_core(None).residency.counts)
    seen = []
    plan_of = counts_cls.settle_plan
    monkeypatch.setattr(counts_cls, "settle_plan", lambda self, room: seen.append(plan_of(self, room)) or seen[-1])
    rng = random.Random(10)
    d = TreeDriver(make_core(rng.choice([None, 9, 15, 40])), seed=10)
    n = 0
    for _ in range(40):
        n = random_op(d, rng, n)
        recount(d.core.residency)
    assert any(p is None or p[0].size for p in seen), "the seed no longer appends a resident unwanted layer"
    d.check_at_rest()
