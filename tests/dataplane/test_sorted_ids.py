"""distinct_sorted / has_repeats equal np.unique's answers (random and run-shaped ids);
run_bounds finds the runs of equal values of an unsorted array, as itertools.groupby does;
ascending is the sort of distinct ids (reversed without a sort when they come descending);
inserted is np.insert at ascending places (few: slices; many: a mask); wanted_pairs is the
unique (layer, page) pairs of repeated and tiled parts."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_ext.dataplane.sorted_ids import (
    FEW_IDS,
    ascending,
    distinct_counts,
    distinct_sorted,
    has_repeats,
    inserted,
    run_bounds,
    wanted_pairs,
)

ids_lists = st.lists(st.integers(min_value=0, max_value=300), max_size=200)


@settings(max_examples=200, deadline=None)
@given(ids_lists)
def test_distinct_sorted_is_numpy_unique(values: list[int]) -> None:
    a = np.asarray(values, dtype=np.int64)
    got = distinct_sorted(a)
    want = np.unique(a)
    assert got.dtype == a.dtype
    np.testing.assert_array_equal(got, want)
    assert has_repeats(a) == (len(set(values)) != len(values))
    uniq, counts = distinct_counts(a)
    want_uniq, want_counts = np.unique(a, return_counts=True)
    np.testing.assert_array_equal(uniq, want_uniq)
    np.testing.assert_array_equal(counts, want_counts)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5_000), st.integers(0, 50)), max_size=12))
def test_ascending_runs(runs: list[tuple[int, int]]) -> None:
    """SGLang's shape: ascending runs of slots (possibly overlapping)."""
    a = np.concatenate([np.arange(s, s + n, dtype=np.int64) for s, n in runs] or [np.zeros(0, np.int64)])
    np.testing.assert_array_equal(distinct_sorted(a), np.unique(a))
    assert has_repeats(a) == (np.unique(a).size != a.size)


def test_negative_control_repeats_are_removed() -> None:
    """A sort alone (no dedupe) would fail the comparison above: the check can fail."""
    a = np.array([5, 3, 5, 1, 3], dtype=np.int64)
    assert not np.array_equal(np.sort(a, kind="stable"), np.unique(a))
    np.testing.assert_array_equal(distinct_sorted(a), [1, 3, 5])
    assert has_repeats(a) and not has_repeats(np.array([2, 1], dtype=np.int64))
    uniq, counts = distinct_counts(a)
    assert uniq.tolist() == [1, 3, 5] and counts.tolist() == [1, 2, 2]
    assert counts.tolist() != [1, 1, 1]  # counting every id once would fail the comparison


