"""Freed pages leave the requests that still hold them (:meth:`SlotResidency.page_freed`).

Freed pages are applied after the releases recorded with them (:class:`EndedRequests`), so a
holder is usually a live request sharing a prefix page, or nobody. The scan stops as soon as
every (request, page) pair the per-page user counts announce is found. A holder that keeps
other pages leaves the counts for the cut pages only.
"""

from __future__ import annotations

import numpy as np
import torch

from sglang_ext.dataplane.tracked_request import TrackedRequest
from sglang_ext.dataplane.want_counts import WantCounts


def cut_freed_pages(requests: dict[str, TrackedRequest], counts: WantCounts, freed: np.ndarray) -> None:
    """Remove ``freed`` (int64 pages) from every request of ``requests`` holding one, keeping
    ``counts`` exact; a request left without pages is dropped from ``requests``."""
    holders = int(counts.users[freed].sum())  # (request, page) pairs to cut
    if not holders:
        return
    gone = set(freed.tolist())
    for rid in list(requests):
        req = requests[rid]
        held = len(gone.intersection(req.pages.tolist())) if req.pages.numel() else 0
        if not held:
            continue
        pages = req.pages.numpy()
        keep = ~np.isin(pages, freed)
        if not keep.any():
            counts.track(req, -1)
            del requests[rid]  # holds no KV any more: finished or aborted
        elif req.uncached:  # the prefix's wants shift with it: leave and rejoin
            counts.track(req, -1)
            req.pages = req.pages[torch.from_numpy(keep)]
            counts.track(req, 1)
        else:
            counts.track_removed(req, pages[~keep])
            req.pages = req.pages[torch.from_numpy(keep)]
        holders -= held
        if holders <= 0:
            return
