"""A steady decode step whose opened page is resident at some layers only.

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
