"""missing_pairs: the (layer, page) pairs a residency pass must place for pages appended to requests.

:meth:`SlotResidency._reconcile_appended <sglang_ext.dataplane.slot_residency.SlotResidency>`'s
placement of a decode step's new pages: every request's appended pages with the layers it wants,
less what the map already places. A decode step appends a page to the few requests whose new
token opens one; NumPy's per-call overhead (2-5 us on the 2-core host) then outweighs the work,
so a few distinct pages take a short path with a fraction of the calls.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from sglang_ext.dataplane.sorted_ids import wanted_pairs

FEW = 8
"""Up to this many appended pages (distinct), :func:`missing_pairs` builds one ``[L, n]`` mask."""


def missing_pairs(map_np: np.ndarray, cols: Sequence[np.ndarray],
                  masks: Sequence[np.ndarray | None]) -> tuple[np.ndarray, np.ndarray]:
    """The distinct (layer, page) pairs the appended pages want and ``map_np`` (``[L, P]``, -1 where
    host-only) does not place: ``cols[i]`` (int64) wants the layers of ``masks[i]`` (bool ``[L]``;
    None: every layer). Sorted by layer, then page (what :func:`wanted_pairs` of every wanted pair,
    then the map's filter, gives). A few distinct pages: the sorted pages' ``[L, n]`` mask, each
    column cut to its request's layers, one ``nonzero``; no sort of the pairs."""
    few = sum(int(col.size) for col in cols) <= FEW  # sized first: a new request's thousands stay NumPy
    listed = [(page, i) for i, col in enumerate(cols) for page in col.tolist()] if few else []
    if listed and len({page for page, _ in listed}) == len(listed):
        listed.sort()
        pages = np.array([page for page, _ in listed], dtype=np.int64)
        want = np.take(map_np, pages, axis=1) < 0
        for j, (_, i) in enumerate(listed):
            mask = masks[i]
            if mask is not None:
                want[:, j] &= mask
        layers, j = np.nonzero(want)
        return layers.astype(np.int64, copy=False), pages[j]
    layer_count = map_np.shape[0]
    wants = [np.ones((layer_count, c.size), dtype=bool) if m is None else np.repeat(m[:, None], c.size, axis=1)
             for c, m in zip(cols, masks, strict=True)]
    layers, pages = wanted_pairs(np.concatenate(cols), np.concatenate(wants, axis=1))
    missing = map_np[layers, pages] < 0
    return layers[missing], pages[missing]
