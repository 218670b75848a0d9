"""OpenedPages: a decode step's opened pages observed and placed in one pass leave exactly the
state the general route leaves (``observe`` per request, then ``reconcile``), or decline with
nothing changed.

After random histories (prefills, decodes, plans with layers on the host, pauses, cached
prefixes, frees) under budgets from the identity layout to a tight pool, the residency is copied
twice; one copy takes the one pass on some live requests' page lists plus one page each (a fresh
page mostly, sometimes one already used, a repeat, or a list that is not the last plus one page),
the other the general route. Every attribute reachable from the residency (counts, map,
allocator, mirror log, requests, store) must be equal, and the deltas and reported moves; a
declined call must leave its copy equal to an untouched third. Controls: the comparison catches
one counter or one array entry off; a placement that raises leaves what the general route's
would. The served path takes the one pass (``PagedDecodeStep``), and its reads stay exact.
"""

from __future__ import annotations

import copy
import random
from typing import Any

import numpy as np
import pytest
import torch

from sglang_ext.dataplane.opened_pages import OpenedPages
from sglang_ext.dataplane.slot_kv_store import SlotKVStore
from tests.dataplane.core_driver import LAYERS, make_core
from tests.dataplane.test_live_pages import TreeDriver, random_op

SCRATCH = frozenset({"scratch"})
"""Attributes whose contents mean nothing between calls (``DistinctIds.scratch``)."""


def assert_same(a: Any, b: Any, path: str = "res", skip: frozenset[str] = SCRATCH,
                seen: set[tuple[int, int]] | None = None) -> None:
    """Every attribute reachable from ``a`` equals ``b``'s (arrays, tensors, containers, plain
    values, objects attribute by attribute); the first difference raises with its path."""
    seen = set() if seen is None else seen
    if (id(a), id(b)) in seen:
        return
    seen.add((id(a), id(b)))
    assert type(a) is type(b), (path, type(a), type(b))
    if isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b), path
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert list(a) == list(b), path
        for key in a:
            assert_same(a[key], b[key], f"{path}[{key!r}]", skip, seen)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}[{i}]", skip, seen)
    elif isinstance(a, (set, frozenset, int, float, str, bytes, type(None), np.generic, torch.dtype, torch.device)):
        assert a == b, (path, a, b)
    elif callable(a) and not hasattr(a, "__dict__"):
        return  # builtins and bound methods: compared through their owners
    elif hasattr(a, "__dict__"):
        for key in vars(a).keys() | vars(b).keys():
            if key not in skip:
                assert_same(vars(a).get(key), vars(b).get(key), f"{path}.{key}", skip, seen)
    else:
        assert repr(a) == repr(b), (path, repr(a), repr(b))  # e.g. itertools.count


def _history(seed: int) -> TreeDriver:
    rng = random.Random(seed)
    d = TreeDriver(make_core(rng.choice([None, 15, 40, 60, 99])), seed=seed)
    n = 0
    for _ in range(rng.randint(5, 40)):
        n = random_op(d, rng, n)
    if rng.random() < 0.5 and d.slots:  # often a plan keeping layers of one request on the host
        d.want(rng.choice(sorted(d.slots)), [rng.random() < 0.6 for _ in range(LAYERS)])
    if rng.random() < 0.7 and d.slots:  # usually a decode step last: its reconciliation settles
        d.step([(r, 1) for r in d.slots])
    return d


