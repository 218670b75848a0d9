"""FetchRunCache: the copy engines' plan of a step's fetch, reused at the step's other layers.

Under ``--kv-copy-engine dma`` a fetch is planned on the host: its segments listed
(:meth:`PageFetch.indices`) and cut into 2-D copies (:func:`kernels.pitched_memcpy.plan_runs`).
At the check's batch-32 half-offloaded step that is 16 launches of ~20K segments each, ~2.5 ms of
NumPy per step on the CPU host (``benchmarks/results/core/dma-runs/``). Most of it repeats: in
one step, the fetches of the same requests read the same page lists into the same staging pages
(a request's staging slot serves every layer, OrbitFlow §3.3.1), and where the same pages are
host-only at both layers -- a layer-granular placement: every page of a request at a layer, or
none -- layer ``l``'s copy is layer ``l0``'s with every host row ``2 (l - l0)`` further on
(block-first host pool: K of page ``p`` at layer ``l`` is row ``(p L + l) 2``, V the next), the
device rows unchanged. The runs shift with it; their steps and lengths do not.

So per fetch only the layer's host-only mask over the requests' pages is worked out (one gather
of the map row); when it equals the last planned fetch's of the same requests, that plan is
reused, shifted. Not even that where the fetch copies every page of its requests: the tables
count its segments (``PageFetch.segments``) from the host bits the map holds, so a count of
all of them says the mask is all host-only; such a fetch takes the plan of a planned one that
was whole too, whose mask agreed with the count when it was planned. "Every page" means every
page its columns fetch: a column reading a shared page another column fetches
(:mod:`~sglang_ext.dataplane.staging_columns`) copies nothing and counts for nothing.

What makes an entry right is that the step tables' host arrays its key names
(page lists, staging, starts, counts) are never written in place -- each step's tables make new
ones where anything changes -- and that the entry keeps them alive, so no other array takes
their ``id``; the map row is read again at every fetch. :meth:`clear`, at the engine's step
start (``wait_fence``), bounds the entries to one step's (the last step's arrays go with them).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import structlog

from kernels.pitched_memcpy import RunGroup
from sglang_ext.dataplane.page_fetch import PageFetch

log = structlog.get_logger(__name__)

Plan = tuple[list[RunGroup], np.ndarray, np.ndarray]
"""``(groups, rest_src, rest_dst)``, as :func:`kernels.pitched_memcpy.plan_runs` returns it."""


@dataclass
class _Entry:
    arrays: tuple[np.ndarray, ...]
    """The step's page lists, staging, starts and counts the key names (kept alive)."""
    cols: np.ndarray
    pages: np.ndarray
    owned: np.ndarray
    """Which columns fetch their page (False: a reader of a page another column fetches,
    :mod:`~sglang_ext.dataplane.staging_columns`)."""
    owned_count: int
    keep: np.ndarray | None = None
    """The host-only mask of the planned fetch (None: none planned yet)."""
    whole: bool = False
    """The planned fetch copies every page of its requests, by the tables' count and its mask alike."""
    layer: int = -1
    plan: Plan | None = None


class FetchRunCache:
    """Plans of one step's fetches by their requests (module docstring)."""

    def __init__(self) -> None:
        self._entries: dict[tuple, _Entry] = {}
        self.planned = 0
        """Fetches planned from their segments since construction."""
        self.reused = 0
        """Fetches that took another layer's plan, shifted."""
        self.reused_whole = 0
        """Of :attr:`reused`, those taken without reading the map: whole fetches (below)."""
        self.disagreed = 0
        """Fetches whose tables counted every page host-only while the map said otherwise (never
        trusted then; 0 unless the tables and the map disagree)."""

    def clear(self) -> None:
        """A new step: its fetches read other page lists (or the same, rewritten)."""
        self._entries.clear()

    def plan(self, spec: PageFetch, plan_runs: Callable[[np.ndarray, np.ndarray], Plan]) -> Plan:
        """``spec``'s copy planned: ``plan_runs(src, dst)`` of its segments, or the plan of an
        earlier fetch of this step with the same requests and host-only pages, shifted to
        ``spec``'s layer."""
        reqs, flat, stage, starts, counts, _ = spec.host_arrays
        key = (id(flat), id(stage), id(starts), id(counts), reqs.tobytes())
        entry = self._entries.get(key)
        if entry is None:
            cols, pages = spec.columns()
            owned = np.asarray(stage)[cols] >= 0
            entry = self._entries[key] = _Entry((flat, stage, starts, counts), cols, pages, owned,
                                                int(np.count_nonzero(owned)))
        # the tables count a fetch's segments from the same host bits the map holds (exact: what
        # the kernel copies); all of its requests' pages host-only is a layer-granular placement's
        # usual fetch, and its mask needs no gather once a planned one agreed with the map
        whole = spec.segments == 2 * entry.owned_count  # every page it fetches (readers fetch none)
        if whole and entry.whole:
            self.reused += 1
            self.reused_whole += 1
            return shifted(entry.plan, 2 * (spec.layer - entry.layer))  # type: ignore[arg-type]
        keep = spec.host_only(entry.pages)
        if entry.plan is not None and same_pages(keep, entry.keep):
            self.reused += 1
            return shifted(entry.plan, 2 * (spec.layer - entry.layer))
        plan = plan_runs(*spec.segment_lists(entry.cols, entry.pages, keep))
        agree = bool(keep[entry.owned].all()) if whole else True
        if not agree:  # the copy is right (planned from the map); the tables' count is not
            self.disagreed += 1
            if self.disagreed & (self.disagreed - 1) == 0:  # 1, 2, 4, ...: a bug report, not a flood
                log.warning("kv_fetch_count_disagrees_with_map", layer=spec.layer, segments=spec.segments,
                            host_only=int(keep.sum()), pages=int(keep.size), times=self.disagreed)
        entry.keep, entry.whole, entry.layer, entry.plan = keep, whole and agree, spec.layer, plan
        self.planned += 1
        return plan


def same_pages(keep: np.ndarray, planned: np.ndarray | None) -> bool:
    """The host-only masks of two fetches of the same requests' pages agree."""
    return planned is not None and np.array_equal(keep, planned)


def shifted(plan: Plan, rows: int) -> Plan:
    """``plan`` with every source row ``rows`` further on (runs and single pairs alike)."""
    groups, rest_s, rest_d = plan
    if not rows:
        return plan
    return [(s0 + rows, d0, n, s_step, d_step) for s0, d0, n, s_step, d_step in groups], rest_s + rows, rest_d
