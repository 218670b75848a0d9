"""OpenedPages: a decode step's opened pages observed and placed in one pass leave exactly the
state the general route leaves (``observe`` per request, then ``reconcile``), or decline with
nothing changed.

Random histories (prefills, decode steps journalled or paged, plans with layers on the host, no
layer or an uncached prefix, pauses, cached prefixes, frees) under budgets from the identity
layout to a tight pool are replayed from one seed (not deep-copied: a copy detaches
the store's views, ``map_flat_np`` from ``map_np``). One replay takes the one pass on some live
requests' page lists plus one page each (a fresh page mostly; sometimes one used, placed or
holding KV, a repeat, a request named twice, or a list that is not the last plus one page), one
the general route. Every attribute reachable from the residency must be equal (the counts, the
map, the allocator, the mirror's log, the requests), and the deltas and reported moves; a
declined call must leave its replay equal to an untouched one (settled, as the general route's
first step settles). Controls: two replays are equal and the comparison catches one counter or
one array entry off; a placement that raises leaves what the general route's would. The served
path takes the one pass (``PagedDecodeStep``), and its reads stay exact.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
import torch

from sglang_ext.dataplane.opened_pages import OpenedPages
from sglang_ext.dataplane.slot_kv_store import SlotKVStore
from tests.dataplane.core_driver import LAYERS, make_core
from tests.dataplane.test_live_pages import TreeDriver, random_op

SCRATCH = frozenset({"scratch", "clock"})
"""Attributes compared by no test here: ``DistinctIds.scratch`` (contents meaningless between
calls) and the engine's clock (wall times of the replays' copies)."""


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
    """A random history (deterministic in ``seed``: replayed, it builds an equal residency)."""
    rng = random.Random(seed)
    kind = rng.choice(["plain", "journalled", "paged"])
    d = TreeDriver(make_core(rng.choice([None, 15, 40, 60, 99])), seed=seed,
                   fast_decode=kind != "plain", paged_reads=kind == "paged" and rng.random() < 0.5)
    n = 0
    for _ in range(rng.randint(5, 40)):
        if rng.random() < 0.08 and d.slots:  # a plan: no layer, every layer or some; an uncached prefix
            mode = rng.random()
            layers = [mode > 0.3 and (mode < 0.5 or rng.random() < 0.6) for _ in range(LAYERS)]
            d.want(rng.choice(sorted(d.slots)), layers, paused=rng.random() < 0.2, uncached=rng.choice([0, 0, 0, 1, 2]))
        else:
            n = random_op(d, rng, n)
    if rng.random() < 0.5 and d.slots:  # often a plan keeping layers of one request on the host
        d.want(rng.choice(sorted(d.slots)), [rng.random() < 0.6 for _ in range(LAYERS)])
    if rng.random() < 0.7 and d.slots:  # usually a decode step last: its reconciliation settles
        d.step([(r, 1) for r in d.slots])
    return d


def _replays(seed: int, count: int) -> list[Any]:
    """``count`` residencies of the same history, each settled (what both routes do first)."""
    out = []
    for _ in range(count):
        res = _history(seed).core.residency
        res.settle()
        for req in res.requests.values():
            req.pages  # noqa: B018 - joins a journalled decode tail (as both routes' first read does)
        out.append(res)
    return out


def _openings(d: TreeDriver, rng: random.Random) -> tuple[list[str], list[np.ndarray]]:
    """Some live requests' page lists plus one page each: a free page mostly, else a mistake."""
    res = d.core.residency
    res.settle()
    rids = [r for r in d.slots if r in res.requests]
    rids = rng.sample(rids, rng.randint(0, min(len(rids), 4)))
    held = {int(q) for req in res.requests.values() for q in req.pages.numpy()}
    free = [q for q in d.free_pages if q not in held]
    rng.shuffle(free)
    lists = []
    for rid in rids:
        old = res.requests[rid].pages.numpy()
        roll = rng.random()
        if roll < 0.8 and free:
            page = free.pop()
        elif roll < 0.9 and old.size:
            page = int(old[0])  # a page it already holds
        else:
            page = rng.randrange(1, d.core.config.logical_pages)  # any page: maybe another's, or cached
        grown = np.append(old, np.int64(page)).astype(old.dtype)
        if rng.random() < 0.05 and grown.size > 1:
            grown = grown[1:]  # not the last list plus a page: one page short
        elif rng.random() < 0.05 and grown.size > 1:
            grown[0] = page  # ... or one page more, another first
        lists.append(grown)
    if rids and rng.random() < 0.05 and free:  # one request named twice, another free page
        rids.append(rids[0])
        lists.append(np.append(lists[0][:-1], np.int64(free.pop())).astype(lists[0].dtype))
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
    outcomes = {"taken": 0, "declined": 0}
    for case in range(25):
        h = seed * 100 + case
        d = _history(h)
        rids, lists = _openings(d, rng)  # settles, joins the tails: as _replays does
        one, (general,) = d.core.residency, _replays(h, 1)
        moves: list = []
        delta = OpenedPages(one).reconcile(rids, lists, moves.append)
        if delta is None:  # the general route's replay is untouched yet
            outcomes["declined"] += 1
            assert not moves
            assert_same(one, general)
            continue
        outcomes["taken"] += 1
        assert delta == _general(general, rids, lists)
        assert moves == [general.last_moves]
        assert_same(one, general)
    assert outcomes["taken"] >= 5 and outcomes["declined"] >= 2, outcomes


