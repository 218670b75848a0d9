"""PageLaunches: a paged step's fetch launches as arrays, one entry per launch.

A placed decode step of Llama-3-8B's batch fetches in ~35 launches (one per layer and trigger
with host pages). Built as :class:`~sglang_ext.dataplane.page_launch.PageLaunch` objects, they
cost the boundary ~35 object constructions and then a Python loop at each reader: the pipeline's
grouping by trigger, its byte counts, and a graph admission's regrouping into fetch lists (session
70's line profile of the staged boundary: ~0.2 ms of the hidden step's ~0.8 ms of Python on the
2-core host). A step replayed in a CUDA graph never issues them one by one, so they stay arrays
here: the counts are sums, the graph's lists one vectorised scatter (:meth:`regroup`), and the
objects are made only for a step that runs eagerly (:meth:`launches`, in the same order).

Entry ``g`` is the launch of ``PageLaunch(trigger[g], layer[g], offset[g], segments[g], first[g],
n_reqs[g], max_pages[g])``; entries are in layer order, then trigger (-1 first), as the tables
emit them.

A placed steady step's tables advance with the same (layer, trigger) groups of the same requests:
only the sizes change (:meth:`resized`). The launches then share :attr:`PageLaunches.memo`, and
a graph admission's regrouping is one scatter of remembered ids plus the widest pages per list
(session 74: the regroup was ~50 us of the hidden step's ~0.9 ms on the 2-core host).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from sglang_ext.dataplane.page_launch import PageLaunch
from sglang_ext.dataplane.sorted_ids import run_bounds


def _empty() -> np.ndarray:
    return np.zeros(0, dtype=np.int64)


@dataclass(frozen=True)
class PageLaunches:
    """A step's fetch launches, a field per :class:`PageLaunch` field (module docstring)."""

    trigger: np.ndarray = field(default_factory=_empty)
    """Layer after which each launch is issued (-1: at step start)."""
    layer: np.ndarray = field(default_factory=_empty)
    """Layer whose pages each launch fetches."""
    offset: np.ndarray = field(default_factory=_empty)
    """Where each launch's request ids start in the step's int32 upload."""
    segments: np.ndarray = field(default_factory=_empty)
    """Segments each launch copies (2 per layer-page: K and V)."""
    first: np.ndarray = field(default_factory=_empty)
    """Position of each launch's first request id among the step's fetch request ids."""
    n_reqs: np.ndarray = field(default_factory=_empty)
    """Requests of each launch."""
    max_pages: np.ndarray = field(default_factory=_empty)
    """Most pages of one of each launch's requests."""
    memo: dict = field(default_factory=dict, compare=False, repr=False)
    """What depends on the launches' groups alone (not their sizes): shared by :meth:`resized`
    launches, filled at first use."""

    def __len__(self) -> int:
        return int(self.layer.size)

    @property
    def layer_pages(self) -> int:
        """Layer-pages the launches fetch."""
        return int(self.segments.sum()) // 2

    @property
    def start_segments(self) -> int:
        """Segments the step-start launches (trigger -1) copy."""
        start = self.memo.get("start")
        if start is None:
            start = self.memo["start"] = np.flatnonzero(self.trigger < 0)
        return int(self.segments[start].sum())

    def resized(self, segments: np.ndarray, max_pages: np.ndarray, offset_shift: int) -> PageLaunches:
        """These launches (the same groups of the same requests, in the same order) with new
        sizes, their request ids moved by ``offset_shift`` in the upload; the memo shared."""
        if segments.size != self.layer.size or max_pages.size != self.layer.size:
            raise ValueError(f"PageLaunches.resized: {segments.size} sizes and {max_pages.size} widths for "
                             f"{self.layer.size} launches")
        return PageLaunches(trigger=self.trigger, layer=self.layer, offset=self.offset + offset_shift,
                            segments=segments, first=self.first, n_reqs=self.n_reqs, max_pages=max_pages,
                            memo=self.memo)

    def launches(self) -> list[PageLaunch]:
        """The launches as objects, in order (for a step that issues them one by one)."""
        cols = zip(self.trigger.tolist(), self.layer.tolist(), self.offset.tolist(), self.segments.tolist(),
                   self.first.tolist(), self.n_reqs.tolist(), self.max_pages.tolist(), strict=True)
        return [PageLaunch(*c) for c in cols]

    def regroup(self, reqs: np.ndarray, lists: np.ndarray, listed: np.ndarray) -> None:
        """The launches' request ids (``reqs``: every launch's, concatenated; launch ``g``'s at
        ``reqs[first[g]:][:n_reqs[g]]``) into per-layer fetch lists: ``lists [2, L, cap]`` row 0
        the step-start launches' requests of each layer, row 1 the triggered ones' (several
        triggers of a layer one after the other, in launch order), ``listed [2, L, 2]`` each
        list's length and its widest request's pages (zeroed by the caller; ``lists`` need not be: a
        reader takes each list's first ``count`` entries). What
        :class:`~sglang_ext.dataplane.graph_staging.GraphStaging` loads, as a loop over
        :meth:`launches` would fill them (a test compares the two)."""
        if not len(self):
            return
        layers, cap = lists.shape[1], lists.shape[2]
        key = ("regroup", layers, cap)
        plan = self.memo.get(key)
        if plan is None or plan[0] is not reqs:
            plan = self.memo[key] = (reqs, *self._regroup_plan(reqs, layers, cap))
        _, dst, ids, count, order, runs, slots = plan
        lists.reshape(-1)[dst] = ids
        flat = listed.reshape(-1, 2)
        flat[:, 0] = count
        flat[slots, 1] = np.maximum.reduceat(self.max_pages[order], runs)

    def _regroup_plan(self, reqs: np.ndarray, layers: int, cap: int) -> tuple[np.ndarray, ...]:
        """:meth:`regroup`'s part that the sizes do not change: where each launch's ids go in
        ``lists`` and which ids, each list's length, and the launches ordered by list (``order``,
        ``runs``: each list's first among them, ``slots``: its row of ``listed``)."""
        slot = (self.trigger >= 0) * layers + self.layer  # row of lists.reshape(2 L, cap)
        n = self.n_reqs
        cum = np.cumsum(n) - n  # each launch's first place among all the launches' ids
        new_run = np.ones(slot.size, dtype=bool)
        np.not_equal(slot[1:], slot[:-1], out=new_run[1:])  # a (kind, layer)'s launches are adjacent
        within = cum - np.maximum.accumulate(np.where(new_run, cum, 0))
        count = np.bincount(slot, weights=n, minlength=2 * layers).astype(np.int64)
        if int(count.max()) > cap:
            raise ValueError(f"PageLaunches.regroup: a fetch list of {int(count.max())} requests; lists hold {cap}")
        g = np.repeat(np.arange(slot.size), n)
        k = np.arange(int(n.sum())) - cum[g]  # each id's place inside its launch
        order = np.argsort(slot, kind="stable")
        runs = run_bounds(slot[order])[0]
        return slot[g] * cap + within[g] + k, reqs[self.first[g] + k], count, order, runs, slot[order][runs]
