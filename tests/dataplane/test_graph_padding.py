"""``GraphStepBuffers`` padding and the store's sink page (``SlotStoreConfig.graph_sink``).

SGLang replays a decode batch on the smallest captured size that holds it; the buffers pad the
step's tables to that size with one token per padded row on the sink page, where no layer-page
maps. What must hold: the padded tables say exactly that (device and host CSR alike), the sink
is never handed out, and a replay with padded rows leaves every request's KV exact -- with the
negative control of a sink that is some request's page."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from sglang_ext.dataplane.graph_step_buffers import GraphStepBuffers
from sglang_ext.dataplane.slot_kv_store import SlotKVStore
from sglang_ext.dataplane.slot_store_config import SlotStoreConfig
from sglang_ext.tools.gpu_check_config import SMALL
from sglang_ext.tools.gpu_check_graph import GraphProbe
from sglang_ext.tools.gpu_check_measure import CoreCheck
from sglang_ext.tools.gpu_check_report import FAIL, PASS
from tests.dataplane.test_gpu_check_graph import Taped


def _store(device_pages: int, logical_pages: int = 8, layers: int = 2, sink: bool = True) -> SlotKVStore:
    return SlotKVStore(SlotStoreConfig(layers=layers, page_size=4, kv_heads=1, head_dim=2,
                                       logical_pages=logical_pages, device_pages=device_pages,
                                       dtype=torch.float32, device="cpu", graph_sink=sink))


def test_the_paged_sink_is_the_last_page_and_never_handed_out():
    store = _store(device_pages=6)
    assert not store.identity and store.sink_page == 5
    assert store.allocator.capacity == 5  # the budget one page smaller
    ids = store.allocator.alloc(5)
    assert ids is not None and 5 not in ids.tolist() and store.allocator.alloc(1) is None
    control = _store(device_pages=6, sink=False)
    assert control.sink_page is None and control.allocator.capacity == 6


def test_the_identity_sink_is_sglangs_padding_page():
    store = _store(device_pages=2 * 8)
    assert store.identity and store.sink_page == 0  # logical page 0 at layer 0: SGLang never allocates it
    with pytest.raises(ValueError, match="graph_sink needs device_pages >= 2"):
        _store(device_pages=1)


def _check() -> CoreCheck:
    return CoreCheck(dataclasses.replace(SMALL, repeat=1, layers=2, requests=2), "cpu", "torch")


def test_padded_tables_put_each_padded_row_on_the_sink():
    """Rows past the batch: one token on the sink page at every layer; the CSR runs on from the
    batch's pages; the host CSR for a plan says the same; the batch's rows are the step's."""
    check = _check()
    b, core = check.batch, check.batch.core
    b.place([[1, 1] for _ in b.rids])
    check.step()
    b.begin_decode()
    tables, real, sink, ps = core.tables, len(b.rids), core.store.sink_page, check.config.page_size
    n = int(tables.tab.shape[1])
    buffers = GraphStepBuffers(2, real + 3, n + 3, "cpu", sink, ps)
    buffers.load(tables, padded_to=real + 3)
    assert (buffers.batch, buffers.real, buffers.pages) == (real + 3, real, n + 3)
    assert torch.equal(buffers.rows[:, :real], tables.rows)
    assert (buffers.rows[:, real:] == sink * ps).all()
    assert torch.equal(buffers.tab[:, :n], tables.tab) and (buffers.tab[:, n:n + 3] == sink).all()
    assert buffers.kv_indptr[: real + 4].tolist() == [*tables.kv_indptr.tolist(), n + 1, n + 2, n + 3]
    assert buffers.kv_lens[real:].tolist() == [1, 1, 1] and buffers.last_page_len[real:].tolist() == [1, 1, 1]
    view = buffers.layer_view(core.store, 1, tuple(b.rids))
    assert view.kv_lens.numel() == real + 3 and view.kv_indptr.numel() == real + 4
    planned = buffers.plan_view(tables, view)
    assert torch.equal(planned.kv_indptr, buffers.kv_indptr[: real + 4])
    assert torch.equal(planned.last_page_len, buffers.last_page_len[: real + 3])
    assert sink not in core.store.map_np.reshape(-1).tolist()  # no layer-page lives there
    # what cannot be padded is refused, with the reason
    assert "more than the 1 rows" in buffers.why_not(tables, padded_to=1)
    assert "requests padded to 6 rows over" in buffers.why_not(tables, padded_to=real + 4)
    no_sink = GraphStepBuffers(2, real + 3, n + 3, "cpu")
    with pytest.raises(ValueError, match="padding needs a sink page"):
        no_sink.load(tables, padded_to=real + 1)
    no_sink.load(tables)  # unpadded needs none
    assert no_sink.batch == no_sink.real == real
    core.exit_layer(1)


