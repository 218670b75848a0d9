"""Staged decode steps replayed as a graph (:class:`GraphStaging` through :class:`DecodeGraphs`),
on the CPU: the layers' fetches and the parked tokens' write-back are Triton launches (the
interpreter) whose lists and counts the boundary loads into fixed buffers; the capture and replays
are :class:`~sglang_ext.testing.tape_graph.TapeGraph`'s (recorded ops and launches rerun on the
recorded tensors, no Python). Two identical batches decode the same staged steps, one eagerly
through the core's pipeline, one as boundary + admit + replay: every layer's attention, every
step, and the host pool after them must be equal. Controls: lists never loaded, the write-back's
count never loaded, the triggered fetches launched at step start."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
import torch

from sglang_ext.dataplane.decode_graphs import DecodeGraphs
from sglang_ext.dataplane.event_clock import EventClock
from sglang_ext.dataplane.graph_layer_marks import GraphLayerMarks
from sglang_ext.dataplane.graph_staging import START, TRIG, GraphStaging
from sglang_ext.dataplane.graph_step_buffers import GraphStepBuffers
from sglang_ext.dataplane.triton_row_writer import TritonRowWriter
from sglang_ext.testing.stamp_clock import StampClock
from sglang_ext.testing.tape_graph import TapeGraph
from sglang_ext.tools.gpu_check_config import SMALL
from sglang_ext.tools.gpu_check_measure import CoreCheck

LAYERS = 3
PLACEMENT = [(0, 0, 1), (1, 0, 0), (0, 1, 0)]
"""Per request, 1 = on the device at that layer: request 0 is fetched at step start (layer 0) and
after layer 0 (layer 1); request 1 from layer 1 on; request 2 at layers 0 and 2 (a gap: the eager
pipeline fetches layer 2 after layer 0 ends, the graph after layer 1)."""
STEPS = 3


@pytest.fixture(autouse=True)
def _interpret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _check(device: str = "cpu") -> CoreCheck:
    config = dataclasses.replace(SMALL, layers=LAYERS, requests=len(PLACEMENT), repeat=2)
    ch = CoreCheck(config, device, "torch")
    ch.step()
    ch.batch.place(PLACEMENT)
    ch.step()  # the placement's moves happen at this boundary; its steps stage from the next
    return ch


def _run(control: str | None = None, device: str = "cpu", graph: Any = TapeGraph,
         writer: bool = False) -> tuple[list, list, dict]:
    """The eager batch's and the replayed batch's outputs, step by step, and facts of the replays
    (``graph``: the graph object's class, made from the device; ``writer``: the replayed batch's
    store writes and parks with the one-launch Triton writer)."""
    eager, graphed = _check(device), _check(device)
    if writer:
        graphed.batch.core.store.row_writer = TritonRowWriter()
    eager_outs = [[o.clone() for o in eager.layers(eager.batch.begin_decode(), backend="triton")]
                  for _ in range(STEPS)]
    core = graphed.batch.core
    real = len(graphed.batch.rids)
    graphs = DecodeGraphs(core, (real,), graphed.batch.batch_pages + real, staged=True)
    staging = graphs.buffers.staging
    assert isinstance(staging, GraphStaging)
    graphs.capture(lambda bs: graphed.layers(None, backend="triton", plan=False, graph=graphs.buffers),
                   lambda: graph(device))
    outs, facts = [], {"fetches": [], "pairs": [], "kinds": set()}
    marks = staging.copy_marks  # CUDA: the capture timed the start lists and the write-back
    facts["copy_marks"] = marks is not None and marks.of(real) is not None
    timed0 = core.store.engine.clock.times.h2d_timed_bytes
    for _ in range(STEPS):
        loc = graphed.batch.begin_decode()
        assert core.tables.staging_ids.size and core.tables.fetches and core.tables.token_writeback is not None
        size = graphs.admit(slots=loc)
        assert size == real, dict(graphs.eager_reasons)
        if control == "no-lists":
            staging.clear()
        elif control == "no-write-back":
            staging.wb_count.zero_()
        elif control == "all-at-start":
            _all_at_start(staging)
        facts["fetches"].append(staging.loaded_fetches)
        facts["pairs"].append(staging.loaded_pairs)
        facts["kinds"] |= {kind for kind in (START, TRIG) if int(staging.listed[kind, :, 0].sum())}
        try:
            outs.append([o.clone() for o in graphs.replay(size)])
        finally:
            core.exit_layer(LAYERS - 1)  # the step ends as after a replay served
    facts["graphed"] = core.pipeline.graphed_steps
    facts["replays"] = graphs.replays
    facts["deferred"], facts["materialized"] = core.store.deferred_tables, core.store.materialized_tables
    core.store.engine.quiesce()  # the replays' copies (and their bookings) complete; no eager step yet
    core.store.engine.clock.harvest()
    facts["h2d_timed"] = core.store.engine.clock.times.h2d_timed_bytes - timed0
    after = (eager.layers(eager.batch.begin_decode(), backend="triton"),
             graphed.layers(graphed.batch.begin_decode(), backend="triton"))
    facts["after_equal"] = all(torch.equal(a, b) for a, b in zip(*after, strict=True))
    for ch in (eager, graphed):  # the last parked write-back (a side stream on CUDA) has landed
        ch.batch.core.store.engine.quiesce()
    facts["host_equal"] = torch.equal(eager.batch.core.store.host, core.store.host)
    return eager_outs, outs, facts


def _all_at_start(staging: GraphStaging) -> None:
    """Every triggered fetch moved into its layer's start list (launched before layer 0)."""
    for layer in range(LAYERS):
        n_s, n_t = (int(staging.listed[kind, layer, 0]) for kind in (START, TRIG))
        staging.lists[START, layer, n_s: n_s + n_t] = staging.lists[TRIG, layer, :n_t]
        staging.listed[START, layer, 0] = n_s + n_t
        staging.listed[START, layer, 1] = staging.listed[:, layer, 1].max()
        staging.listed[TRIG, layer] = 0