def test_replays_are_equal_and_the_comparison_catches_one_counter_or_entry_off():
    """The harness: two replays of a history are equal (and keep the store's views: a deep copy
    would not), and one counter or one array entry off is caught, by name."""
    h, rids, lists = _taken_case()
    one, general = _replays(h, 2)
    assert_same(one, general)
    identity = _replays(_taken_case(identity=True)[0], 1)[0].store
    assert np.shares_memory(identity.map_flat_np, identity.map_np)
    OpenedPages(one).reconcile(rids, lists)
    _general(general, rids, lists)
    assert_same(one, general)
    one.counts.offloading_pages += 1
    with pytest.raises(AssertionError, match="offloading_pages"):
        assert_same(one, general)
    one.counts.offloading_pages -= 1
    one.counts.users[int(lists[0][-1])] += 1
    with pytest.raises(AssertionError, match="users"):
        assert_same(one, general)


def _taken_case(pages: int = 1, identity: bool = False, partial: bool = False) -> tuple[int, list[str], list[np.ndarray]]:
    """A history's seed (identity layout or placed) whose openings of at least ``pages`` pages
    (with ``partial``: of a request keeping layers on the host among the first two) take the one pass."""
    rng = random.Random(3)
    for h in range(400):
        d = _history(h)
        res = d.core.residency
        if res.store.identity != identity:
            continue
        rids, lists = _openings(d, rng)
        if len(rids) < pages or len(set(rids)) < len(rids):
            continue
        if partial and all(all(res.requests[r].gpu_layers) for r in rids[:2]):
            continue
        if OpenedPages(res).reconcile(rids, lists) is not None:
            return h, rids, lists
    raise AssertionError("no history took the one pass")


def _declines(h: int, rids: list[str], lists: list[np.ndarray], tweak: Any = None) -> None:
    """The one pass on a replay (``tweak``-ed) declines, and the replay equals an untouched one."""
    one, untouched = _replays(h, 2)
    for res in (one, untouched):
        if tweak is not None:
            tweak(res)
    assert OpenedPages(one).reconcile(rids, lists) is None
    assert_same(one, untouched)


