"""EndedRequests: requests released and pages freed while SGLang processes a step's results,
applied to the residency in one batch by the next reader.

When requests finish, SGLang frees the pages the prefix cache does not keep, then releases each
request -- one request at a time, between two forwards, and nothing reads residency until the
next boundary (the plan install, the next step's preparation, the step report). Done one
request at a time, each release and each free is a dozen NumPy calls (5-10 us each between
forwards on the 2-core host): ~0.25 ms per finished request (issue 13). Here they are recorded
(a list append) and applied together at :meth:`SlotResidency.settle`, which every reader of
residency calls first, after the decode journal (whose steps came before them):

1. the released requests leave the counts in one pass per distinct want
   (:meth:`WantCounts.track_many`); their pages may now be orphans (cached by the tree);
2. the freed pages -- distinct, ascending -- are cut from whoever still holds them (a live
   request sharing them; usually nobody once the releases are done), their device copies
   released in one call, their KV flags cleared. They may stay orphan candidates
   (``SlotResidency.maybe_orphan``, a superset): with no device copy left, the orphan scan
   (:meth:`LivePages._orphans`) filters them out, so removing them here would only cost time.

The final state is the one of applying each call when it came: a page is freed only when no
ended request will need it, and a release's count changes commute with a free's cut (the cut
removes from live holders what the release would have removed from the released one).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from sglang_ext.dataplane.freed_pages import cut_freed_pages
from sglang_ext.dataplane.page_ids import in_pool
from sglang_ext.dataplane.sorted_ids import distinct_sorted

if TYPE_CHECKING:
    from sglang_ext.dataplane.slot_residency import SlotResidency


class EndedRequests:
    """Releases and frees not yet applied to a :class:`SlotResidency` (module docstring)."""

    def __init__(self, residency: SlotResidency) -> None:
        self.residency = residency
        self.released: list[str] = []
        """Request ids released, in order."""
        self.freed: list[int] = []
        """Pages freed, in order (repeats allowed)."""
        self.rewritten: set[str] = set()
        """Live requests a free cut pages from since :meth:`take_rewritten` (their rows were
        rewritten: :class:`~sglang_ext.dataplane.decode_continuity.DecodeContinuity`)."""
        self.applications = 0
        """Batches applied."""

    @property
    def pending(self) -> bool:
        return bool(self.released or self.freed)

    def release(self, rid: str) -> None:
        """Request ``rid`` ended (applied by :meth:`apply`)."""
        self.released.append(rid)

    def free(self, pages: Sequence[int]) -> None:
        """SGLang's allocator took ``pages`` back (applied by :meth:`apply`, which leaves out ids
        outside the pool)."""
        self.freed.extend(pages)

    def take_rewritten(self) -> set[str]:
        """The requests freed pages were cut from since the last call (applied frees only)."""
        cut, self.rewritten = self.rewritten, set()
        return cut

    def apply(self) -> None:
        """Apply the recorded releases, then the frees (module docstring)."""
        released, freed = self.released, self.freed
        self.released, self.freed = [], []
        if not released and not freed:
            return
        self.applications += 1
        res = self.residency
        requests = res.requests
        gone = [requests.pop(rid) for rid in dict.fromkeys(released) if rid in requests]
        if gone:
            res.changed = True
            for req in gone:
                res.maybe_orphan.update(req.pages.tolist())
            res.counts.track_many(gone, -1)
        if freed:
            res.changed = True
            pages = in_pool(distinct_sorted(np.fromiter(freed, dtype=np.int64, count=len(freed))),
                            res.store.map_np.shape[1], "a freed page")
            self.rewritten.update(cut_freed_pages(requests, res.counts, pages))  # first: the counts read the map
            res.store.release_pages(pages)
            res.has_kv_np[pages] = False
