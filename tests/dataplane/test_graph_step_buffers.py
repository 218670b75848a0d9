"""GraphStepBuffers: a step's tables copied into buffers that stay put, and the steps it refuses
(their layers need host work, or they exceed its capacity), on the CPU's served core."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from sglang_ext.dataplane.graph_staging import GraphStaging
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


@pytest.mark.parametrize("split", [False, True], ids=["one-copy", "split"])
@pytest.mark.parametrize("staged", [False, True], ids=["resident", "staged"])
@pytest.mark.parametrize("pad", [0, 3], ids=["unpadded", "padded"])
def test_the_block_sends_a_paged_step_in_one_copy_and_the_graph_gathers_its_tables(staged, pad, split, monkeypatch):
    """Paged layout (the map mirror given): each step's host arrays go to the device in one copy of
    the block, and the page tables gathered from the mirror (what a captured step does first)
    equal the step's own -- staged columns at their staging pages -- with padded rows' columns on
    the sink; the CSR and rows are the step's; the views are the block's, every step. ``split``:
    the page-list region's unused tail is skipped (``SPLIT_BYTES`` 0: two copies, session 86;
    with the second range not sent, the staged and padded cases fail: checked by hand). Control:
    a map moved after the tables were built is refused, with the reason."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    if split:
        monkeypatch.setattr("sglang_ext.dataplane.graph_step_buffers.SPLIT_BYTES", 0)
    layers = SMALL.layers
    check = _check([[1] * (layers // 2) + [0] * (layers - layers // 2) if staged and i % 2 else [1] * layers
                    for i in range(SMALL.requests)])
    b, core = check.batch, check.batch.core
    real, sink, ps = len(b.rids), core.store.sink_page, check.config.page_size
    staging = GraphStaging(core.store, real + pad, b.batch_pages + pad + 8) if staged else None
    buffers = GraphStepBuffers(layers, real + pad, b.batch_pages + pad + 8, check.device, sink, ps, staging,
                               core.store.mirror)
    assert buffers.block is not None
    base = buffers.block.dev.untyped_storage().data_ptr()
    for step in range(3):
        b.begin_decode()
        t = core.tables
        assert bool(t.staging_ids.size) == staged
        assert buffers.why_not(t, real + pad) is None, buffers.why_not(t, real + pad)
        buffers.load(t, padded_to=real + pad)
        assert buffers.block.sends == step + 1
        buffers.gather_tables()
        n = t.tab.shape[1]
        assert torch.equal(buffers.tab[:, :n], t.tab) and (buffers.tab[:, n: n + pad] == sink).all()
        assert torch.equal(buffers.rows[:, :real], t.rows) and (buffers.rows[:, real: real + pad] == sink * ps).all()
        assert buffers.kv_indptr[: real + pad + 1].tolist() == [*t.kv_indptr.tolist(), *range(n + 1, n + pad + 1)]
        assert torch.equal(buffers.kv_lens[:real], t.kv_lens) and torch.equal(buffers.last_page_len[:real],
                                                                               t.last_page_len)
        for view in (buffers.rows, buffers.kv_indptr, buffers.flat, buffers.stage):
            assert view.untyped_storage().data_ptr() == base
        core.exit_layer(layers - 1)
    b.begin_decode()
    core.store.mirror.changed(b.core.tables.pages[:1])  # control: the map moved after the build
    assert "the map moved" in buffers.why_not(core.tables, real + pad)
    core.exit_layer(layers - 1)


def test_control_a_block_never_sent_leaves_the_last_steps_tables(monkeypatch):
    """Control for the test above: with the copy skipped after the first step, the next step's
    rows and lengths in the buffers are the first step's, not the tables'."""
    check = _check()
    b, core = check.batch, check.batch.core
    buffers = GraphStepBuffers(SMALL.layers, len(b.rids), b.batch_pages + 8, check.device, core.store.sink_page,
                               check.config.page_size, mirror=core.store.mirror)
    for step in range(2):
        b.begin_decode()
        if step:
            monkeypatch.setattr(buffers.block, "send", lambda nbytes=None: None)
        buffers.load(core.tables)
        equal = torch.equal(buffers.rows, core.tables.rows) and torch.equal(buffers.kv_lens, core.tables.kv_lens)
        assert equal == (step == 0)
        core.exit_layer(SMALL.layers - 1)


def test_a_plan_of_a_deferred_step_reads_the_host_half():
    """FlashInfer's plan of a replayed step (the buffers' padded host CSR) reads the tables' host
    half: a deferred step stays without its device half, and the CSR is the one the block sent.
    Control: the tables' own plan view (their device half's pinned CSR) makes the device half."""
    check = _check()
    b, core = check.batch, check.batch.core
    real, pad = len(b.rids), 2
    buffers = GraphStepBuffers(SMALL.layers, real + pad, b.batch_pages + 8, check.device, core.store.sink_page,
                               check.config.page_size, mirror=core.store.mirror)
    core.defer_tables = True
    loc = b.begin_decode()
    t = core.tables
    buffers.load(t, padded_to=real + pad, slots=loc)
    view = buffers.layer_view(core.store, 0, tuple(b.rids))
    planned = buffers.plan_view(t, view)
    assert t.pending and core.store.materialized_tables == 0
    assert torch.equal(planned.kv_indptr, buffers.kv_indptr[: real + pad + 1])
    assert torch.equal(planned.last_page_len, buffers.last_page_len[: real + pad])
    t.plan_view(view)  # control
    assert not t.pending and core.store.materialized_tables == 1
    core.exit_layer(SMALL.layers - 1)


def test_a_block_sent_in_two_ranges_skips_the_gap_between_them():
    """``StepBlock.send(n, also=(lo, hi))``: bytes ``[0, n)`` and ``[lo, hi)`` reach the device,
    the gap and the rest keep what the device held (the page-list tail a split send skips); a
    range that overlaps the first or passes the block is refused. Control: a send of the whole
    block writes the gap too."""
    from sglang_ext.dataplane.step_block import StepBlock

    block = StepBlock([("a", torch.int32, (4,)), ("b", torch.int32, (8,)), ("c", torch.int32, (4,))], "cpu")
    host = block.host()
    for name in ("a", "b", "c"):
        host[name][:] = 7
    block.send(block.end("b", 2), also=(block.start("c"), block.end("c", 4)))
    assert block.views["a"].tolist() == [7] * 4 and block.views["c"].tolist() == [7] * 4
    assert block.views["b"].tolist() == [7, 7] + [0] * 6
    for bad in ((0, 8), (block.start("c"), block.nbytes + 8)):
        with pytest.raises(ValueError, match="not within"):
            block.send(block.end("b", 2), also=bad)
    host = block.host()
    for name in ("a", "b", "c"):
        host[name][:] = 7
    block.send()
    assert block.views["b"].tolist() == [7] * 8