@pytest.mark.parametrize("dtype", [np.int64, np.int32])
@pytest.mark.parametrize("size", [FEW_IDS // 2, FEW_IDS, FEW_IDS + 1, 4 * FEW_IDS])
def test_both_paths_of_distinct_sorted_are_numpy_unique(size: int, dtype: type) -> None:
    """A few ids (a Python set sorted) and more (a stable sort): np.unique's values and dtype, a
    decode step's shape (two pages repeated per layer) and a random one."""
    rng = np.random.default_rng(size)
    for a in (np.tile(np.array([9, 4], dtype=dtype), size // 2), rng.integers(0, size, size).astype(dtype)):
        got = distinct_sorted(a)
        assert got.dtype == a.dtype
        np.testing.assert_array_equal(got, np.unique(a))


def test_result_is_not_the_input() -> None:
    """Callers may write into the result (tiny inputs are copied, not aliased)."""
    a = np.array([7], dtype=np.int64)
    out = distinct_sorted(a)
    out[0] = 0
    assert a[0] == 7


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=3), max_size=60))
def test_run_bounds_are_groupby_runs(values: list[int]) -> None:
    """Runs of equal adjacent values (not sorted: 1, 1, 0, 1 has three runs). Control: the runs
    of the sorted values differ whenever a value comes back after another."""
    starts, sizes = run_bounds(np.asarray(values, dtype=np.int64))
    want = [len(list(g)) for _, g in itertools.groupby(values)]
    assert sizes.tolist() == want
    assert starts.tolist() == [sum(want[:i]) for i in range(len(want))]
    if len(want) != len(set(values)):
        assert run_bounds(np.sort(np.asarray(values, dtype=np.int64)))[1].tolist() != want


@settings(max_examples=200, deadline=None)
@given(st.sets(st.integers(min_value=0, max_value=10_000), max_size=300), st.sampled_from(["random", "up", "down"]))
def test_ascending_is_the_sort_of_distinct_ids(values: set[int], order: str) -> None:
    """``ascending`` of distinct ids (as the allocator hands them out: descending after an ascending
    free, or any order) is their sort; the reversal it takes for a descending batch is checked
    for order, not assumed (a batch that starts high and ends low but is not descending)."""
    a = np.asarray(sorted(values), dtype=np.int64)
    if order == "down":
        a = a[::-1].copy()
    elif order == "random":
        a = np.random.default_rng(len(values)).permutation(a)
    np.testing.assert_array_equal(ascending(a), np.sort(a))


def test_ascending_sorts_a_batch_that_only_looks_descending() -> None:
    """First above last, but not descending: sorted, not merely reversed (the negative control:
    the reversal alone is not the sort)."""
    a = np.array([9, 1, 7, 3, 2], dtype=np.int64)
    assert not np.array_equal(a[::-1], np.sort(a))
    np.testing.assert_array_equal(ascending(a), [1, 2, 3, 7, 9])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(-50, 50), max_size=60), st.lists(st.integers(0, 60), max_size=20))
def test_inserted_is_numpy_insert(values: list[int], places: list[int]) -> None:
    a = np.asarray(values, dtype=np.int64)
    at = np.sort(np.asarray([p % (a.size + 1) for p in places], dtype=np.int64))  # repeats allowed
    new = -1000 - np.arange(at.size, dtype=np.int64)
    got = inserted(a, at, new)
    np.testing.assert_array_equal(got, np.insert(a, at, new))
    assert got.dtype == a.dtype and not np.shares_memory(got, a)


def test_negative_control_inserted_order_matters() -> None:
    """Two new values at one place keep their order: swapping them gives a different array."""
    a, at = np.arange(5, dtype=np.int64), np.array([2, 2])
    assert inserted(a, at, np.array([7, 8])).tolist() == [0, 1, 7, 8, 2, 3, 4]
    assert inserted(a, at, np.array([8, 7])).tolist() != [0, 1, 7, 8, 2, 3, 4]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(0, 40), min_size=1, max_size=6),
                          st.lists(st.booleans(), min_size=5, max_size=5)), min_size=1, max_size=6))
def test_wanted_pairs_is_the_unique_of_the_tiled_pairs(parts: list[tuple[list[int], list[bool]]]) -> None:
    """Requests' page lists (pages may repeat, within and across) with their wanted layers: the
    pairs equal the old construction (np.repeat / np.tile, then unique flat ids)."""
    layers, lp = 5, 41
    pages = np.concatenate([np.asarray(p, dtype=np.int64) for p, _ in parts])
    want = np.concatenate([np.broadcast_to(np.asarray(m)[:, None], (layers, len(p))) for p, m in parts], axis=1)
    flat = [np.repeat(np.flatnonzero(m), len(p)) * lp + np.tile(np.asarray(p, dtype=np.int64), int(sum(m)))
            for p, m in parts]
    want_l, want_p = np.divmod(np.unique(np.concatenate(flat)), lp)
    got_l, got_p = wanted_pairs(pages, want)
    np.testing.assert_array_equal(got_l, want_l)
    np.testing.assert_array_equal(got_p, want_p)


def test_negative_control_wanted_pairs_unions_a_repeated_page() -> None:
    """Page 3 wanted at layer 0 by one request and at layer 1 by another: both pairs, once each."""
    got = wanted_pairs(np.array([3, 3, 1]), np.array([[True, False, False], [False, True, True]]))
    assert [g.tolist() for g in got] == [[0, 1, 1], [3, 1, 3]]
    assert [g.tolist() for g in got] != [[0, 1], [3, 1]]
