"""RadixDriver: :class:`CoreDriver` with SGLang's radix cache modelled (contributed by an
independent review of the served path, session 41).

The plain driver frees a finished request's pages at once. SGLang's radix tree keeps a finished
request's full pages cached instead: pages with no live user whose K/V must survive, which a
later request may start on (a prefix hit), which a later prefill's first page may be deduped
onto, and which an eviction finally frees.
"""

from __future__ import annotations

import torch

from tests.dataplane.core_driver import CoreDriver


class RadixDriver(CoreDriver):
    """The driver plus cached prefixes: slot lists of full pages that outlive their requests."""

    def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
        super().__init__(*args, **kwargs)
        self.cached: list[list[int]] = []
        self.counts = {"cached": 0, "hits": 0, "dedupes": 0, "evicted_pages": 0}

    def _refs(self, page: int) -> int:
        return super()._refs(page) + sum(1 for c in self.cached if page in {x // self.ps for x in c})

    def finish_cached(self, rid: str) -> None:
        """The request ends and its full pages stay in the tree (the partial last page is freed)."""
        if rid not in self.slots:
            return
        slots = self.slots[rid]
        full = len(slots) // self.ps * self.ps
        if full:
            self.cached.append(list(slots[:full]))
            self.counts["cached"] += 1
        self.finish(rid)

    def add_cached(self, rid: str, index: int, pages: int) -> None:
        """A new request starting on the first ``pages`` pages of cached prefix ``index`` (none
        cached: an empty start)."""
        prefix: list[int] = []
        if self.cached:
            c = self.cached[index % len(self.cached)]
            prefix = c[: min(pages, len(c) // self.ps) * self.ps]
            self.counts["hits"] += bool(prefix)
        self.slots[rid] = list(prefix)

    def dedupe_cached(self, rid: str, index: int) -> bool:
        """``rid``'s first page rewritten onto cached prefix ``index``'s (SGLang's dedupe of a
        prefill against the tree); its own copy freed when nobody else holds it."""
        if not self.cached or not self._rewrite_first_page(rid, self.cached[index % len(self.cached)]):
            return False
        self.counts["dedupes"] += 1
        return True

    def evict(self, index: int) -> None:
        """Cached prefix ``index`` leaves the tree: its pages nobody else holds are freed."""
        if not self.cached:
            return
        c = self.cached.pop(index % len(self.cached))
        pages = sorted({s // self.ps for s in c if self._refs(s // self.ps) == 0})
        self.core.page_freed(pages)
        self.free_pages.extend(pages)
        self.counts["evicted_pages"] += len(pages)
        for s in c:
            if self._refs(s // self.ps) == 0:
                for layer in range(self.core.layers):
                    self.shadow.pop((layer, s), None)

    def check_cached(self) -> None:
        """Every cached page's K and V at every layer read back bit-exact (no live user holds
        them: only the tree)."""
        for c in self.cached:
            for layer in range(self.core.layers):
                k, v = self.core.read_kv(layer, torch.tensor(c))
                want = [self.shadow[(layer, s)] for s in c]
                assert torch.equal(k.cpu(), torch.stack([w[0] for w in want])), ("cached K", layer)
                assert torch.equal(v.cpu(), torch.stack([w[1] for w in want])), ("cached V", layer)