def _openings(d: TreeDriver, rng: random.Random) -> tuple[list[str], list[np.ndarray]]:
    """Some live requests' page lists plus one page each: a free page mostly, else a mistake."""
    res = d.core.residency
    res.settle()
    rids = [r for r in d.slots if r in res._requests]
    rids = rng.sample(rids, rng.randint(0, min(len(rids), 4)))
    free = [p for p in d.free_pages if p not in {q for r in d.slots.values() for q in (s // d.ps for s in r)}]
    rng.shuffle(free)
    lists = []
    for rid in rids:
        old = res._requests[rid].pages.numpy()
        roll = rng.random()
        if roll < 0.8 and free:
            page = free.pop()
        elif roll < 0.9 and old.size:
            page = int(old[0])  # a page it already holds
        else:
            page = rng.randrange(1, d.core.config.logical_pages)  # any page: maybe another's
        grown = np.append(old, np.int64(page))
        if rng.random() < 0.05 and grown.size > 1:
            grown = grown[1:]  # not the last list plus a page: one page short
        elif rng.random() < 0.05 and grown.size > 1:
            grown[0] = page  # ... or one page more, another first
        lists.append(grown.astype(old.dtype))
    if len(lists) > 1 and rng.random() < 0.05:
        lists[1] = np.append(lists[1][:-1], lists[0][-1])  # two requests open the same page
    return rids, lists


def _general(res, rids, lists):  # noqa: ANN001, ANN202 - SlotResidency
    for rid, pages in zip(rids, lists, strict=True):
        res.observe(rid, torch.from_numpy(pages))
    return res.reconcile()


@pytest.mark.parametrize("seed", range(12))
def test_the_one_pass_leaves_the_general_routes_state(seed):
    rng = random.Random(1000 + seed)
    outcomes = {"taken": 0, "declined": 0, "partial": 0, "identity": 0}
    for case in range(25):
        d = _history(seed * 100 + case)
        res = d.core.residency
        rids, lists = _openings(d, rng)
        one, general, untouched = copy.deepcopy(res), copy.deepcopy(res), copy.deepcopy(res)
        moves: list = []
        delta = OpenedPages(one).reconcile(rids, lists, moves.append)
        if delta is None:
            outcomes["declined"] += 1
            assert not moves
            assert_same(one, untouched)
            continue
        outcomes["taken"] += 1
        outcomes["partial"] += any(not all(one._requests[r].gpu_layers) for r in rids)
        outcomes["identity"] += bool(one.store.identity and rids)
        assert delta == _general(general, rids, lists)
        assert moves == [general.last_moves]
        assert_same(one, general)
    assert outcomes["taken"] >= 5 and outcomes["declined"] >= 2, outcomes


def _declines(res, rids, lists) -> None:  # noqa: ANN001 - SlotResidency
    one, untouched = copy.deepcopy(res), copy.deepcopy(res)
    assert OpenedPages(one).reconcile(rids, lists) is None
    assert_same(one, untouched)


def test_each_condition_declines_with_nothing_changed():
    """The taken case, less one condition each time: declined, the copy equal to an untouched one."""
    res, rids, lists = _taken_case(pages=2, partial=True)
    rids, lists = rids[:2], lists[:2]
    used = int(lists[0][0])  # the first request's first page
    res.has_kv_np[used] = False  # a used page that is neither written nor placed: only its users tell
    res.store.map_np[:, used] = -1
    _declines(res, rids, [lists[0], np.append(lists[1][:-1], used)])
    _declines(res, rids, [lists[0], np.append(lists[1][:-1], lists[0][-1])])  # one page for two requests
    _declines(res, rids, [lists[0][1:], lists[1]])  # one page short
    shifted = lists[0].copy()
    shifted[0] = shifted[-1]
    _declines(res, rids, [shifted, lists[1]])  # another first page
    _declines(res, rids, [lists[0].astype(np.int32), lists[1]])
    _declines(res, rids + rids[:1], lists + lists[:1])  # a request twice
    _declines(res, ["nobody", rids[1]], lists)
    for flag in ("paused", "uncached"):
        setattr(res._requests[rids[0]], flag, True)
        _declines(res, rids, lists)
        setattr(res._requests[rids[0]], flag, False)
    for owner, flag in ((res, "_changed"), (res.counts, "_kept"), (res.counts, "check_appended")):
        setattr(owner, flag, True)
        _declines(res, rids, lists)
        setattr(owner, flag, False)
    fresh = int(lists[0][-1])
    res.store.map_np[1, fresh] = 0  # a fresh page already placed at a layer
    _declines(res, rids, lists)
    res.store.map_np[1, fresh] = -1
    reqs = [res._requests[r] for r in rids]
    need, partial = sum(sum(r.gpu_layers) for r in reqs), sum(not all(r.gpu_layers) for r in reqs)
    assert partial, "the case keeps no layer on the host"
    free = res.store.allocator.free_count
    res.counts.offloading_pages = free - need - partial + 1  # with the opened pages' staging: one short
    _declines(res, rids, lists)
    res.counts.offloading_pages = free + 1  # the staging reserve exceeds the room
    _declines(res, rids, lists)
    _declines(res, [], [])  # even for no page: the general route's full pass makes room
    res.counts.mark_dirty(np.array([used]))
    _declines(res, rids, lists)


def test_the_one_pass_is_taken_on_staged_and_identity_pages():
    """Over the histories above, the one pass placed pages of requests keeping layers on the host
    and pages in the identity layout (the comparison covers both)."""
    seen = {"partial": 0, "identity": 0}
    rng = random.Random(7)
    for case in range(120):
        d = _history(case)
        res = d.core.residency
        rids, lists = _openings(d, rng)
        if OpenedPages(copy.deepcopy(res)).reconcile(rids, lists) is not None and rids:
            seen["partial"] += any(not all(res._requests[r].gpu_layers) for r in rids)
            seen["identity"] += bool(res.store.identity)
    assert seen["partial"] >= 3 and seen["identity"] >= 3, seen


def _taken_case(pages: int = 1, identity: bool = False, partial: bool = False) -> tuple[Any, list[str], list[np.ndarray]]:
    """A history (identity layout or placed) whose openings of at least ``pages`` pages (with
    ``partial``: of a request keeping layers on the host among the first two) take the one pass."""
    rng = random.Random(3)
    for case in range(400):
        d = _history(case)
        if d.core.residency.store.identity != identity:
            continue
        rids, lists = _openings(d, rng)
        if partial and all(all(d.core.residency._requests[r].gpu_layers) for r in rids[:2]):
            continue
        if len(rids) >= pages and OpenedPages(copy.deepcopy(d.core.residency)).reconcile(rids, lists) is not None:
            return d.core.residency, rids, lists
    raise AssertionError("no history took the one pass")


def test_identity_pages_opened_in_descending_order():
    """Identity layout, two pages opened in descending order (the one pass places them sorted,
    the general route in the batch's order; the layout has no mirror to log them): the same state."""
    res, rids, lists = _taken_case(pages=2, identity=True)
    if lists[0][-1] < lists[1][-1]:
        rids, lists = rids[::-1], lists[::-1]
    one, general = copy.deepcopy(res), copy.deepcopy(res)
    assert OpenedPages(one).reconcile(rids, lists) == _general(general, rids, lists)
    assert_same(one, general)


def test_the_comparison_catches_one_counter_or_entry_off():
    res, rids, lists = _taken_case()
    one, general = copy.deepcopy(res), copy.deepcopy(res)
    OpenedPages(one).reconcile(rids, lists)
    _general(general, rids, lists)
    assert_same(one, general)
    one.counts.offloading_pages += 1
    with pytest.raises(AssertionError, match="offloading_pages"):
        assert_same(one, general)
    one.counts.offloading_pages -= 1
    page = int(lists[0][-1])
    one.counts.users[page] += 1
    with pytest.raises(AssertionError, match="users"):
        assert_same(one, general)


def test_a_placement_that_raises_leaves_what_the_general_route_leaves(monkeypatch):
    """The store's onload raises in both: the wants stay counted and dirty, the next pass is a
    full one, nothing is placed; the one pass reports its (empty) moves and propagates."""
    res, rids, lists = _taken_case()
    one, general = copy.deepcopy(res), copy.deepcopy(res)

    def fails(self, *args):  # noqa: ANN001, ANN002, ANN202
        raise RuntimeError("launch failed")

    monkeypatch.setattr(SlotKVStore, "onload", fails)
    moves: list = []
    with pytest.raises(RuntimeError, match="launch failed"):
        OpenedPages(one).reconcile(rids, lists, moves.append)
    with pytest.raises(RuntimeError, match="launch failed"):
        _general(general, rids, lists)
    assert moves == [general.last_moves] and one._changed and general._changed
    assert np.array_equal(one.counts.dirty_live(), general.counts.dirty_live())
    # the dirty pages' lists differ in form only (scalar entries or an array), checked just above
    assert_same(one, general, skip=SCRATCH | {"_dirty", "_dirty_small"})


def test_the_served_decode_step_takes_the_one_pass(monkeypatch):
    """A paged batch with layers on the host decodes through ``PagedDecodeStep``: the steps that
    open pages take the one pass, and every layer's reads equal the shadow KV."""
    from tests.dataplane.test_paged_advance import _staged_scenario

    one_pass, opened = OpenedPages.reconcile, []

    def noted(self, rids, *args):  # noqa: ANN001, ANN002, ANN202
        delta = one_pass(self, rids, *args)
        opened.append((len(rids), delta is not None))
        return delta

    monkeypatch.setattr(OpenedPages, "reconcile", noted)
    d = _staged_scenario()
    taken = [n for n, took in opened if took and n]
    assert len(taken) >= 5 and d.core.paged_decode.openings.taken == len(taken), opened
    assert d.core.stats().opened_one_pass_total == len(taken)
    assert any(not all(r.gpu_layers) for r in d.core.residency._requests.values())
