"""Freed pages leave the requests that still hold them (:meth:`SlotResidency.page_freed`).

Freed pages are applied after the releases recorded with them (:class:`EndedRequests`), so a
holder is usually a live request sharing a prefix page, or nobody (then the per-page user counts
say so at once). A holder that keeps other pages leaves the counts for the cut pages only.
"""

from __future__ import annotations

import numpy as np
import torch

from sglang_ext.dataplane.tracked_request import TrackedRequest
from sglang_ext.dataplane.want_counts import WantCounts


def cut_freed_pages(requests: dict[str, TrackedRequest], counts: WantCounts, freed: np.ndarray) -> list[str]:
    """Remove ``freed`` (int64 pages) from every request of ``requests`` holding one, keeping
    ``counts`` exact; a request left without pages is dropped from ``requests``. Returns the
    requests cut (SGLang rewrote their rows: the pages they hold now are not all known here).

    The holders are found in one vectorised pass over the live requests' pages (a membership
    test of their concatenation, then one reduction per request): a prefill's duplicate frees
    (SGLang frees a new request's copy of a prefix the tree already holds, e.g. the first
    token shared by every prompt) hit most requests of the batch, and a per-request scan in
    Python cost ~100 us per request between forwards (issue 13)."""
    if not int(counts.users[freed].sum()):  # nobody holds any of them (the usual case)
        return []
    rids = [rid for rid, req in requests.items() if req.pages.numel()]
    if not rids:
        return []
    arrays = [requests[rid].pages.numpy() for rid in rids]
    joined = np.concatenate(arrays)
    hit = counts.members(joined, freed)
    sizes = np.fromiter(map(len, arrays), dtype=np.int64, count=len(arrays))
    starts = np.cumsum(sizes) - sizes
    cut = np.add.reduceat(hit, starts, dtype=np.int64)  # no empty segment: every request has pages
    held = np.flatnonzero(cut).tolist()
    # every holder's kept and cut pages in two gathers and two splits, not two per holder
    # (a prefill's duplicate frees hit most requests of the batch)
    kept_sizes = sizes - cut
    kept = np.split(joined[~hit], np.cumsum(kept_sizes)[:-1])
    gone = np.split(joined[hit], np.cumsum(cut)[:-1])
    leaving: list[tuple[TrackedRequest, np.ndarray]] = []
    cut_rids = [rids[i] for i in held]
    for i in held:
        rid = rids[i]
        req = requests[rid]
        if not kept_sizes[i]:
            counts.track(req, -1)
            del requests[rid]  # holds no KV any more: finished or aborted
        elif req.uncached:  # the prefix's wants shift with it: leave and rejoin
            counts.track(req, -1)
            req.pages = torch.from_numpy(kept[i])
            counts.track(req, 1)
        else:
            leaving.append((req, gone[i]))
            req.pages = torch.from_numpy(kept[i])
    counts.track_removed_many(leaving)
    return cut_rids
