"""The placement model's launch count (``controlplane.model.launch_count``: one fetch launch per
target layer at the step start and at each layer end, ``controlplane/model/timeline.py``) is what
the served core issues: the fetch launches of the paged step tables it builds for a placement."""

from __future__ import annotations

import pytest

from controlplane.model import launch_count
from sglang_ext.dataplane import layered_kv_core
from sglang_ext.dataplane.paged_step_tables import PagedStepTables
from tests.dataplane.core_driver import CoreDriver, make_core

WANTS = {  # per request, its layers on the device (False: offloaded)
    "a": [True, False, True, False, False, True],
    "b": [False, True, True, True, False, False],
    "c": [True, False, True, False, False, True],  # a's layers: its launches shared with a's
    "d": [True, True, True, True, True, True],  # nothing fetched
}


@pytest.mark.parametrize("rids", [("a",), ("a", "c"), ("a", "b"), ("a", "b", "c", "d"), ("d",)])
def test_the_core_launches_what_the_model_counts(monkeypatch, rids):
    built: list[PagedStepTables] = []

    def record(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        tables = PagedStepTables(*args, **kwargs)
        built.append(tables)
        return tables

    monkeypatch.setattr(layered_kv_core, "PagedStepTables", record)
    d = CoreDriver(make_core(33 + 60, layers=6), seed=3)
    for rid in rids:
        d.add(rid)
    d.step([(rid, 5) for rid in rids])
    for rid in rids:
        d.want(rid, WANTS[rid])
    built.clear()
    d.step([(rid, 1) for rid in rids])  # a decode step under the placement
    rows = [[int(x) for x in WANTS[rid]] for rid in rids]
    assert built and built[-1].fetches is not None
    assert len(built[-1].fetches) == launch_count(rows)
    # negative control: counting one launch per (request, offloaded layer) differs where
    # requests share a launch
    per_request = sum(row.count(0) for row in rows)
    if rids == ("a", "c"):
        assert per_request != launch_count(rows)