def _equal(a: list, b: list) -> bool:
    return all(torch.equal(x, y) for sa, sb in zip(a, b, strict=True) for x, y in zip(sa, sb, strict=True))


@pytest.mark.parametrize("writer", [False, True], ids=["two-copies", "triton-writer"])
def test_staged_steps_replayed_decode_what_eager_steps_do(writer):
    """Every replayed staged step's attention equals the eager step's at every layer; the host pool
    holds the same KV after them (the parked tokens' write-back ran in the graph), and the next
    eager step over it decodes equally. The steps did stage: fetch launches regrouped into both
    start and trigger lists, parked pairs written back, every step replayed and counted."""
    eager, graphed, facts = _run(writer=writer)
    assert not facts["copy_marks"] and facts["h2d_timed"] == 0  # the CPU: no graph timing (the GPU twin's control)
    assert _equal(eager, graphed)
    assert facts["host_equal"] and facts["after_equal"]
    assert min(facts["fetches"]) > 0 and min(facts["pairs"]) == sum(row.count(0) for row in PLACEMENT)
    assert facts["kinds"] == {START, TRIG}
    assert facts["replays"] == facts["graphed"] == STEPS
    # the replayed steps' tables were never made on the device (the graph gathers its own)
    assert facts["deferred"] >= STEPS and facts["materialized"] == 0, facts