def test_each_condition_declines_with_nothing_changed():
    """The taken case, less one condition each time: declined, the replay equal to an untouched one."""
    h, rids, lists = _taken_case(pages=2, partial=True)
    rids, lists = rids[:2], lists[:2]
    used, fresh = int(lists[0][0]), int(lists[0][-1])  # the first request's first page; its opened one

    def unwritten(res):  # noqa: ANN001, ANN202 - a used page neither written nor placed: only its users tell
        res.has_kv_np[used] = False
        res.store.map_np[:, used] = -1

    _declines(h, rids, [lists[0], np.append(lists[1][:-1], used)], unwritten)
    _declines(h, rids, [lists[0], np.append(lists[1][:-1], lists[0][-1])])  # one page for two requests
    _declines(h, rids, [lists[0][1:], lists[1]])  # one page short
    shifted = lists[0].copy()
    shifted[0] = shifted[-1]
    _declines(h, rids, [shifted, lists[1]])  # another first page
    _declines(h, rids, [lists[0].astype(np.int32), lists[1]])
    _declines(h, rids + rids[:1], lists + [np.append(lists[0][:-1], lists[1][-1])])  # a request twice
    _declines(h, ["nobody", rids[1]], lists)
    last = int(_replays(h, 1)[0].store.config.logical_pages) - 1
    _declines(h, rids, [lists[0], np.append(lists[1][:-1], -1)], lambda r: r.has_kv_np.__setitem__(last, False))
    _declines(h, rids, lists, lambda r: r.has_kv_np.__setitem__(fresh, True))
    _declines(h, rids, lists, lambda r: r.store.map_np.__setitem__((1, fresh), 0))  # placed at a layer
    for flag in ("paused", "uncached"):
        _declines(h, rids, lists, lambda r, f=flag: setattr(r.requests[rids[0]], f, True))
    for flag in ("changed", "_kept", "check_appended"):
        _declines(h, rids, lists, lambda r, f=flag: setattr(r if f == "changed" else r.counts, f, True))
    _declines(h, rids, lists, lambda r: r.counts.mark_dirty(np.array([used])))
    one, untouched = _replays(h, 2)
    backwards = lists[1][::-1].copy()[::-1]  # the same pages, a negative stride: no tensor views it
    with pytest.raises(ValueError, match="negative stride"):
        OpenedPages(one).reconcile(rids, [lists[0], backwards])
    assert_same(one, untouched)  # raised before any change (the general route's observe raises first too)

    def short(by: int):  # noqa: ANN202 - the staging reserve leaves ``by`` pages too few
        def tweak(res):  # noqa: ANN001, ANN202
            reqs = [res.requests[r] for r in rids]
            need, partial = sum(sum(q.gpu_layers) for q in reqs), sum(not all(q.gpu_layers) for q in reqs)
            assert partial, "the case keeps no layer on the host"
            res.counts.offloading_pages = res.store.allocator.free_count - need - partial + by
        return tweak

    _declines(h, rids, lists, short(1))  # with the opened pages' own staging: one short
    one, general = _replays(h, 2)
    for res in (one, general):
        short(0)(res)
    assert OpenedPages(one).reconcile(rids, lists) == _general(general, rids, lists)  # exactly enough: taken
    assert_same(one, general)
    _declines(h, [], [], lambda r: setattr(r.counts, "offloading_pages", r.store.allocator.free_count + 1))


def test_the_one_pass_is_taken_on_staged_and_identity_pages():
    """Over such histories the one pass placed pages of requests keeping layers on the host and
    pages in the identity layout (the comparisons above cover both)."""
    seen = {"partial": 0, "identity": 0}
    rng = random.Random(7)
    for h in range(120):
        d = _history(h)
        res = d.core.residency
        rids, lists = _openings(d, rng)
        partial = any(not all(res.requests[r].gpu_layers) for r in rids)
        if rids and OpenedPages(res).reconcile(rids, lists) is not None:
            seen["partial"] += partial
            seen["identity"] += bool(res.store.identity)
    assert seen["partial"] >= 3 and seen["identity"] >= 3, seen


def test_identity_pages_opened_in_descending_order():
    """Identity layout, two pages opened in descending order (the one pass places them sorted,
    the general route in the batch's order; the layout has no mirror to log them): the same state."""
    h, rids, lists = _taken_case(pages=2, identity=True)
    rids, lists = rids[:2], lists[:2]
    if lists[0][-1] < lists[1][-1]:
        rids, lists = rids[::-1], lists[::-1]
    one, general = _replays(h, 2)
    assert OpenedPages(one).reconcile(rids, lists) == _general(general, rids, lists)
    assert_same(one, general)


def test_a_placement_that_raises_leaves_what_the_general_route_leaves(monkeypatch):
    """The store's onload raises in both: the wants stay counted and dirty, the next pass is a
    full one, nothing is placed; the one pass reports its (empty) moves and propagates."""
    h, rids, lists = _taken_case(partial=True)
    one, general = _replays(h, 2)

    def fails(self, *args):  # noqa: ANN001, ANN002, ANN202
        raise RuntimeError("launch failed")

    monkeypatch.setattr(SlotKVStore, "onload", fails)
    moves: list = []
    with pytest.raises(RuntimeError, match="launch failed"):
        OpenedPages(one).reconcile(rids, lists, moves.append)
    with pytest.raises(RuntimeError, match="launch failed"):
        _general(general, rids, lists)
    assert moves == [general.last_moves] and one.changed and general.changed
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
    assert any(not all(r.gpu_layers) for r in d.core.residency.requests.values())
