"""PagedDecodeStep: the paged layout's steady decode boundary of a :class:`LayeredKVCore`.

A decode step in the paged layout -- every offloading server's -- whose requests each continue
what they held at their last boundary (one token more; the batch itself may have changed: a
request finished or joined, :class:`~sglang_ext.dataplane.decode_continuity.DecodeContinuity`)
starts from those page lists: a page is appended where a new token opens one, only those
requests are observed, the map reconciled (in one pass where the opened pages are fresh:
:class:`~sglang_ext.dataplane.opened_pages.OpenedPages`); then a step of the last step's batch runs on the last
step's tables advanced by one token (:meth:`PagedDecodeStep.advance`: resident or placed, when
the map moved only in the opened pages' columns), any other builds its tables
(:meth:`LayeredKVCore._begin`) without reading a request's slots. The state it reads and keeps is
the core's (``_paged_last``, ``_paged_tables``, ``continuity``, the counters): it is the core's
logic, split out by role.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from sglang_ext.dataplane.opened_pages import OpenedPages
from sglang_ext.dataplane.slot_results import ResidencyDelta

if TYPE_CHECKING:
    from sglang_ext.dataplane.layered_kv_core import LayeredKVCore


class PagedDecodeStep:
    """:meth:`LayeredKVCore.prepare_decode_step` in the paged layout (module docstring)."""

    def __init__(self, core: LayeredKVCore) -> None:
        self.core = core
        self.openings = OpenedPages(core.residency)
        """The opened pages' one-pass observe and reconcile."""

    def prepare(self, rids: Sequence[str], seq_lens: Sequence[int] | np.ndarray, new_slots: torch.Tensor) -> bool:
        """:meth:`LayeredKVCore.prepare_decode_step` in the paged layout: a decode step each of
        whose requests continues what it held at its last boundary (:class:`DecodeContinuity`).
        Its page lists are those, plus a page for each request whose new token opens one
        (``new_slots[i] // page_size``); only those requests are observed (the others' pages did
        not change), then the boundary is the general one (reconcile, :class:`PagedStepTables`,
        pipeline) -- or, the batch being the last step's, the last tables advanced. O(batch)
        host work plus the tables'; False (nothing done) when it does not apply."""
        core = self.core
        if new_slots.numel() != len(rids) or core.residency.has_anonymous:
            return False
        lens = [int(n) for n in seq_lens]
        # the allocation hook's host list of the new slots; else (on a GPU) read back here, the
        # boundary's one sync (the general path reads every request's slots); never inside a layer
        slots = core.continuity.slots.read(rids, lens, new_slots)
        cont = core.continuity.continued(rids, lens, slots, lists=True)
        if cont is None:
            return False  # a request new, rewritten or not continued: the general path decides
        opens, page_lists = cont
        assert page_lists is not None
        kept = core._paged_last is not None  # the last step's tables were not given up since
        try:
            return self._prepare(rids, lens, slots, new_slots, opens, page_lists, kept)
        except BaseException:
            # a boundary that raised (a copy launch, an upload) installed no tables: the last
            # step's must not advance at the next one, a token behind -- they wrote its new token
            # into this step's row (fault fuzz, session 77); the next step builds
            core._paged_tables = None
            raise

    def _prepare(self, rids: Sequence[str], lens: list[int], slots: Any, new_slots: torch.Tensor,
                 opens: list[int], page_lists: list[np.ndarray], kept: bool) -> bool:
        """:meth:`prepare` from the boundary on (the step continued: ``opens``, ``page_lists``)."""
        core, ps = self.core, self.core.page_size
        core._boundary(new_slots)
        core._paged_last = (list(rids), lens, page_lists)
        # the last step's batch (the continuity's last batch is the one _paged_last held): its tables may advance
        same = not core.continuity.advanced(rids, lens, slots, page_lists) and kept
        core.decode_delta = self.reconcile_opened([rids[i] for i in opens], [page_lists[i] for i in opens])
        new_np = np.asarray(slots, dtype=np.int64)
        opened = new_np[opens] // ps
        unmoved = same and self.map_unmoved(opened)
        resident = self.still_resident(opened, unmoved)
        if (resident or unmoved) and self.advance(
                np.asarray(opens, dtype=np.int64), opened, lens, resident):
            core.paged_decode_steps += 1
            return True
        core.resident_builds += resident
        core._begin(page_lists, np.asarray(lens, dtype=np.int64), np.ones(len(lens), dtype=np.int64), new_np,
                    set(rids), None, None, resident=resident)
        core.paged_decode_steps += 1
        return True

    def reconcile_opened(self, rids: list[str], lists: list[np.ndarray]) -> ResidencyDelta:
        """The opened pages' requests ``rids`` hold ``lists`` now: observed and reconciled in one
        pass (:class:`OpenedPages`, which reports its moves), else each observed and the core's
        reconciliation run."""
        core = self.core
        delta = self.openings.reconcile(rids, lists, core._on_moves)
        if delta is not None:
            return delta
        for rid, pages in zip(rids, lists, strict=True):
            core.residency.observe(rid, torch.from_numpy(pages))
        return core._reconcile()

    def advance(self, opens: np.ndarray, opened: np.ndarray, lens: list[int], resident: bool) -> bool:
        """A paged steady step, the map unmoved since the last tables but for the ``opened`` pages
        of rows ``opens`` (checked by the caller), runs on those tables advanced by one token:
        resident (:meth:`still_resident`), ``advanced`` (no page opened: two device ops) or
        ``advanced_opening``; else ``advanced_staged`` (the same staging pages). False otherwise."""
        core = self.core
        last = core._paged_tables
        if last is None or core.token_tables:
            return False
        seq = np.asarray(lens, dtype=np.int64)
        defer = core.defer_tables
        if not resident:
            tables = last.advanced_staged(opens, opened, seq, core.room, defer)
        else:
            tables = last.advanced_opening(opens, opened, seq, defer) if opens.size else last.advanced(defer)
        if tables is None:
            return False
        core.overflow = False
        core.store.mark_dirty(tables.dirty_ids)
        if opens.size:  # the opened pages hold KV from this step on (the others already did)
            core.store.has_kv_np[tables.new_pages] = True
        core.store.staging_pages = int(tables.staging_ids.size)
        core.tables = core._paged_tables = tables
        core.pipeline.begin_step(tables)
        core.advanced_decode_steps += resident and not opens.size
        core.opened_advances += resident and bool(opens.size)
        core.staged_advances += not resident
        return True

    def map_unmoved(self, opened: np.ndarray) -> bool:
        """The map changed since the last step's tables in the ``opened`` pages' columns only
        (a paged steady step's tables may then advance)."""
        core = self.core
        last, mirror = core._paged_tables, core.store.mirror
        return (last is not None and mirror is not None and mirror.syncs == last._mirror_syncs
                and mirror.pending_within(opened))

    def still_resident(self, opened: np.ndarray, unmoved: bool) -> bool:
        """``unmoved`` (:meth:`map_unmoved` of ``opened``), and the step's batch (the last one's
        plus the ``opened`` pages) has no page host-only at any layer, known without reading its
        host bits: the last step's tables staged nothing and the opened pages are resident at
        every layer."""
        core = self.core
        return (unmoved and core._paged_tables.staging_ids.size == 0  # type: ignore[union-attr]
                and bool((np.take(core.store.map_np, opened, axis=1) >= 0).all()))
