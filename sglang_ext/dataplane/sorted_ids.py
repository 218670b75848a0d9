"""Sorted distinct ids without :func:`numpy.unique` (issue 13's turnover cost).

Between two forwards on the 2-core host, ``np.unique`` of ~3,000 page ids costs 190-310 us: it
sorts with quicksort and then builds masks and index arrays it does not need here. The ids the
residency handles (a request's pages, a layer's freed pages, the dirty pages) come in ascending
runs -- SGLang's allocator hands out and frees slots in order -- which a stable sort (timsort)
merges in ~10 us for the same 3,000 ids (35 us for random ones). Results are identical to
``np.unique`` (sorted, distinct; the tests compare them on random and run-shaped inputs).
"""

from __future__ import annotations

import numpy as np


def run_firsts(values: np.ndarray) -> np.ndarray:
    """Mask of the first place of each run of equal values of a 1-D array."""
    first = np.ones(values.size, dtype=bool)
    np.not_equal(values[1:], values[:-1], out=first[1:])
    return first


def run_bounds(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Start and length of each run of equal values of a 1-D array (grouped, e.g. sorted)."""
    starts = np.flatnonzero(run_firsts(values))
    return starts, np.diff(starts, append=values.size)


def _sorted_firsts(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``ids`` sorted (stable: fast on ascending runs) and the mask of each value's first place."""
    s = np.sort(ids, kind="stable")
    return s, run_firsts(s)


FEW_IDS = 64
"""Up to this many ids, :func:`distinct_sorted` sorts a Python set (a decode step's few changed
pages, repeated per layer: three calls instead of NumPy's five)."""


def distinct_sorted(ids: np.ndarray) -> np.ndarray:
    """``np.unique(ids)`` of a 1-D integer array (its dtype kept)."""
    if ids.size <= FEW_IDS:
        return np.array(sorted(set(ids.tolist())), dtype=ids.dtype)
    s, first = _sorted_firsts(ids)
    return s if first.all() else s[first]


def distinct_counts(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(ids, return_counts=True)`` of a 1-D integer array."""
    s = np.sort(ids, kind="stable")
    starts, counts = run_bounds(s)
    return s[starts], counts


def has_repeats(ids: np.ndarray) -> bool:
    """Whether a 1-D integer array holds an id twice."""
    return not _sorted_firsts(ids)[1].all()


def ascending(ids: np.ndarray) -> np.ndarray:
    """Distinct ``ids`` in ascending order. The allocator's stack hands out the pages last freed
    first, so a batch comes out descending whenever it went back ascending: reversed, in O(n),
    with no sort; a stable sort (fast on runs) otherwise."""
    if ids.size > 1 and ids[0] > ids[-1]:
        ids = ids[::-1]
    if ids.size < 2 or bool((ids[1:] > ids[:-1]).all()):
        return np.ascontiguousarray(ids)
    return np.sort(ids, kind="stable")


def inserted(values: np.ndarray, at: np.ndarray, new: np.ndarray) -> np.ndarray:
    """``np.insert(values, at, new)`` for ascending ``at`` (1-D, ``new`` one per place), a new
    array. A decode step inserts a page or two into ~10K: slice copies, not ``np.insert``'s
    generic path (~3x slower there); many places (a turnover) take one masked write."""
    k = int(at.size)
    out = np.empty(values.size + k, dtype=values.dtype)
    if k > 8:
        pos = at + np.arange(k)
        keep = np.ones(out.size, dtype=bool)
        keep[pos] = False
        out[keep] = values
        out[pos] = new
        return out
    prev = 0
    for j, (e, x) in enumerate(zip(at.tolist(), new.tolist(), strict=True)):
        out[prev + j: e + j] = values[prev:e]
        out[e + j] = x
        prev = e
    out[prev + k:] = values[prev:]
    return out


def wanted_pairs(pages: np.ndarray, want: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct (layer, page) pairs with ``want[layer, j]`` for page ``pages[j]`` (1-D int64;
    a repeated page wants the union of its columns), sorted by layer then page: what
    ``np.divmod(np.unique(layer * P + page), P)`` of the repeated and tiled pairs gives, with no
    pair materialized before the one ``nonzero``."""
    order = np.argsort(pages, kind="stable")
    s, w = pages[order], want[:, order]
    first = run_firsts(s)
    if not first.all():
        starts = np.flatnonzero(first)
        s, w = s[starts], np.logical_or.reduceat(w, starts, axis=1)
    layers, j = np.nonzero(w)
    return layers.astype(np.int64, copy=False), s[j]
