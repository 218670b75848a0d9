"""The guards of a steady paged decode step's advance (:class:`PagedDecodeStep`).

A steady step advances the last step's tables only when the map moved since they were built in
the opened pages' columns alone (:meth:`PagedDecodeStep.map_unmoved`: no mirror sync since, and
the pending changes within the opened pages); a map that moved anywhere else -- even if the mirror
has synced it since -- builds the step.

A steady paged step that opens pages takes the resident opening advance
(:meth:`PagedStepTables.advanced_opening`: the opened pages' map columns spliced into the page
tables) only when :meth:`PagedDecodeStep.still_resident` holds: the last step staged nothing and
every opened page is resident at *every* layer. An opened page that a placement left short at a
layer (planned wants, a full pool) is host-only there: it needs a staging page and a fetch, which
only a staged build gives it.
"""

from __future__ import annotations

import numpy as np
import pytest

from sglang_ext.dataplane.paged_decode_step import PagedDecodeStep
from tests.dataplane.core_driver import CoreDriver, make_core


def test_an_opened_page_short_at_a_layer_is_staged_not_advanced_as_resident(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two resident requests decode; right after the boundary places the first page a step opens,
    layer 2 of that page is offloaded (what a placement that fell short leaves: the map moved in the
    opened page's column only). That step must stage the page at layer 2: its page table there names
    a staging page, never the map's -1, and every layer's reads stay exact
    (``CoreDriver.check_staging`` / ``check_at_rest``). Found by a mutation audit (session 87): with
    ``still_resident`` asking that *any* layer of the opened pages is resident instead of every one,
    the step advanced as resident and read device page -1 at layer 2; this test fails then."""
    core = make_core(6 + 7, page_size=4, pages=24)
    d = CoreDriver(core, seed=1, fast_decode=True, paged_reads=True)
    d.add("a")
    d.add("b")
    d.step([("a", 5), ("b", 3)])
    reconcile, forced = PagedDecodeStep.reconcile_opened, []

    def short(step: PagedDecodeStep, rids: list[str], lists: list[np.ndarray]):  # noqa: ANN202
        delta = reconcile(step, rids, lists)
        last = step.core._paged_tables
        if lists and not forced and last is not None and last.staging_ids.size == 0:
            page = int(lists[-1][-1])
            step.core.store.offload(np.array([2]), np.array([page]))  # layer 2 of the opened page short
            forced.append(page)
        return delta

    monkeypatch.setattr(PagedDecodeStep, "reconcile_opened", short)
    for _ in range(12):
        assert d.step([("a", 1), ("b", 1)])
        d.check_staging()
    assert forced  # the short placement happened (an opening step came)
    d.check_at_rest()


def test_a_map_moved_and_synced_elsewhere_builds_the_step() -> None:
    """Between two steady steps a page in the batch (not one the step opens) moves to host memory
    at a layer and the mirror syncs it (nothing is pending then): the step must be built, not
    advanced -- the last tables still name the page's device copy there -- and every layer's
    reads stay exact. Found by a mutation audit (session 87): with the mirror's sync count left out
    of ``map_unmoved``, only the randomized fault fuzz noticed; this test fails then (the advance
    reads the freed device page)."""
    core = make_core(6 + 7, page_size=4, pages=24)
    d = CoreDriver(core, seed=2, fast_decode=True, paged_reads=True)
    d.add("a")
    d.add("b")
    d.step([("a", 6), ("b", 5)])
    for _ in range(6):
        assert d.step([("a", 1), ("b", 1)])
    advanced = core.advanced_decode_steps + core.opened_advances + core.staged_advances
    assert advanced >= 2  # steady steps advance
    last = core._paged_tables
    assert last is not None and core.store.mirror is not None
    page = int(last.pages[0])  # a's first page: never an opened one
    layer = int(np.flatnonzero(core.store.map_np[:, page] >= 0)[0])  # a layer it is on the device at
    core.store.offload(np.array([layer]), np.array([page]))
    core.store.mirror.sync()
    assert not core.store.mirror.pending and core.store.mirror.syncs != last._mirror_syncs
    assert d.step([("a", 1), ("b", 1)])
    assert core.advanced_decode_steps + core.opened_advances + core.staged_advances == advanced  # built
    assert core.store.map_np[layer, page] < 0
    d.check_staging()
    d.check_at_rest()