def test_the_park_writes_through_row_ids_the_staging_owns():
    """A graph keeps addresses, not tensors: the park's row ids must live as long as the staging.
    The store's ``row_ids`` replaces its tensor when a bigger eager step asks (a batch over the
    largest captured size), which would leave a captured park reading freed memory (graph
    review, session 69). The ids the writer gets are the staging's own, before and after."""
    ch = _check()
    store = ch.batch.core.store
    seen: list[int] = []
    writer = TritonRowWriter()

    def recording(k_dst, v_dst, rows, k, v) -> None:  # noqa: ANN001
        seen.append(rows.untyped_storage().data_ptr())
        writer(k_dst, v_dst, rows, k, v)

    store.row_writer = recording
    staging = GraphStaging(store, 4, 64)
    k = torch.zeros((3, store.config.kv_heads, store.config.head_dim), dtype=store.config.dtype)
    staging.park(0, 3, k, k)
    store.row_ids(4096)  # a big eager step grows (replaces) the store's ids
    staging.park(1, 3, k, k)
    own = staging._park_ids.untyped_storage().data_ptr()
    assert seen == [own, own] and store.row_ids(3).untyped_storage().data_ptr() != own


def test_negative_control_lists_not_loaded():
    """The replay with empty fetch lists reads stale staging pages: the outputs differ."""
    eager, graphed, _ = _run("no-lists")
    assert not _equal(eager, graphed)


def test_negative_control_write_back_not_loaded():
    """The replay whose write-back copies nothing leaves the parked tokens out of the host pool:
    the pools differ, and the next steps read the stale rows (staged layers fetch them)."""
    eager, graphed, facts = _run("no-write-back")
    assert not facts["host_equal"]
    assert not facts["after_equal"] or not _equal(eager, graphed)


def test_negative_control_triggered_fetches_launched_at_step_start():
    """The order matters: with every triggered fetch launched at step start, a request staged at
    two layers gets its second layer's pages into the staging page before its first layer read
    it -- the outputs differ (on a GPU the same launches on the H2D stream would race the layers)."""
    eager, graphed, _ = _run("all-at-start")
    assert not _equal(eager, graphed)


def test_why_not_names_what_a_graph_cannot_replay():
    """Staging buffers admit a paged decode step that parks; they refuse general tables (a
    recompute step's) and steps that write staged pages back per layer, naming why."""
    ch = _check()
    core = ch.batch.core
    ch.batch.begin_decode()
    tables = core.tables
    assert GraphStaging.why_not(tables) is None
    per_layer = dataclasses.replace(tables.fetches[0]) if tables.fetches else None
    tables.writebacks[0] = per_layer
    assert "per layer" in GraphStaging.why_not(tables)
    tables.writebacks[0] = None
    core.exit_layer(LAYERS - 1)


def test_load_regroups_launches_by_target_layer():
    """The lists equal the tables' launches regrouped: per target layer, the requests of its
    step-start launches (START) and of its later ones (TRIG), each list's widest request."""
    ch = _check()
    core = ch.batch.core
    ch.batch.begin_decode()
    tables = core.tables
    staging = GraphStaging(core.store, len(PLACEMENT), ch.batch.batch_pages)
    buffers = GraphStepBuffers(LAYERS, len(PLACEMENT), ch.batch.batch_pages, core.store.device, staging=staging)
    buffers.load(tables)  # the block: the tables' host arrays, sent in one copy
    want: dict[tuple[int, int], set] = {}
    for f in tables.fetches:
        key = (START if f.trigger < 0 else TRIG, f.layer)
        want.setdefault(key, set()).update(tables._reqs_np[f.first: f.first + f.n_reqs].tolist())
    got = {}
    for kind in (START, TRIG):
        for layer in range(LAYERS):
            n = int(staging.listed[kind, layer, 0])
            if n:
                got[(kind, layer)] = set(staging.lists[kind, layer, :n].tolist())
    assert got == want and want
    # request 2's layer 2 is triggered by layer 0 eagerly (a gap), listed for layer 2 all the same
    assert 2 in got[(TRIG, 2)] and 2 in got[(START, 0)]
    assert np.array_equal(staging.flat[: tables._n].numpy(), tables.pages)
    core.exit_layer(LAYERS - 1)


