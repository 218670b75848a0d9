"""missing_pairs: the (layer, page) pairs appended pages want and the map does not place, sorted by
layer then page, equal to a pure-Python reference on random maps and appends -- a decode step's few
distinct pages (the short path), repeats and many pages (the general one) -- with each request's
wanted layers applied to its own pages only."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_ext.dataplane.appended_pairs import FEW, missing_pairs

LAYERS, PAGES = 5, 30


def _reference(map_np: np.ndarray, cols: list[np.ndarray], masks: list[np.ndarray | None]) -> list[tuple[int, int]]:
    pairs = {(layer, int(page)) for col, mask in zip(cols, masks, strict=True) for page in col
             for layer in range(LAYERS) if (mask is None or mask[layer]) and map_np[layer, page] < 0}
    return sorted(pairs)


def _pairs(got: tuple[np.ndarray, np.ndarray]) -> list[tuple[int, int]]:
    layers, pages = got
    assert layers.dtype == np.int64 and pages.dtype == np.int64
    return list(zip(layers.tolist(), pages.tolist(), strict=True))


requests = st.lists(st.tuples(st.lists(st.integers(0, PAGES - 1), min_size=1, max_size=12),
                              st.one_of(st.none(), st.lists(st.booleans(), min_size=LAYERS, max_size=LAYERS))),
                    min_size=1, max_size=10)


@settings(max_examples=300, deadline=None)
@given(requests, st.lists(st.booleans(), min_size=LAYERS * PAGES, max_size=LAYERS * PAGES))
def test_missing_pairs_equal_the_reference(parts, placed: list[bool]) -> None:
    map_np = np.where(np.asarray(placed).reshape(LAYERS, PAGES), 7, -1).astype(np.int32)
    cols = [np.asarray(pages, dtype=np.int64) for pages, _ in parts]
    masks = [None if m is None else np.asarray(m, dtype=bool) for _, m in parts]
    assert _pairs(missing_pairs(map_np, cols, masks)) == _reference(map_np, cols, masks)


def test_a_decode_steps_pages_take_the_short_path_and_keep_each_requests_layers() -> None:
    """Two opened pages of two requests (one wanting layers 0 and 3, one every layer), a third
    request's page already placed at layer 2: the short path's answer is the reference's.
    Negative control: the same pages with one mask for all (the first request's layers applied
    to every page) give other pairs, so the comparison sees a mask applied to the wrong page."""
    map_np = np.full((LAYERS, PAGES), -1, dtype=np.int32)
    map_np[2, 9] = 4
    cols = [np.array([12]), np.array([3]), np.array([9])]
    masks = [np.array([True, False, False, True, False]), None, None]
    assert sum(c.size for c in cols) <= FEW
    got = _pairs(missing_pairs(map_np, cols, masks))
    assert got == _reference(map_np, cols, masks)
    assert got[:3] == [(0, 3), (0, 9), (0, 12)] and (1, 12) not in got and (2, 9) not in got
    wrong = [masks[0]] * 3
    assert _reference(map_np, cols, wrong) != got
