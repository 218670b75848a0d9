"""Staged decode steps run the way a replayed graph runs them (:class:`GraphStaging`'s launches,
the buffers' tables, no pipeline launches), on the served core's driver: every token every layer
reads is the one written (the driver's shadow check), with prefixes shared by staged requests,
placement changes and a pause between steps; and on the simulated CUDA streams
(``stream_order.py``) every access to the pools and the park buffer is ordered by the graph's own
forks, events and joins. Controls: the layers' waits dropped, the trigger lists forked without
waiting for the layer that frees their staging."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from kernels.block_copy import copy_segments_ref, fetch_page_indices
from sglang_ext.dataplane import graph_staging
from sglang_ext.dataplane.graph_staging import GraphStaging
from sglang_ext.dataplane.graph_step_buffers import GraphStepBuffers
from tests.dataplane.core_driver import LAYERS, PAGES, CoreDriver, make_core
from tests.dataplane.cuda_simulation import install, track_core

MAX_BATCH = 4


def _driver(seed: int = 3, device: str = "cpu") -> CoreDriver:
    core = make_core(PAGES + 8, device=device)
    d = CoreDriver(core, seed=seed, fast_decode=True, paged_reads=True)
    core.pipeline.defer_start = True  # as DecodeGraphs(staged=True) and the adapter set it
    staging = GraphStaging(core.store, MAX_BATCH, PAGES + MAX_BATCH)
    d.graph_buffers = GraphStepBuffers(LAYERS, MAX_BATCH, PAGES + MAX_BATCH, core.store.device, None,
                                       core.page_size, staging)
    return d


def _scenario(d: CoreDriver, steps: int = 4) -> dict[str, int]:
    """Three requests, ``c`` sharing ``a``'s first page; placements with gaps and a request staged
    from layer 0; decode steps between plan changes, a pause and a resume. Returns how many steps
    ran graphed and how many of those fetched (a staged step)."""
    staging = d.graph_buffers.staging
    fetched = [0]
    real_load = staging.load

    def load(tables, *args) -> None:  # noqa: ANN001, ANN002
        real_load(tables, *args)
        fetched[0] += staging.loaded_fetches > 0

    staging.load = load
    d.add("a")
    d.add("b")
    assert d.step([("a", 9), ("b", 5)])
    d.add("c", share_from="a", share_pages=1)
    assert d.step([("c", 3)])
    d.want("a", [False, True, False])
    d.want("b", [True, False, False])
    d.want("c", [False, True, False])
    for i in range(steps):
        assert d.step([("a", 1), ("b", 1), ("c", 1)])
        if i == 1:
            d.want("b", [False, False, True])
    d.want("b", [True] * LAYERS, paused=True)
    assert d.step([("a", 1), ("c", 1)])
    d.want("b", [False, True, False])
    for _ in range(2):
        assert d.step([("a", 1), ("b", 1), ("c", 1)])
    d.check_at_rest()
    return {"graphed": d.graph_steps, "fetched": fetched[0]}


def test_graphed_staged_steps_read_every_token_they_wrote(monkeypatch):
    """On the CPU (the launches in Triton's interpreter): every decode step runs graphed, most of
    them staged, shared prefix included; every layer reads exactly the KV written (shadow check),
    and the at-rest check after them finds every token in its place."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    d = _driver()
    got = _scenario(d)
    assert got["graphed"] >= 7 and got["fetched"] >= 5, (got, dict(d.graph_declined))
    assert d.core.pipeline.graphed_steps == got["graphed"]


def test_negative_control_a_graph_without_its_fetches_reads_stale_kv(monkeypatch):
    """The same scenario with every fetch list emptied after the load: a staged layer reads
    staging pages nobody filled and the shadow check fails inside the layer."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    d = _driver()
    staging = d.graph_buffers.staging
    real = GraphStaging.load

    def load(self, tables, size, host) -> None:  # noqa: ANN001
        real(self, tables, size, host)
        host["staging_ctl"][self._zero_from: self._zero_from + 4 * self.layers] = 0  # every list's length

    monkeypatch.setattr(GraphStaging, "load", load)
    with pytest.raises(AssertionError) as failed:
        _scenario(d)
    assert "graph" in failed.value.args[0], failed.value.args
    assert staging.loaded_fetches > 0


def _simulated_kernels(mp: pytest.MonkeyPatch, sim) -> None:  # noqa: ANN001
    """The graph's two launches as copies of the current stream, reading their lists (tracked)."""

    def fetch(host, dev, flat, stage, map_row, reqs, starts, counts, max_pages, host_base, host_stride,  # noqa: ANN001
              dev_v, programs=None, listed=None):
        with sim.copying():
            for t in (flat, stage, map_row, reqs, starts, counts, listed):
                t.sum()
            n = int(listed[0])
            arrays = [t.numpy() for t in (flat, stage, map_row, reqs[:n], starts, counts)]
            src, dst = fetch_page_indices(*arrays, host_base, host_stride, dev_v)
            copy_segments_ref(host, dev, torch.from_numpy(src), torch.from_numpy(dst))

    def copy(src, dst, src_idx, dst_idx, programs=None, count=None):  # noqa: ANN001
        with sim.copying():
            n = int(count[0])
            src_idx.sum(), dst_idx.sum()
            copy_segments_ref(src, dst, src_idx[:n], dst_idx[:n])

    mp.setattr(graph_staging, "fetch_pages_triton", fetch)
    mp.setattr(graph_staging, "copy_segments_triton", copy)
    mp.setattr(graph_staging, "triton_usable", lambda *tensors: True)


def _on_streams(monkeypatch: pytest.MonkeyPatch, patch=None) -> tuple[list, dict]:  # noqa: ANN001
    with monkeypatch.context() as mp:
        sim = install(mp)
        _simulated_kernels(mp, sim)
        if patch is not None:
            patch(mp)
        d = _driver()
        track_core(sim, d.core)
        staging = d.graph_buffers.staging
        for t in (staging.park_buf, staging.flat, staging.stage, staging._ctl, staging.wb_src):
            sim.track(t)
        with sim.tracer():
            try:
                got = _scenario(d)
            except AssertionError as exc:  # a read of a page not yet fetched: the violation says where
                got = {"failed": str(exc)}
    return sim.violations, got


def test_on_simulated_streams_every_access_is_ordered(monkeypatch):
    """The graph's forks to the H2D and D2H streams, its per-layer events and its joins order
    every fetch, layer read and write, park and write-back; the next boundary's moves follow
    the joined step."""
    violations, got = _on_streams(monkeypatch)
    assert violations == [] and got.get("fetched", 0) >= 5, (violations[:3], got)


def test_negative_control_layers_that_do_not_wait_race_their_fetches(monkeypatch):
    """Without the compute stream's waits on the fetch events, a layer reads staging pages the
    H2D stream may still be writing: the simulation reports it."""
    violations, _ = _on_streams(monkeypatch, lambda mp: mp.setattr(GraphStaging, "begin_layer",
                                                                   lambda self, layer: None))
    assert violations


def test_negative_control_triggers_that_do_not_wait_race_the_layer(monkeypatch):
    """A trigger list forked to the H2D stream without waiting for the layer that read the staging
    pages overwrites them under that layer's reads: the simulation reports it."""

    def on(self, stream, launch) -> None:  # noqa: ANN001
        current = torch.cuda.current_stream()
        torch.cuda.set_stream(stream)
        try:
            launch()
        finally:
            torch.cuda.set_stream(current)

    violations, _ = _on_streams(monkeypatch, lambda mp: mp.setattr(GraphStaging, "_on", on))
    assert violations


def _stray_write_back(mp: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """Before the first graphed step's load: a write-back (D2H) of a resident layer-page of that
    step's last pages -- a copy launched after the boundary's fence, which no code path makes
    today (session 86's review asked for the guard); the step's layers write that page."""
    from sglang_ext.dataplane.graph_step_buffers import GraphStepBuffers as Buffers

    real, done = Buffers.load, []

    def load(self, tables, *args, **kwargs) -> None:  # noqa: ANN001, ANN002, ANN003
        store = self.staging.store if self.staging is not None else None
        if not done and store is not None and tables is not None:
            last = tables.pages[tables._starts_np + tables._counts_np - 1]
            layer, col = np.nonzero(store.map_np[:, last] >= 0)
            if layer.size:  # the store's write-back launch, its indices outside the upload ring and no marks changed
                layers, pages = layer[:1].astype(np.int64), last[col[:1]].astype(np.int64)
                src = store.dev_segs(store.map_np[layers, pages].astype(np.int64))
                dst = store.host_segs(layers, pages)
                store.engine.d2h(torch.from_numpy(src), torch.from_numpy(dst), host_idx=(src, dst))
                done.append(True)
        real(self, tables, *args, **kwargs)

    mp.setattr(Buffers, "load", load)


def test_a_copy_launched_after_the_boundary_is_waited_for_before_the_replay(monkeypatch):
    """A D2H launched between the boundary and the admission reads a page the graph's layers
    write: the admission (``LayerPipeline.in_graph``) waits for it, and every access stays
    ordered. Control: without that wait, the simulation reports the race."""
    violations, got = _on_streams(monkeypatch, _stray_write_back)
    assert violations == [] and got.get("fetched", 0) >= 5, (violations[:3], got)
    with monkeypatch.context() as mp:
        mp.setattr("sglang_ext.dataplane.cuda_transfer_engine.CudaTransferEngine.fence_pending",
                   property(lambda self: False))
        violations, _ = _on_streams(monkeypatch, _stray_write_back)
    assert violations


def test_the_graph_and_the_pipeline_account_the_same_bytes(monkeypatch):
    """A graphed step counts the bytes its launches move as the eager pipeline does: the same
    scenario, graphed or eager, ends with the same H2D and D2H byte counts."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    graphed = _driver()
    _scenario(graphed)
    eager = _driver()
    eager.graph_buffers = GraphStepBuffers(LAYERS, MAX_BATCH, PAGES + MAX_BATCH, eager.core.store.device, None,
                                           eager.core.page_size, GraphStaging(eager.core.store, MAX_BATCH,
                                                                              PAGES + MAX_BATCH))
    eager.graph_buffers.staging.why_not = lambda tables: "eager"  # every staged step runs eagerly
    _scenario(eager)
    a, b = graphed.core.store, eager.core.store
    assert (a.h2d_bytes, a.d2h_bytes, a.host_write_bytes) == (b.h2d_bytes, b.d2h_bytes, b.host_write_bytes)
    assert a.h2d_bytes > 0 and graphed.graph_steps > eager.graph_steps
    assert np.array_equal(a.host.numpy(), b.host.numpy())


def _launches_seen(defer: bool, tokens: int = 1) -> tuple[Any, int, list[int]]:
    """A staged step of ``tokens`` new tokens (1: a decode step) with ``defer_start``: the core,
    the H2D launches before it, and the count after its boundary and at each layer."""
    core = make_core(PAGES + 8)
    core.pipeline.defer_start = defer
    d = CoreDriver(core, seed=3, fast_decode=True, paged_reads=True)
    d.add("a")
    assert d.step([("a", 9)])
    d.want("a", [False, True, False])
    assert d.step([("a", 1)])  # the placement's moves
    launches = core.store.engine.stats.h2d_launches
    seen: list[int] = []
    d.on_layer = lambda layer: seen.append(core.store.engine.stats.h2d_launches)
    name = "prepare_decode_step" if tokens == 1 else "prepare_step"  # an extend: the general boundary
    real = getattr(core, name)

    def boundary(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        out = real(*args, **kwargs)
        seen.append(core.store.engine.stats.h2d_launches)
        return out

    setattr(core, name, boundary)
    assert d.step([("a", tokens)])
    setattr(core, name, real)
    return core, launches, seen


def test_step_start_fetches_go_out_at_the_boundary_unless_deferred(monkeypatch):
    """Eagerly (no graph), a staged step's step-start fetches launch at its boundary, overlapping
    whatever runs before layer 0; deferred (a graph may take the step), at the first layer call --
    a decode step's only: a multi-token step never replays, and keeps the boundary's launch.
    After a deferred step ends, a layer entered outside any step launches nothing (and raises
    nothing)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for defer in (False, True):
        core, launches, seen = _launches_seen(defer)
        assert seen[0] == launches + (0 if defer else 1) and seen[1] == launches + 1, (defer, launches, seen)
    core, launches, seen = _launches_seen(True, tokens=3)  # an extend never replays: not deferred
    assert seen[0] == launches + 1, (launches, seen)
    ends = core.store.engine.stats.h2d_launches
    core.pipeline.end_step()
    core.enter_layer(0)  # no step: nothing to launch, nothing raised
    core.exit_layer(0)
    assert core.store.engine.stats.h2d_launches == ends