def test_padded_replays_leave_exact_kv_and_a_sink_on_a_request_page_does_not():
    """The probe replays with padded rows (large random inputs) on the tape: the batch's rows agree
    bit-exactly and every layer's attention over every request's KV matches the reference
    (PASS). Negative control: the sink moved onto a page of the first request (layer 0's copy of
    its first page) -- the padded rows' writes land in its KV and the reference check FAILs."""
    check = _check()
    check.step()
    figures = {f.key: f for f in GraphProbe(check, Taped).run()}
    assert figures["graph.replay_max_abs_diff"].status == PASS
    assert figures["graph.replayed_steps_attention_err"].status == PASS
    assert check.details["graph_probe"]["rows"] == len(check.batch.rids) + 1
    assert "padded to 3 rows" in figures["graph.replay_max_abs_diff"].note

    control = _check()
    control.step()
    store = control.batch.core.store
    first_page = control.batch.pages(0)[0]
    store.sink_page = int(np.asarray(store.map_np)[0, first_page])
    figures = {f.key: f for f in GraphProbe(control, Taped).run()}
    assert figures["graph.replayed_steps_attention_err"].status == FAIL
    assert figures["graph.buffers_vs_tables_err"].status == FAIL  # the padded row's write reached its KV


def test_the_identity_layout_replays_in_place_with_padding_at_slot_0():
    """The identity layout (every layer of every page on the device: what serves while nothing is
    offloaded) on the tape: its steady steps' tables have no rows (the layers write in place by
    slot id), so the buffers take the step's slots, padded with SGLang's padding slot 0; the
    batch's rows agree bit-exactly and every request's KV stays exact (PASS). Negative control:
    the sink on the first request's first page -- the padded rows' writes land on its first
    token at every layer and the reference check FAILs."""
    check = _check()  # the check's own batch is paged; the identity probe builds a batch of its own
    check.step()
    figures = {f.key: f for f in GraphProbe(check, Taped, identity=True).run()}
    for key in ("graph.identity.replay_max_abs_diff", "graph.identity.buffers_vs_tables_err",
                "graph.identity.replayed_steps_attention_err"):
        assert figures[key].status == PASS, figures[key]
        assert figures[key].title.startswith("identity layout: ")
    assert "padded to 3 rows" in figures["graph.identity.replay_max_abs_diff"].note
    assert figures["graph.replay_max_abs_diff"].status == PASS  # the check's own (paged) probe beside it
    m = check.details["graph_probe_identity"]
    assert m["requests"] == 2 and m["late_replay_max_abs_diff"] == 0

    control = CoreCheck(dataclasses.replace(SMALL, repeat=1, layers=2, requests=2), "cpu", "torch", identity=True)
    assert control.batch.core.store.identity and control.batch.core.store.sink_page == 0
    control.step()
    control.batch.core.store.sink_page = control.batch.pages(0)[0]
    figures = {f.key: f for f in GraphProbe(control, Taped).run()}
    assert figures["graph.replayed_steps_attention_err"].status == FAIL


def test_in_place_tables_need_the_steps_slots():
    check = CoreCheck(dataclasses.replace(SMALL, repeat=1, layers=2, requests=2), "cpu", "torch", identity=True)
    check.step()
    b, core = check.batch, check.batch.core
    loc = b.begin_decode()
    tables = core.tables
    assert tables.rows is None  # the identity layout's steady tables: in place by slot id
    buffers = GraphStepBuffers(2, 3, int(tables.tab.shape[1]) + 1, "cpu", core.store.sink_page, check.config.page_size)
    with pytest.raises(ValueError, match="need the step's new slots"):
        buffers.load(tables, padded_to=3)
    buffers.load(tables, padded_to=3, slots=loc)
    assert buffers.in_place and buffers.rows[:, :2].tolist() == [loc.tolist()] * 2 and buffers.rows[:, 2].tolist() == [0, 0]
    core.exit_layer(1)
