"""PagedFetchPlan: a paged step's fetch launches -- built, regrouped, issued -- for :class:`PagedStepTables`.

Split out of :mod:`~sglang_ext.dataplane.paged_step_tables` by role (the tables' module docstring
defines the tables): which (layer, trigger) groups of requests fetch how many host pages
(:meth:`_fetch_launches`, :meth:`_emit_fetches`, as :class:`PageLaunches` arrays), their
:class:`PageLaunch` objects for an eager step (:attr:`fetches`), and one launch's issue on the
engine (:meth:`fetch`). A mixin: the attributes it reads are the tables'.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from sglang_ext.dataplane.map_mirror import MapMirror
from sglang_ext.dataplane.page_fetch import PageFetch
from sglang_ext.dataplane.page_launch import PageLaunch
from sglang_ext.dataplane.page_launches import PageLaunches
from sglang_ext.dataplane.sorted_ids import run_bounds
from sglang_ext.dataplane.step_tables import Launch
from sglang_ext.dataplane.transfer_engine import TransferEngine


class PagedFetchPlan:
    """The fetch launches of a :class:`~sglang_ext.dataplane.paged_step_tables.PagedStepTables` (module docstring)."""

    _store: Any
    _n: int
    _b: int
    i32: Any
    pages: np.ndarray
    page_launches: PageLaunches
    _fetch_list: list[Launch] | None
    _fetch_views: Any

    def _fetch_launches(self, mirror: MapMirror, flat: np.ndarray, counts: np.ndarray, starts: np.ndarray,
                        staged_req: np.ndarray, host_req: np.ndarray, trigger: np.ndarray, at: int,
                        readers: np.ndarray | None = None) -> np.ndarray:
        """One :class:`PageLaunch` per (layer, trigger), in layer then trigger order: the
        requests with host-only pages at that layer whose staging frees at that trigger. The
        launches' request ids, concatenated, are returned for the int32 upload, where they start
        at ``i32[at]`` (a launch's at ``i32[launch.offset]``); a launch's size comes from the
        host bits of its requests' first ``counts`` pages (exact: what the kernel copies). The
        kernel does not read ``has_kv``: a decode step's page opened this step is copied too, a
        multi-token step's new pages are not (its ``counts`` stop at the pages that held KV)."""
        staged = np.flatnonzero(staged_req)
        per_layer = np.zeros((host_req.shape[1], host_req.shape[0]), dtype=np.int64)  # [b, L] host pages
        sub = staged[counts[staged] > 0]
        if sub.size:
            sub_counts = counts[sub]
            sub_starts = np.cumsum(sub_counts) - sub_counts  # each staged request's first place in cols
            cols = np.arange(int(sub_counts.sum())) + np.repeat(starts[sub] - sub_starts, sub_counts)
            bits = np.unpackbits(mirror.host_bits[flat[cols]], axis=1, count=mirror.layers, bitorder="little")
            if readers is not None:  # a shared page is fetched by its owner column only
                owns = np.ones(flat.size, dtype=bool)
                owns[readers] = False
                bits *= owns[cols][:, None]
            per_layer[sub] = np.add.reduceat(bits, sub_starts, axis=0, dtype=np.int32)
        pair_l, pair_r = np.nonzero(host_req)
        key = pair_l * (host_req.shape[0] + 1) + (trigger[pair_l, pair_r] + 1)
        order = np.argsort(key, kind="stable")  # requests stay ascending inside a (layer, trigger)
        pair_l, pair_r, key = pair_l[order], pair_r[order], key[order]
        a = run_bounds(key)[0] if key.size else np.zeros(0, dtype=np.int64)
        # per (layer, trigger) group, all groups at once: its first pair, pages, trigger
        pages = np.add.reduceat(per_layer[pair_r, pair_l], a) if key.size else a
        self._groups = (a, trigger[pair_l[a], pair_r[a]], pair_l)
        self._emit_fetches(pages, counts, pair_r, at)
        self._reqs_np = pair_r
        return pair_r

    def _emit_fetches(self, pages: np.ndarray, counts: np.ndarray, reqs: np.ndarray, at: int,
                      like: PageLaunches | None = None) -> None:
        """:attr:`page_launches` from the (layer, trigger) groups of ``self._groups`` holding
        ``pages[g]`` host pages each (``reqs``: their request ids, concatenated, from ``i32[at]``);
        groups without pages launch nothing. ``like``: launches of these groups and ``reqs``
        (an advance's predecessor's); when each of its groups launched and still does, the new
        launches are its own resized (:meth:`PageLaunches.resized`: the regroup remembered)."""
        a, firsts, pair_l = self._groups
        self._group_pages, self._fetch_list = pages, None
        if not a.size:
            self.page_launches = PageLaunches()
            return
        widest = np.maximum.reduceat(counts[reqs], a)
        if like is not None and len(like) == a.size and pages.all():
            self.page_launches = like.resized(2 * pages, widest, at - int(like.offset[0] - like.first[0]))
            return
        g = np.flatnonzero(pages)
        ends = np.concatenate([a[1:], [reqs.size]])
        ga = a[g]
        self.page_launches = PageLaunches(
            trigger=firsts[g], layer=pair_l[ga], offset=ga + at, segments=2 * pages[g], first=ga,
            n_reqs=ends[g] - ga, max_pages=widest[g])

    @property
    def fetches(self) -> list[Launch]:  # type: ignore[override]
        """:attr:`page_launches` as objects, made at the first read (a replayed step never reads it)."""
        if self._fetch_list is None:
            self._fetch_list = self.page_launches.launches()
        return self._fetch_list

    @property
    def n_fetches(self) -> int:
        return len(self.page_launches)

    def fetch(self, engine: TransferEngine, launch: Launch, wait: tuple) -> Any:
        """Issue fetch ``launch`` (a :class:`PageLaunch`) as one :class:`PageFetch`."""
        assert isinstance(launch, PageLaunch)
        store, n, b = self._store, self._n, self._b
        i32, at = self.i32, launch.offset
        mirror = store.mirror
        assert mirror is not None
        if mirror.pending:  # the kernel reads the mirror as synced, the CPU path the map: they agree
            raise RuntimeError("the map changed inside a forward (between the tables and a fetch)")
        views = self._fetch_views
        if views is None:  # the step's page lists, staging, starts and counts: sliced once a step
            views = self._fetch_views = (i32[:n], i32[n: 2 * n], i32[2 * n: 2 * n + b], i32[2 * n + b: 2 * n + 2 * b])
        flat, stage, starts, counts = views
        spec = PageFetch(
            layer=launch.layer, layers=store.config.layers, dev_v=store.pages_total, max_pages=launch.max_pages,
            segments=launch.segments, reqs=i32[at: at + launch.n_reqs], flat=flat, stage=stage,
            starts=starts, counts=counts, map_row=mirror.rows[launch.layer],
            host_arrays=(self._reqs_np[launch.first: launch.first + launch.n_reqs], self.pages, self._stage_np,
                         self._starts_np, self._counts_np if self._fetch_counts_np is None else self._fetch_counts_np,
                         store.map_np[launch.layer]),
        )
        return engine.fetch_pages(spec, wait)
