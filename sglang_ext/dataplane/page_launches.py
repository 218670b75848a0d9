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
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from sglang_ext.dataplane.page_launch import PageLaunch


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

    def __len__(self) -> int:
        return int(self.layer.size)

    @property
    def layer_pages(self) -> int:
        """Layer-pages the launches fetch."""
        return int(self.segments.sum()) // 2

    @property
    def start_segments(self) -> int:
        """Segments the step-start launches (trigger -1) copy."""
        return int(self.segments[self.trigger < 0].sum())

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
        list's length and its widest request's pages. Both zeroed by the caller. What
        :class:`~sglang_ext.dataplane.graph_staging.GraphStaging` loads, as a loop over
        :meth:`launches` would fill them (a test compares the two)."""
        if not len(self):
            return
        layers, cap = lists.shape[1], lists.shape[2]
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
        lists.reshape(-1)[slot[g] * cap + within[g] + k] = reqs[self.first[g] + k]
        flat = listed.reshape(-1, 2)
        flat[:, 0] = count
        np.maximum.at(flat[:, 1], slot, self.max_pages)