def test_no_staging_where_the_copy_engine_fell_back_to_memcpy():
    """The graph's copies are Triton kernels reading the host pool through its device mapping: an
    engine that fell back to ``memcpy`` (no such mapping) gets no staging, and the pipeline keeps
    launching a decode step's fetches at its boundary. Control: the same core with Triton copies."""
    core = _check().batch.core
    staging, why = GraphStaging.for_core(core, 4, 64)
    assert staging is not None and why is None and core.pipeline.defer_start
    core = _check().batch.core
    core.store.engine._kernel_impl = "memcpy"
    staging, why = GraphStaging.for_core(core, 4, 64)
    assert staging is None and "memcpy" in why and not core.pipeline.defer_start


def _start_list_bytes(staging: GraphStaging, tables: Any, store: Any) -> int:
    """The bytes the loaded start lists move, from what the kernel reads: per listed request, its
    host-only pages at the list's layer among its first ``counts`` pages, K and V each a segment."""
    lists, listed = staging.lists.numpy(), staging.listed.numpy()
    starts, counts = staging.starts.numpy(), staging.counts.numpy()
    pages = 0
    for layer in range(LAYERS):
        for r in lists[START, layer, : listed[START, layer, 0]]:
            cols = tables.pages[starts[r]: starts[r] + counts[r]]
            pages += int((store.map_np[layer, cols] < 0).sum())
    return 2 * pages * store.engine.segment_bytes


@pytest.mark.parametrize("captured", [True, False], ids=["timed-capture", "control-untimed-capture"])
def test_admitted_steps_book_the_graphs_copy_timings_with_their_bytes(captured: bool):
    """A capture records timing events around the start lists' launches and the write-back
    (``copy_marks``); each admission books them with the engine's clock with the bytes the replay
    moves -- the start lists' host pages, the parked rows -- so replayed steps keep feeding the
    link's bandwidth samples (``EventClock.book``; events played by ``StampClock``). Two steps
    admitted and replayed before a harvest: the first booking is dropped unread (the second
    replay stamped its events: SGLang's overlap loop, where step k+1 is admitted before step k's
    replay has run), one booking per direction is read, the second step's. Control: a capture that
    recorded none books nothing."""
    ch = _check()
    core, store = ch.batch.core, ch.batch.core.store
    stamps = StampClock()
    real = len(ch.batch.rids)
    graphs = DecodeGraphs(core, (real,), ch.batch.batch_pages + real, staged=True)
    staging = graphs.buffers.staging
    tapes: list[TapeGraph] = []
    staging.copy_marks = GraphLayerMarks(2, stamps.event, lambda: captured and tapes[-1].capturing)
    clock = store.engine.clock = EventClock(new_event=stamps.event, capturing=lambda: False)
    graphs.capture(lambda bs: ch.layers(None, backend="triton", plan=False, graph=graphs.buffers),
                   lambda: tapes.append(TapeGraph("cpu")) or tapes[-1])
    assert (staging.copy_marks.of(real) is not None) is captured
    expected = {}
    for _ in range(2):
        loc = ch.batch.begin_decode()
        d2h0 = store.d2h_bytes
        assert graphs.admit(slots=loc) == real
        expected = {"h2d": _start_list_bytes(staging, core.tables, store), "d2h": store.d2h_bytes - d2h0}
        marks = staging.copy_marks.of(real)
        events = [] if marks is None else [*marks[0].values(), *marks[1].values()]
        for event in events:  # the replay is enqueued, not yet run: its events are not complete
            event.at = None
        try:
            graphs.replay(real)
        finally:
            core.exit_layer(LAYERS - 1)
    for event in events:  # the last replay has run (the emulated graph stamps no events itself)
        event.record()
    assert expected["h2d"] > 0 and expected["d2h"] > 0
    h2d0 = clock.times.h2d_timed_bytes
    assert clock.harvest() == (2 if captured else 0)
    assert clock.times.h2d_timed_bytes - h2d0 == (expected["h2d"] if captured else 0)
    assert clock.times.untimed == (2 if captured else 0)  # the first step's two bookings, dropped unread
