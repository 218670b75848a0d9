"""GraphStepBuffers: a step's tables copied into buffers that stay put, and the steps it refuses
(their layers need host work, or they exceed its capacity), on the CPU's served core."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from sglang_ext.dataplane.graph_step_buffers import GraphStepBuffers
from sglang_ext.tools.gpu_check_config import SMALL
from sglang_ext.tools.gpu_check_measure import CoreCheck


def _check(rows=None) -> CoreCheck:  # noqa: ANN001
    check = CoreCheck(dataclasses.replace(SMALL, repeat=1), "cpu", "torch")
    layers = check.config.layers
    check.batch.place(rows or [[1] * layers for _ in check.batch.rids])
    check.step()
    return check


def _buffers(check: CoreCheck, **kw) -> GraphStepBuffers:  # noqa: ANN003
    b = check.batch
    args = {"layers": check.config.layers, "max_batch": len(b.rids), "max_pages": b.batch_pages, **kw}
    return GraphStepBuffers(args["layers"], args["max_batch"], args["max_pages"], check.device,
                            sink_page=args.get("sink_page"))


def test_load_copies_the_step_tables_and_the_views_stay_put():
    """After each step's load the buffers hold that step's tables exactly (rows, page table up to
    the step's pages, CSR), and the views the layers read have the same storage every step.
    Control: the second step's tables differ from the first's (new tokens' rows, lengths)."""
    check = _check()
    b, core = check.batch, check.batch.core
    buffers = _buffers(check)
    seen = []
    for _ in range(2):
        b.begin_decode()
        t = core.tables
        assert buffers.why_not(t) is None
        buffers.load(t)
        n = t.tab.shape[1]
        assert torch.equal(buffers.rows[:, : buffers.batch], t.rows)
        assert torch.equal(buffers.tab[:, :n], t.tab) and buffers.pages == n
        view = buffers.layer_view(core.store, 1, tuple(b.rids))
        assert torch.equal(view.kv_indptr, t.kv_indptr) and torch.equal(view.kv_lens, t.kv_lens)
        assert torch.equal(view.last_page_len, t.last_page_len)
        seen.append((t.rows.clone(), t.kv_lens.clone(), view.kv_indices.data_ptr(), view.kv_lens.data_ptr(),
                     buffers.rows[1, : buffers.batch].data_ptr()))
        core.exit_layer(check.config.layers - 1)
    (rows0, lens0, *ptrs0), (rows1, lens1, *ptrs1) = seen
    assert ptrs0 == ptrs1
    assert not torch.equal(rows0, rows1) and torch.equal(lens1, lens0 + 1)  # the control: the tables moved
    assert buffers.loads == 2


def test_write_puts_the_new_tokens_where_the_core_would():
    """``write`` over the loaded rows lands the step's K/V where ``LayeredKVCore.write`` does.
    Control: without a load the rows are zeros and the write lands elsewhere."""
    check = _check()
    b, core, store = check.batch, check.batch.core, check.batch.core.store
    loc = b.begin_decode()
    buffers = _buffers(check)
    k_flat, v_flat = store.device_views()
    rows = core.tables.rows[2]
    unloaded = buffers.rows[2, : len(b.rids)].clone()
    buffers.load(core.tables)
    k = torch.randn_like(b.k1)
    buffers.write(store, 2, k, b.v1)
    assert torch.equal(k_flat[rows], k)
    core.write(2, loc, b.k1, b.v1)  # the core's own write of the same rows
    assert torch.equal(k_flat[rows], b.k1) and not torch.equal(unloaded, rows)
    core.exit_layer(check.config.layers - 1)


def test_steps_with_host_work_in_their_layers_or_over_capacity_are_refused():
    """A staged step (pages fetched into staging inside its layers) is refused with the reason, as
    are tables over the buffers' batch or page capacity and an overflowing step's absence of
    tables; ``load`` raises with the same reason and copies nothing."""
    layers = SMALL.layers
    staged = _check([[1, 0] * (layers // 2) for _ in range(SMALL.requests)])
    b, core = staged.batch, staged.batch.core
    b.begin_decode()
    buffers = _buffers(staged)
    why = buffers.why_not(core.tables)
    assert why is not None and "stages pages" in why
    with pytest.raises(ValueError, match="stages pages"):
        buffers.load(core.tables)
    assert buffers.loads == 0
    core.exit_layer(layers - 1)
    assert "no tables" in buffers.why_not(None)
    resident = _check()
    resident.batch.begin_decode()
    t = resident.batch.core.tables
    assert _buffers(resident).why_not(t) is None  # the control
    small_batch = _buffers(resident, max_batch=len(resident.batch.rids) - 1)
    assert "requests over" in small_batch.why_not(t)
    few_pages = _buffers(resident, max_pages=t.tab.shape[1] - 1)
    with pytest.raises(ValueError, match="the buffers hold"):
        few_pages.load(t)
    resident.batch.core.exit_layer(layers - 1)


def test_tables_in_another_layout_than_the_captures_are_refused():
    """Graphs captured writing by slot id within a layer (the identity layout's in-place rows)
    would write a step's whole-pool rows into another layer's memory: such a step is refused
    with the reason, and ``load`` raises. Control: the same tables before any capture, and after a
    capture in their own layout (whole-pool rows), are admitted."""
    resident = _check()
    resident.batch.begin_decode()
    t = resident.batch.core.tables
    assert t.rows is not None  # the paged layout: rows of the whole pool
    buffers = _buffers(resident, sink_page=0)
    assert buffers.why_not(t) is None  # no capture yet: no layout to keep
    buffers.load_padding(1, in_place=False)
    assert buffers.why_not(t) is None
    buffers.load_padding(1, in_place=True)
    why = buffers.why_not(t)
    assert why is not None and "not in the layout the graphs were captured in" in why and "slot ids" in why
    with pytest.raises(ValueError, match="captured in"):
        buffers.load(t)
    fresh = _buffers(resident, sink_page=0)
    fresh.load(t)
    fresh.mark_captured()  # gpu-check's probe captures over a loaded step: its layout is kept
    assert fresh.captured_in_place is False and fresh.why_not(t) is None
    resident.batch.core.exit_layer(SMALL.layers - 1)
    identity = CoreCheck(dataclasses.replace(SMALL, repeat=1), "cpu", "torch", identity=True)
    identity.batch.place([[1] * SMALL.layers for _ in identity.batch.rids])
    identity.step()
    identity.batch.begin_decode()
    t = identity.batch.core.tables
    assert t.rows is None  # the identity layout, every request resident: in-place tables
    buffers = _buffers(identity, sink_page=0)
    buffers.load_padding(1, in_place=False)  # the other way round
    why = buffers.why_not(t)
    assert why is not None and "over whole-pool rows" in why
    buffers.load_padding(1, in_place=True)
    assert buffers.why_not(t) is None
    identity.batch.core.exit_layer(SMALL.layers - 1)
