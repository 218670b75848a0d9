"""distinct_sorted / has_repeats equal np.unique's answers (random and run-shaped ids);
run_bounds finds the runs of equal values of an unsorted array, as itertools.groupby does;
ascending is the sort of distinct ids (reversed without a sort when they come descending)."""

from __future__ import annotations

import itertools

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_ext.dataplane.sorted_ids import (
    ascending,
    distinct_counts,
    distinct_sorted,
    has_repeats,
    run_bounds,
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
