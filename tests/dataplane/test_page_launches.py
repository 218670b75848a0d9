"""A paged step's fetch launches kept as arrays (:class:`PageLaunches`): the objects an eager step
issues are the ones the tables used to build, and a graph admission's vectorised regrouping into
fetch lists equals the loop over those objects it replaces. Controls: launches out of their
order, and a list past the buffers' capacity."""

from __future__ import annotations

import numpy as np
import pytest

from sglang_ext.dataplane.graph_staging import START, TRIG
from sglang_ext.dataplane.page_launch import PageLaunch
from sglang_ext.dataplane.page_launches import PageLaunches

LAYERS, CAP = 6, 8
SEEDS = range(20)


def _random(seed: int) -> tuple[PageLaunches, np.ndarray]:
    """Launches as the tables emit them: per layer, its step-start launch (trigger -1) and
    triggered ones (earlier layers), in layer then trigger order; each request at most once per
    layer; the launches' request ids concatenated, ascending inside a launch."""
    rng = np.random.default_rng(seed)
    rows, reqs = [], []
    for layer in range(LAYERS):
        owners = rng.permutation(CAP)[: rng.integers(0, CAP + 1)]
        triggers = rng.integers(-1, layer, size=owners.size) if layer else np.full(owners.size, -1)
        for t in np.unique(triggers):
            ids = np.sort(owners[triggers == t])
            first = sum(r.size for r in reqs)
            rows.append((t, layer, 100 + first, 2 * int(rng.integers(1, 9)), first, ids.size,
                         int(rng.integers(1, 20))))
            reqs.append(ids)
    cols = [np.asarray(c, dtype=np.int64) for c in zip(*rows, strict=True)] if rows else [np.zeros(0, np.int64)] * 7
    return PageLaunches(*cols), np.concatenate(reqs) if reqs else np.zeros(0, dtype=np.int64)


def _loop(launches: list[PageLaunch], reqs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The regrouping as GraphStaging.load did it before, launch by launch."""
    lists = np.zeros((2, LAYERS, CAP), dtype=np.int32)
    listed = np.zeros((2, LAYERS, 2), dtype=np.int32)
    for launch in launches:
        kind = START if launch.trigger < 0 else TRIG
        k, at = launch.layer, int(listed[kind, launch.layer, 0])
        lists[kind, k, at: at + launch.n_reqs] = reqs[launch.first: launch.first + launch.n_reqs]
        listed[kind, k, 0] = at + launch.n_reqs
        listed[kind, k, 1] = max(int(listed[kind, k, 1]), launch.max_pages)
    return lists, listed


def _vectorised(launches: PageLaunches, reqs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    lists = np.zeros((2, LAYERS, CAP), dtype=np.int32)
    listed = np.zeros((2, LAYERS, 2), dtype=np.int32)
    launches.regroup(reqs, lists, listed)
    return lists, listed


@pytest.mark.parametrize("seed", SEEDS)
def test_regrouping_equals_the_loop_over_the_launches(seed):
    """Every seed's fetch lists, lengths and widest pages equal the launch-by-launch loop's."""
    launches, reqs = _random(seed)
    want, got = _loop(launches.launches(), reqs), _vectorised(launches, reqs)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])


def test_the_objects_are_the_launches_in_order():
    """``launches()`` gives one PageLaunch per entry, fields in order; counts are sums."""
    launches, _ = _random(3)
    objs = launches.launches()
    assert [(o.trigger, o.layer, o.offset, o.segments, o.first, o.n_reqs, o.max_pages) for o in objs] == list(
        zip(*(c.tolist() for c in (launches.trigger, launches.layer, launches.offset, launches.segments,
                                    launches.first, launches.n_reqs, launches.max_pages)), strict=True))
    assert len(launches) == len(objs) > 0
    assert launches.layer_pages == sum(o.segments for o in objs) // 2
    assert launches.start_segments == sum(o.segments for o in objs if o.trigger < 0)
    assert len(PageLaunches()) == 0 and PageLaunches().launches() == []


def test_control_launches_out_of_order_regroup_differently():
    """Control: two triggered launches of one layer swapped fill that layer's list in the other
    order -- the comparison above sees the order of the ids, not only the sets."""
    for seed in SEEDS:
        launches, reqs = _random(seed)
        trig = launches.trigger >= 0
        pairs = [g for g in range(len(launches) - 1) if trig[g] and trig[g + 1]
                 and launches.layer[g] == launches.layer[g + 1] and launches.n_reqs[g] and launches.n_reqs[g + 1]]
        if not pairs:
            continue
        order = np.arange(len(launches))
        order[[pairs[0], pairs[0] + 1]] = order[[pairs[0] + 1, pairs[0]]]
        swapped = [launches.launches()[i] for i in order]
        assert not np.array_equal(_loop(swapped, reqs)[0], _vectorised(launches, reqs)[0])
        return
    pytest.fail("no seed has two triggered launches at one layer")


def test_a_list_past_the_capacity_is_refused():
    """More requests in one list than the buffers hold: a ValueError naming both, nothing cut."""
    one = np.asarray([0], dtype=np.int64)
    launches = PageLaunches(trigger=-one - 1, layer=one, offset=one, segments=one + 2, first=one,
                            n_reqs=one + CAP + 1, max_pages=one + 1)
    with pytest.raises(ValueError, match=f"{CAP + 1} requests; lists hold {CAP}"):
        _vectorised(launches, np.arange(CAP + 1))


@pytest.mark.parametrize("seed", SEEDS)
def test_resized_launches_regroup_as_the_loop_does_from_the_shared_memo(seed):
    """A steady step's launches are the last step's resized (:meth:`PageLaunches.resized`): the
    regroup's remembered ids and lengths are reused, the widest pages recomputed -- equal to the
    launch-by-launch loop over the resized launches. Control: the widths did change the lists'
    widest pages (the comparison sees them), and other request ids are not served from the memo."""
    launches, reqs = _random(seed)
    if not len(launches):
        return
    first = _vectorised(launches, reqs)
    rng = np.random.default_rng(100 + seed)
    bigger = launches.resized(launches.segments + 2 * rng.integers(0, 3, len(launches)),
                              launches.max_pages + rng.integers(1, 4, len(launches)), 7)
    assert bigger.memo is launches.memo and ("regroup", LAYERS, CAP) in bigger.memo
    np.testing.assert_array_equal(bigger.offset, launches.offset + 7)
    want, got = _loop(bigger.launches(), reqs), _vectorised(bigger, reqs)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])
    assert not np.array_equal(got[1], first[1])  # control: the new widths reached the lists
    assert bigger.start_segments == sum(o.segments for o in bigger.launches() if o.trigger < 0)
    other = (reqs + 1) % CAP  # a different array of ids: planned again, not the memo's
    np.testing.assert_array_equal(_vectorised(bigger, other)[0], _loop(bigger.launches(), other)[0])


def test_resized_refuses_sizes_of_another_length():
    launches, _ = _random(3)
    with pytest.raises(ValueError, match=f"1 sizes and {len(launches)} widths for {len(launches)} launches"):
        launches.resized(launches.segments[:1], launches.max_pages, 0)
